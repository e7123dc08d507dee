# Generated from solutions/ch00_foundations.ipynb, solutions/ch05_deltanet.ipynb
# by python -m qwen_mini.course.build — edit the notebooks, not this file.

"""RMS normalisation, in float32 and cast back: the plain scale `x̂ * w` (Qwen2, Qwen3),
the zero-centred `x̂ * (1 + w)` (Qwen3.5 decoder and q/k norms) and the gated output norm of
Gated DeltaNet `x̂ * w * silu(z)`; the normalisation itself is written once, in `RMSNorm.normalize`.
"""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned per-channel weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim], float32
        """x divided by its root-mean-square, computed in float32 (every variant's first step)."""
        # bfloat16 keeps 8 bits of mantissa: the mean of squares must be taken in float32
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return self.weight * self.normalize(x).to(x.dtype)


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm with the scale stored as an offset from 1: x_hat * (1 + weight), weight starts at 0.

    Qwen3.5's decoder norms and q/k norms. Loading such a weight into a plain `x_hat * weight`
    norm multiplies every activation by a number near 0: the classic silent mistake.
    """

    zero_centred = True  # its neutral weight is 0, not 1 (where a fresh model or a stand-in starts)

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)  # an offset of 0: the scale starts at 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return (self.normalize(x) * (1.0 + self.weight.float())).to(x.dtype)  # scale in float32


class GatedRMSNorm(RMSNorm):
    """The output norm of Gated DeltaNet: x_hat * weight * silu(z), per value head.

    A plain weight (not zero-centred, unlike the decoder norms): checkpoint key `linear_attn.norm`.
    """

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [..., d_v] twice
        x = self.weight * self.normalize(x).to(x.dtype)  # normalise first, then the scale ...
        return (x * F.silu(z.float())).to(x.dtype)  # ... then the gate (in float32)
