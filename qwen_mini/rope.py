# Generated from solutions/ch00_foundations.ipynb, solutions/ch05_deltanet.ipynb
# by python -m qwen_mini.course.build — edit the notebooks, not this file.

"""Rotary position embeddings: the angles of each position, the rotation of each (i, i + D/2)
pair, and partial RoPE, which turns only the first dimensions of each head (Qwen3.5).
"""

import torch


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation angles for each position: [T] -> cos, sin of shape [T, head_dim].

    Pair (i, i + head_dim/2) turns at frequency theta^(-2i/head_dim); angles are computed in
    float32 because positions in the tens of thousands lose whole radians in bfloat16.
    """
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / theta ** (steps / head_dim)  # on the positions' device, as all below
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]: both halves of a pair
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The partner of x that sin multiplies in the rotation of each (i, i + D/2) pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + D/2) pair of x [B, H, T, D] by its position's angle (cos, sin [T, D])."""
    return x * cos + rotate_half(x) * sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head of x [B, H, T, D]; the rest pass as is."""
    r = cos.shape[-1]  # the rotary width (64 of Qwen3.5's 256)
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
