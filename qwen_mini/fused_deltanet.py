# Generated from solutions/ch06_family.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Qwen3-Next's Gated DeltaNet: Qwen3.5's layer (`qwen_mini.deltanet.GatedDeltaNet`) with its
four input projections stored as two, `in_proj_qkvz` and `in_proj_ba`, grouped per key head.

Qwen3.5 keeps `in_proj_qkv` (all q heads, all k heads, all v heads: the order the convolution
reads), `in_proj_z`, `in_proj_b` and `in_proj_a`. Qwen3-Next keeps, for each key head g and the
r = H_v / H_k value heads that read it, the rows q_g | k_g | v_g | z_g in `in_proj_qkvz` and
b_g | a_g in `in_proj_ba`. The same rows, in another order: a fixed permutation, so the two
layers compute the same function (`fused_projection_order` says which row goes where).
"""

import torch
from torch import nn

from qwen_mini.config import Config
from qwen_mini.deltanet import GatedDeltaNet


def fused_projection_order(n_k: int, d_k: int, n_v: int, d_v: int) -> torch.Tensor:
    """[2 H_k d_k + 2 H_v d_v + 2 H_v] int64: for each row of Qwen3-Next's projections stacked
    as [in_proj_qkvz; in_proj_ba], the row of Qwen3.5's [in_proj_qkv; in_proj_z; in_proj_b;
    in_proj_a] it is. So `fused_weight = qwen3_5_weight[order]`, and an output of the fused
    projections `y` is Qwen3.5's `y[..., order.argsort()]`.

    n_k key heads of d_k, n_v value heads of d_v; key head g serves value heads g*r .. g*r+r-1.
    """
    r = n_v // n_k
    key_dim, value_dim = n_k * d_k, n_v * d_v

    def per_key_head(start: int, width: int) -> torch.Tensor:  # [n_k, width]: head g's rows
        return start + torch.arange(n_k * width).view(n_k, width)

    q, k = per_key_head(0, d_k), per_key_head(key_dim, d_k)
    v, z = per_key_head(2 * key_dim, r * d_v), per_key_head(2 * key_dim + value_dim, r * d_v)
    b = per_key_head(2 * key_dim + 2 * value_dim, r)
    a = per_key_head(2 * key_dim + 2 * value_dim + n_v, r)
    qkvz = torch.cat([q, k, v, z], dim=1).flatten()  # head 0's q, k, v, z, then head 1's ...
    ba = torch.cat([b, a], dim=1).flatten()
    return torch.cat([qkvz, ba])


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's linear-attention mixer: `GatedDeltaNet` with the fused projections
    `linear_attn.in_proj_qkvz` [2 H_k d_k + 2 H_v d_v, hidden] and `linear_attn.in_proj_ba`
    [2 H_v, hidden]; the convolution, the rule and the output norm are Qwen3.5's."""

    def __init__(self, cfg: Config, layer_idx: int = 0, arch=None):
        super().__init__(cfg, layer_idx, arch)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        value_dim = self.n_v * self.d_v
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, self.conv_dim + value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.n_v, bias=False)
        self.unfusing = {}  # device -> order.argsort(), made there once (see `unfusing_order`)

    def unfusing_order(self, device: torch.device) -> torch.Tensor:
        """[rows] int64 on `device`: for each of Qwen3.5's rows, where it sits among the fused
        ones (the inverse permutation). Made on that device the first time, then kept: not a
        table rebuilt on the CPU and copied to the GPU at every token."""
        if device not in self.unfusing:
            with device:  # fused_projection_order makes its tensors on the default device
                order = fused_projection_order(self.n_k, self.d_k, self.n_v, self.d_v)
            self.unfusing[device] = order.argsort().to(device)
        return self.unfusing[device]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, hidden] -> (qkv, z, b, a) in Qwen3.5's layout, from the fused projections."""
        fused = torch.cat([self.in_proj_qkvz(x), self.in_proj_ba(x)], dim=-1)  # [B, T, rows]
        unfused = fused[..., self.unfusing_order(x.device)]  # Qwen3.5's rows, in its order
        return unfused.split([self.conv_dim, self.n_v * self.d_v, self.n_v, self.n_v], dim=-1)
