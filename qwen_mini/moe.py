# Generated from solutions/ch03_moe.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Mixture-of-experts feed-forward blocks: routing, grouped dispatch, experts stored one by one
or fused, Qwen3-MoE's sparse block and the shared-expert block of Qwen3-Next / Qwen3.5-MoE.
"""

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.config import Config
from qwen_mini.mlp import MLP


def route(
    logits: torch.Tensor, k: int, norm_topk_prob: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, experts [N, k] int64).

    Probabilities come from a softmax over ALL E experts, computed in float32; each token keeps
    its k most probable experts; with norm_topk_prob their k probabilities are rescaled to sum
    to 1.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
    weights, experts = torch.topk(probs, k, dim=-1)  # [N, k], [N, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def grouped_dispatch(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts_idx: torch.Tensor,
    experts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert(token), one expert call per expert.

    x [N, H]; weights, experts_idx [N, k]; experts[e] maps [n, H] -> [n, H]. Returns [N, H].
    The N * k routing slots are grouped by expert (a sort), each expert runs once on the rows
    routed to it, and the weighted results are added back at their tokens' rows.
    """
    N, k = experts_idx.shape
    flat = experts_idx.reshape(-1)  # [N * k] the expert of each routing slot
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # [E] slots per expert
    out = torch.zeros_like(x)  # [N, H]
    for e, slots in enumerate(torch.split(order, counts)):
        if len(slots) == 0:
            continue  # an expert no token chose costs nothing
        tokens = slots // k  # slot s belongs to token s // k
        y = experts[e](x[tokens]) * weights.reshape(-1)[slots, None]  # [n_e, H]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class FusedExperts(nn.Module):
    """E SwiGLU experts stored as two 3-D tensors, the layout of Qwen3.5-MoE checkpoints:
    gate_up_proj [E, 2 * I, H] (each expert's gate_proj rows, then its up_proj rows) and
    down_proj [E, H, I]. `experts[e]` is expert e as a function [n, H] -> [n, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * H**-0.5)  # no .weight
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * I**-0.5)

    def __len__(self) -> int:
        return self.gate_up_proj.shape[0]

    def __getitem__(self, e: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return partial(self.expert, e)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
        return F.linear(F.silu(gate) * up, self.down_proj[e])


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE feed-forward block: x [B, T, H] -> [B, T, H].

    gate: the router, Linear(H, E) without bias; experts: E SwiGLU experts of width I, stored
    one by one (`experts.{e}.gate_proj`, Qwen3-MoE and Qwen3-Next checkpoints) or fused
    (`experts.gate_up_proj`, Qwen3.5-MoE checkpoints).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = True,
        fused: bool = False,
    ):
        super().__init__()
        H, I, E = hidden_size, intermediate_size, num_experts
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)
        if fused:
            self.experts = FusedExperts(E, H, I)
        else:
            self.experts = nn.ModuleList(MLP(H, I) for _ in range(E))

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [N, E]
        return self.gate(x.reshape(-1, x.shape[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] (or [N, H]) -> the same shape: each token's top_k experts, weighted."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H], N = B * T: routing is per token
        weights, experts_idx = route(self.gate(flat), self.top_k, self.norm_topk_prob)
        return grouped_dispatch(flat, weights, experts_idx, self.experts).view(x.shape)


def shared_expert_output(
    x: torch.Tensor, shared_expert: nn.Module, shared_expert_gate: nn.Module
) -> torch.Tensor:
    """The shared expert's contribution [..., H]: its output scaled, token by token, by a
    number between 0 and 1 computed from the token by shared_expert_gate (Linear(H, 1))."""
    return torch.sigmoid(shared_expert_gate(x)) * shared_expert(x)  # [..., 1] * [..., H]


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen3-Next / Qwen3.5-MoE feed-forward block: the routed experts of SparseMoeBlock plus
    one always-active `shared_expert` (SwiGLU of its own width) gated per token by
    sigmoid(`shared_expert_gate`(x)). x [B, T, H] -> [B, T, H]."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        shared_expert_intermediate_size: int,
        norm_topk_prob: bool = True,
        fused: bool = False,
    ):
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, norm_topk_prob, fused)
        self.shared_expert = MLP(hidden_size, shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]: the routed experts' output plus the gated shared expert."""
        shared = shared_expert_output(x, self.shared_expert, self.shared_expert_gate)
        return super().forward(x) + shared  # the routed experts: SparseMoeBlock's forward


def qwen3_moe_mlp(
    cfg: Config, layer_idx: int, arch=None, block: type[nn.Module] = SparseMoeBlock
) -> nn.Module:
    """The feed-forward block of a qwen3_moe model's layer layer_idx (`block`: the class of the
    sparse layers' block)."""
    if not cfg.is_sparse_layer(layer_idx):
        return MLP(cfg.hidden_size, cfg.intermediate_size)
    return block(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.norm_topk_prob,
    )
