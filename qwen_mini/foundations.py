# Generated from solutions/ch00_foundations.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Chapter 0 building blocks: the safetensors header, RMSNorm, the SwiGLU feed-forward, rotary
position embeddings, parameter counts and the zero-layer tied model."""

import json
import struct
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def read_safetensors_header(path: str | Path) -> dict:
    """The JSON header of a .safetensors file, as a dict.

    {tensor name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, ...}, plus
    "__metadata__" when the file has one. Reads the header only, never the tensor data.
    """
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))  # header length: unsigned 64-bit, little-endian
        return json.loads(f.read(n))


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned per-channel weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        # bfloat16 keeps 8 bits of mantissa: the mean of squares must be taken in float32
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: gate_proj and up_proj widen x, down_proj narrows it back."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation angles for each position: [T] -> cos, sin of shape [T, head_dim].

    Pair (i, i + head_dim/2) turns at frequency theta^(-2i/head_dim); angles are computed in
    float32 because positions in the tens of thousands lose whole radians in bfloat16.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
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


def count_params(config: dict) -> dict:
    """Parameters of a dense Qwen2 / Qwen3 model, part by part, from its config.json as a dict.

    `total` counts the head even when it is tied to the embedding; `unique` counts it once.
    """
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n_q = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_q)
    d = config.get("head_dim") or h // n_q
    q_out, kv_out = n_q * d, n_kv * d

    attention = h * q_out + 2 * h * kv_out + q_out * h  # q, k, v, o
    if config["model_type"] == "qwen2":
        attention += q_out + 2 * kv_out  # Qwen2: biases on q, k, v
    else:
        attention += 2 * d  # Qwen3: QK-Norm, one RMSNorm weight per head_dim for q and for k
        if config.get("attention_bias", False):
            attention += q_out + 2 * kv_out + h  # biases on q, k, v and o
    per_layer = attention + 3 * h * inter + 2 * h  # + SwiGLU + two RMSNorms

    counts = {
        "embed_tokens": vocab * h,
        "per_layer": per_layer,
        "layers": per_layer * config["num_hidden_layers"],
        "norm": h,
        "lm_head": vocab * h,
    }
    counts["total"] = counts["embed_tokens"] + counts["layers"] + h + counts["lm_head"]
    tied = config.get("tie_word_embeddings", False)
    counts["unique"] = counts["total"] - (counts["lm_head"] if tied else 0)
    return counts


class ZeroLayerLM(nn.Module):
    """A Qwen model without decoder layers: embedding -> final RMSNorm -> tied head."""

    def __init__(self, embed_tokens: nn.Embedding, norm: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.norm = norm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, vocab]
        x = self.norm(self.embed_tokens(input_ids))
        return F.linear(x, self.embed_tokens.weight)  # tied: the head is the embedding
