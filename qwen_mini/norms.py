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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        # bfloat16 keeps 8 bits of mantissa: the mean of squares must be taken in float32
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm with the scale stored as an offset from 1: x_hat * (1 + weight), weight starts at 0.

    Qwen3.5's decoder norms and q/k norms. Loading such a weight into a plain `x_hat * weight`
    norm multiplies every activation by a number near 0: the classic silent mistake.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        x32 = x.float()  # mean of squares in float32, as every RMSNorm here
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)  # scale in float32, then cast


class GatedRMSNorm(nn.Module):
    """The output norm of Gated DeltaNet: x_hat * weight * silu(z), per value head.

    A plain weight (not zero-centred, unlike the decoder norms): checkpoint key `linear_attn.norm`.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [..., d_v] twice
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x32.to(dtype)  # normalise first, then the learned scale ...
        return (x * F.silu(z.float())).to(dtype)  # ... then the gate (in float32)
