"""Longer contexts than a model was trained on: the RoPE scaling a config.json may ask for.

Qwen3 is trained on 32,768 positions; its model card extends it to 131,072 by adding
`"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}`
to config.json. Two kinds are implemented, as transformers computes them:

- linear: every pair turns `factor` times slower (positions interpolated);
- YaRN: only the slow pairs (those that turn less than `beta_slow` times over the original
  context) are interpolated, the fast ones (more than `beta_fast` turns) are kept, a linear ramp
  joins the two; cos and sin are then multiplied by an attention factor (0.1 ln(factor) + 1 by
  default), which sharpens the softmax the interpolation flattened.

Both apply at every position, also inside the original context: a YaRN checkpoint's logits at
position 5 differ from the plain model's.
"""

from __future__ import annotations

import math

import torch

from .config import Config, RopeScaling
from .rope import rope_cos_sin


def rotary_cos_sin(
    cfg: Config, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, cfg.rotary_dim] of `positions` [T], with the config's RoPE scaling."""
    s = cfg.rope_scaling
    if s is None:
        return rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, dtype)
    if s.rope_type == "linear":  # angle = (position / factor) * frequency
        return rope_cos_sin(positions.float() / s.factor, cfg.rotary_dim, cfg.rope_theta, dtype)
    # YaRN changes the frequencies pair by pair, so it computes the angles itself
    inv_freq = yarn_inv_freq(cfg.rotary_dim, cfg.rope_theta, s, positions.device)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, rotary_dim]: both halves of a pair
    factor = yarn_attention_factor(s)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def yarn_inv_freq(
    rotary_dim: int, theta: float, s: RopeScaling, device: torch.device | str | None = None
) -> torch.Tensor:
    """The per-pair frequencies [rotary_dim / 2] of YaRN: interpolated (divided by the factor)
    for the slow pairs, kept for the fast ones, a linear ramp between; made on `device` (the
    positions'), not copied there at every call."""

    def pair_making(turns: float) -> float:  # the pair index that turns `turns` times
        return (
            rotary_dim
            * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = pair_making(s.beta_fast), pair_making(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: a ramp of one step, not a division by zero
    pairs = torch.arange(rotary_dim // 2, dtype=torch.float32, device=device)
    interpolated = ((pairs - low) / (high - low)).clamp(0, 1)  # 0: kept ... 1: interpolated
    inv_freq = 1.0 / theta ** (2 * pairs / rotary_dim)  # rope_cos_sin's, pair by pair
    return inv_freq / s.factor * interpolated + inv_freq * (1 - interpolated)


def yarn_attention_factor(s: RopeScaling) -> float:
    """What cos and sin are multiplied by: config.json's attention_factor, else from the factor
    (and mscale / mscale_all_dim where both are given, as DeepSeek-style configs do)."""
    if s.attention_factor is not None:
        return s.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    return mscale(s.factor)
