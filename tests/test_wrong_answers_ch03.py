"""Typical wrong answers to the chapter 3 exercises: each must fail its checks, with a message
that names the idea it gets wrong (not only a differing number)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini import moe
from qwen_mini.course.checking import run_checks
from qwen_mini.course.lab import ch03 as lab
from qwen_mini.mlp import MLP

# --- route ---------------------------------------------------------------------------------------


def route_never_renormalises(logits, k, norm_topk_prob=True):
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    w, i = probs.topk(k, -1)
    return w.to(logits.dtype), i


def route_softmax_after_topk(logits, k, norm_topk_prob=True):
    top = logits.float().topk(k, -1)  # the k largest logits, softmax over them only
    return torch.softmax(top.values, -1).to(logits.dtype), top.indices


def route_softmax_in_bfloat16(logits, k, norm_topk_prob=True):
    probs = torch.softmax(logits, -1)  # in the logits' dtype
    w, i = probs.topk(k, -1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w, i


# --- grouped_dispatch ----------------------------------------------------------------------------


def dispatch_forgets_the_weights(x, weights, experts_idx, experts):
    return moe.grouped_dispatch(x, torch.ones_like(weights), experts_idx, experts)


def dispatch_one_call_per_slot(x, weights, experts_idx, experts):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(experts_idx.shape[1]):
            out[t] += weights[t, s] * experts[int(experts_idx[t, s])](x[t : t + 1])[0]
    return out


def dispatch_dense_masked(x, weights, experts_idx, experts):
    out = torch.zeros_like(x)
    for e in range(len(experts)):
        w = (weights * (experts_idx == e)).sum(-1, keepdim=True)  # [N, 1], 0 if not chosen
        out += w * experts[e](x)  # every expert on every token
    return out


def dispatch_wrong_token_of_slot(x, weights, experts_idx, experts):
    N, k = experts_idx.shape
    flat = experts_idx.reshape(-1)
    out = torch.zeros_like(x)
    for e in flat.unique().tolist():
        slots = (flat == e).nonzero().squeeze(1)
        tokens = slots % N  # should be slots // k
        y = experts[e](x[tokens]) * weights.reshape(-1)[slots, None]
        out.index_add_(0, tokens, y)
    return out


# --- shared_expert_output ------------------------------------------------------------------------


def shared_without_sigmoid(x, shared_expert, shared_expert_gate):
    return shared_expert_gate(x) * shared_expert(x)


def shared_with_softmax(x, shared_expert, shared_expert_gate):
    return torch.softmax(shared_expert_gate(x), dim=-1) * shared_expert(x)


# --- routing_statistics --------------------------------------------------------------------------


def stats_as_fractions(logits, k):
    counts, prob_sums, n = lab.routing_statistics(logits, k)
    return counts / (n * k), prob_sums, n


def stats_probs_of_the_top_k_only(logits, k):
    weights, idx = moe.route(logits, k, True)
    counts = torch.bincount(idx.reshape(-1), minlength=logits.shape[-1]).float()
    prob_sums = torch.zeros(logits.shape[-1]).index_add_(0, idx.reshape(-1), weights.reshape(-1))
    return counts, prob_sums, logits.shape[0]


# --- load_balancing_loss -------------------------------------------------------------------------


def loss_f_over_slots(router_logits, k):
    return lab.load_balancing_loss(router_logits, k) / k


def loss_without_factor_e(router_logits, k):
    return lab.load_balancing_loss(router_logits, k) / router_logits[0].shape[-1]


def loss_mean_of_layers(router_logits, k):
    return torch.stack([lab.load_balancing_loss([x], k) for x in router_logits]).mean()


# --- global_load_balancing_loss ------------------------------------------------------------------


def global_per_micro_batch(micro_batches, k):
    return torch.stack([lab.load_balancing_loss(m, k) for m in micro_batches]).mean()


def global_last_micro_batch_only(micro_batches, k):
    return lab.load_balancing_loss(micro_batches[-1], k)


# --- split_mlp -----------------------------------------------------------------------------------


def _experts_from(chunks, H):
    experts = nn.ModuleList()
    for gate, up, down in chunks:
        expert = MLP(H, gate.shape[0])
        expert.gate_proj.weight = nn.Parameter(gate.clone())
        expert.up_proj.weight = nn.Parameter(up.clone())
        expert.down_proj.weight = nn.Parameter(down.clone())
        experts.append(expert)
    return experts


def split_down_proj_along_rows(mlp, num_experts):
    E = num_experts
    g, u, d = (m.weight.detach() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    return _experts_from(zip(g.chunk(E, 0), u.chunk(E, 0), d.chunk(E, 0), strict=True), g.shape[1])


def split_along_hidden(mlp, num_experts):
    E = num_experts
    g, u, d = (m.weight.detach() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    return _experts_from(zip(g.chunk(E, 1), u.chunk(E, 1), d.chunk(E, 0), strict=True), g.shape[1])


def split_strided_neurons(mlp, num_experts):
    E = num_experts
    g, u, d = (m.weight.detach() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    return _experts_from(((g[e::E], u[e::E], d[:, e::E]) for e in range(E)), g.shape[1])


def split_sharing_storage(mlp, num_experts):
    E, H = num_experts, mlp.gate_proj.in_features
    experts = nn.ModuleList()
    for gate, up, down in zip(
        mlp.gate_proj.weight.chunk(E, 0),
        mlp.up_proj.weight.chunk(E, 0),
        mlp.down_proj.weight.chunk(E, 1),
        strict=True,
    ):
        expert = MLP(H, gate.shape[0])
        expert.gate_proj.weight.data = gate.data  # a view of the dense weight
        expert.up_proj.weight.data = up.data
        expert.down_proj.weight.data = down.data
        experts.append(expert)
    return experts


WRONG = [
    ("ch03.route", route_never_renormalises, "no renormalisation"),
    ("ch03.route", route_softmax_after_topk, "softmax taken after top-k"),
    ("ch03.route", route_softmax_in_bfloat16, "float32"),
    ("ch03.grouped_dispatch", dispatch_forgets_the_weights, "routing weight"),
    ("ch03.grouped_dispatch", dispatch_one_call_per_slot, "one call per expert"),
    ("ch03.grouped_dispatch", dispatch_dense_masked, "dense masked dispatch"),
    ("ch03.grouped_dispatch", dispatch_wrong_token_of_slot, "token 1 = 0.5 expert_0(x1)"),
    ("ch03.shared_expert_output", shared_without_sigmoid, "sigmoid is missing"),
    ("ch03.shared_expert_output", shared_with_softmax, "softmax over one logit"),
    ("ch03.routing_statistics", stats_as_fractions, "raw counts"),
    ("ch03.routing_statistics", stats_probs_of_the_top_k_only, "softmax over ALL experts"),
    ("ch03.load_balancing_loss", loss_f_over_slots, "fraction of TOKENS"),
    ("ch03.load_balancing_loss", loss_without_factor_e, "factor E"),
    ("ch03.load_balancing_loss", loss_mean_of_layers, "averaged per-layer losses"),
    ("ch03.global_load_balancing_loss", global_per_micro_batch, "per-micro-batch"),
    ("ch03.global_load_balancing_loss", global_last_micro_batch_only, "per-micro-batch"),
    ("ch03.split_mlp", split_down_proj_along_rows, "INTERMEDIATE dimension"),
    ("ch03.split_mlp", split_along_hidden, "INTERMEDIATE dimension"),
    ("ch03.split_mlp", split_strided_neurons, "contiguous block"),
    ("ch03.split_mlp", split_sharing_storage, "copy the weights"),
]


@pytest.mark.parametrize("exercise, wrong, idea", WRONG, ids=[w[1].__name__ for w in WRONG])
def test_wrong_answer_fails_naming_the_idea(exercise, wrong, idea):
    public = run_checks(exercise, wrong)
    assert public.status == "failed", f"{wrong.__name__} passes the public checks"
    assert idea in public.message, public.message
    assert run_checks(exercise, wrong, hidden=True).status == "failed"


@pytest.mark.parametrize("exercise", sorted({w[0] for w in WRONG}))
def test_the_package_answer_passes(exercise):
    from qwen_mini.course.checking import reference

    assert run_checks(exercise, reference(exercise), hidden=True).ok


def test_softmax_in_bfloat16_really_differs():
    """The float32 warning is not pedantry on this hardware: weights computed from a bfloat16
    softmax differ from the float32 ones after the cast."""
    logits = (torch.randn(64, 16, generator=torch.Generator().manual_seed(2)) * 2).bfloat16()
    w32, _ = moe.route(logits, 4, True)
    w16, _ = route_softmax_in_bfloat16(logits, 4, True)
    assert (w32 != w16).sum() > 10
    assert F.softmax(logits.float(), -1).dtype == torch.float32
