# Generated from solutions/ch03_moe.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Experiments of the mixture-of-experts chapter: routing statistics, the load-balancing
losses, and the split of a dense feed-forward into experts. Not used to run a model.
"""

from collections.abc import Sequence

import torch
from torch import nn

from qwen_mini.mlp import MLP


def routing_statistics(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What the load-balancing loss needs from one layer's router logits [N, E]:
    (counts [E]: how many of the N tokens chose each expert among their top k, so the counts
    sum to N * k; prob_sums [E]: each expert's softmax probability summed over the tokens;
    N). All three are sums, so statistics of several batches add up."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
    experts_idx = torch.topk(probs, k, dim=-1).indices  # [N, k]
    counts = torch.bincount(experts_idx.reshape(-1), minlength=logits.shape[-1]).float()
    return counts, probs.sum(dim=0), logits.shape[0]


def load_balancing_loss(router_logits: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss E * sum_e f_e * P_e, pooled over the layers given
    (one [N, E] tensor per layer; pass one layer for a per-layer loss).

    f_e: the fraction of tokens that have expert e among their top k (the f_e sum to k);
    P_e: the mean router probability of expert e (the P_e sum to 1). A perfectly balanced
    router gives k. Equal to transformers' `load_balancing_loss_func` (no padding mask).
    """
    stats = [routing_statistics(logits, k) for logits in router_logits]
    counts = sum(s[0] for s in stats)  # [E] pooled over the layers
    prob_sums = sum(s[1] for s in stats)
    rows = sum(s[2] for s in stats)  # tokens x layers
    f, P = counts / rows, prob_sums / rows  # [E], [E]
    return router_logits[0].shape[-1] * (f * P).sum()


def global_load_balancing_loss(
    micro_batches: Sequence[Sequence[torch.Tensor]], k: int
) -> torch.Tensor:
    """The load-balancing loss of a global batch made of several micro-batches.

    micro_batches[m][l]: layer l's router logits [N_m, E] on micro-batch m. The expert
    frequencies f_e are counted over the whole global batch (all micro-batches together), as
    Qwen3 does (Qiu et al. 2025), instead of averaging the micro-batches' own losses.
    """
    every_layer = [logits for micro in micro_batches for logits in micro]
    return load_balancing_loss(every_layer, k)


def split_mlp(mlp: MLP, num_experts: int) -> nn.ModuleList:
    """Split a dense SwiGLU MLP of width I into num_experts experts of width I / num_experts.

    Expert e owns intermediate neurons e * I/E ... (e + 1) * I/E - 1: its rows of gate_proj and
    up_proj and the matching columns of down_proj. The sum of all experts' outputs equals
    the dense MLP's output.
    """
    H, I = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    if I % num_experts:
        raise ValueError(f"intermediate size {I} is not divisible by {num_experts} experts")
    width = I // num_experts
    experts = nn.ModuleList(MLP(H, width) for _ in range(num_experts))
    with torch.no_grad():
        for e, expert in enumerate(experts):
            rows = slice(e * width, (e + 1) * width)
            expert.gate_proj.weight.copy_(mlp.gate_proj.weight[rows])  # [I/E, H]
            expert.up_proj.weight.copy_(mlp.up_proj.weight[rows])  # [I/E, H]
            expert.down_proj.weight.copy_(mlp.down_proj.weight[:, rows])  # [H, I/E]
    return experts.to(mlp.gate_proj.weight.dtype)
