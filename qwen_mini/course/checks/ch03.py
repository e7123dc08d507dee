"""Checks for chapter 3 (mixture of experts: routing, dispatch, load balancing, shared expert,
the expert split).

Each exercise is a list of cases, compared with the package reference or with a value worked out by
hand (a softmax of [ln 1 … ln 4], a perfectly balanced router scoring k), and a catalogue of typical
mistakes whose ideas the messages name. Dispatch cases also record how often, and on how many
rows, each expert runs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qwen_mini import moe as ref
from qwen_mini.course.checking import between, mistake, named, randn, register
from qwen_mini.course.fakes.ch03 import CountedFused, CountedMLP, CountingExpert
from qwen_mini.course.lab import ch03 as lab
from qwen_mini.course.observing import gradients
from qwen_mini.course.variants import case, registered
from qwen_mini.mlp import MLP

register("ch03.route", reference=ref.route, points=2, title="Router: softmax, top-k, renormalise")
register(
    "ch03.grouped_dispatch",
    reference=ref.grouped_dispatch,
    points=2,
    title="Grouped dispatch: one call per expert, results added back per token",
)
register(
    "ch03.SparseMoeBlock",
    reference=ref.SparseMoeBlock,
    points=2,
    title="The Qwen3-MoE block: route every token, dispatch, weighted combine",
)
register(
    "ch03.shared_expert_output",
    reference=ref.shared_expert_output,
    points=1,
    title="The shared expert and its sigmoid gate",
)
register(
    "ch03.SharedExpertMoeBlock",
    reference=ref.SharedExpertMoeBlock,
    points=1,
    title="The shared-expert block: routed experts plus the gated shared expert",
)
register(
    "ch03.routing_statistics",
    reference=lab.routing_statistics,
    points=1,
    title="Routing statistics: expert counts and probability sums",
)
register(
    "ch03.load_balancing_loss",
    reference=lab.load_balancing_loss,
    points=2,
    title="Load-balancing loss, pooled over layers",
)
register(
    "ch03.global_load_balancing_loss",
    reference=lab.global_load_balancing_loss,
    points=2,
    title="Load-balancing loss over a global batch of micro-batches",
)
register(
    "ch03.split_mlp",
    reference=lab.split_mlp,
    points=2,
    title="Split a dense SwiGLU MLP into fine-grained experts",
)


# --- route ----------------------------------------------------------------------------------------


def _route(route, logits, k, norm):
    return named(route(logits, k, norm), "weights [N, k]", "experts [N, k] (the k most probable)")


def _routed(weights):
    return lambda *_: {
        "weights [N, k]": torch.tensor([weights]),
        "experts [N, k] (the k most probable)": torch.tensor([[3, 2]]),
    }


def _hand_logits(norm):  # softmax of [ln 1, ln 2, ln 3, ln 4] = [1, 2, 3, 4] / 10
    return lambda g: (torch.tensor([[1.0, 2.0, 3.0, 4.0]]).log(), 2, norm)


def _random_logits(N, E, k, norm, dtype=torch.float32):
    return lambda g: ((randn(N, E, g=g) * 2).to(dtype), k, norm)


def _route_hidden(norm):
    def inputs(g):
        E = 2 ** between(g, 2, 7)
        return _random_logits(between(g, 1, 40), E, between(g, 1, min(E, 8)), norm)(g)

    return inputs


case(
    "ch03.route",
    "hand-worked: logits [ln 1, ln 2, ln 3, ln 4], k = 2, renormalised: 4/7, 3/7",
    _hand_logits(True),
    _route,
    _routed([4 / 7, 3 / 7]),
    atol=1e-6,
)
case(
    "ch03.route",
    "hand-worked: logits [ln 1, ln 2, ln 3, ln 4], k = 2, not renormalised: 0.4, 0.3",
    _hand_logits(False),
    _route,
    _routed([0.4, 0.3]),
    atol=1e-6,
)
for norm in (True, False):
    case(
        "ch03.route",
        f"20 tokens, 8 experts, k=3, norm_topk_prob={norm}",
        _random_logits(20, 8, 3, norm),
        _route,
        atol=1e-6,
        rtol=1e-5,
        seed=1,
    )
    case(
        "ch03.route",
        f"other sizes, norm_topk_prob={norm}",
        _route_hidden(norm),
        _route,
        atol=1e-6,
        rtol=1e-5,
        hidden=True,
    )
case(
    "ch03.route",
    "bfloat16 logits: float32 softmax, weights returned in bfloat16",
    _random_logits(64, 16, 4, True, torch.bfloat16),
    _route,
    seed=2,
)


@mistake(
    "ch03.route",
    "with norm_topk_prob=True the k weights must be renormalised to sum to 1; yours are the raw "
    "softmax probabilities (no renormalisation)",
)
def route_never_renormalises(logits, k, norm_topk_prob=True):
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    w, i = probs.topk(k, -1)
    return w.to(logits.dtype), i


@mistake(
    "ch03.route",
    "with norm_topk_prob=False the weights are the probabilities of the softmax over ALL "
    "experts; yours sum to 1 over the top k (a softmax taken after top-k renormalises whether "
    "asked or not)",
)
def route_softmax_after_topk(logits, k, norm_topk_prob=True):
    top = logits.float().topk(k, -1)  # the k largest logits, softmax over them only
    return torch.softmax(top.values, -1).to(logits.dtype), top.indices


@mistake(
    "ch03.route",
    "bfloat16 logits: take the softmax and the renormalisation in float32 "
    "(torch.softmax(..., dtype=torch.float32)) and cast only the final weights",
)
def route_softmax_in_bfloat16(logits, k, norm_topk_prob=True):
    probs = torch.softmax(logits, -1)  # in the logits' dtype
    w, i = probs.topk(k, -1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w, i


@mistake(
    "ch03.route",
    "the expert indices must stay int64 (torch.long, as topk returns them): index tensors in "
    "another dtype are cast again wherever they index",
)
def route_int32_indices(logits, k, norm_topk_prob=True):
    weights, experts = ref.route(logits, k, norm_topk_prob)
    return weights, experts.int()


# --- grouped_dispatch -----------------------------------------------------------------------------


def _experts(g, n: int, h: int) -> list[nn.Module]:
    """n non-linear experts (tanh of a linear map: a sum of inputs would not pass)."""
    experts = []
    for _ in range(n):
        linear = nn.Linear(h, h, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(h, h, generator=g) / h**0.5)
        experts.append(CountingExpert(linear, nn.Tanh()))
    return experts


def _dispatch_inputs(N, H, E, k):
    def inputs(g):
        x, logits = randn(N, H, g=g), randn(N, E, g=g) * 2
        return (x, *ref.route(logits, k, True), _experts(g, E, H))

    return inputs


def _dispatch_hidden(g):
    E = between(g, 2, 32)
    return _dispatch_inputs(between(g, 1, 40), 4 * between(g, 1, 4), E, between(g, 1, min(E, 4)))(g)


def _dispatched(grouped_dispatch, x, weights, idx, experts):
    """The output, and how often and on how many rows each expert ran (counted in forward)."""
    calls, rows = [0] * len(experts), [0] * len(experts)

    def count(n_rows, e):
        calls[e] += 1
        rows[e] += n_rows

    for e, expert in enumerate(experts):
        expert.count = lambda n_rows, e=e: count(n_rows, e)
    with torch.no_grad():
        out = grouped_dispatch(x, weights, idx, experts)
    return {
        "output [N, H]": out,
        "calls of each expert (one per expert chosen, none for the others)": calls,
        "rows each expert ran on (the tokens that chose it)": rows,
    }


def _scaling_experts(g):
    # token 0: 0.75 * 1000 x0 + 0.25 * 10 x0 = 752.5 x0; token 1: 0.5 * 10 x1 + 0.5 * 100 x1
    experts = [CountingExpert(nn.Linear(2, 2, bias=False)) for _ in range(3)]
    with torch.no_grad():
        for expert, scale in zip(experts, (10.0, 100.0, 1000.0), strict=True):
            expert[0].weight.copy_(scale * torch.eye(2))
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    return x, torch.tensor([[0.75, 0.25], [0.5, 0.5]]), torch.tensor([[2, 0], [0, 1]]), experts


case(
    "ch03.grouped_dispatch",
    "hand-worked (token 0 = 0.75 expert_2(x0) + 0.25 expert_0(x0), token 1 = 0.5 expert_0(x1) + "
    "0.5 expert_1(x1))",
    _scaling_experts,
    expected=lambda *_: torch.tensor([[752.5, 1505.0], [165.0, 220.0]]),
    atol=1e-4,
)
case(
    "ch03.grouped_dispatch",
    "12 tokens, 6 experts, k=2: each chosen expert called once",
    _dispatch_inputs(12, 8, 6, 2),
    _dispatched,
    atol=1e-5,
    seed=20,
    variants=("meta",),
)


def _idle_inputs(g):
    """6 tokens, 8 experts, k = 2, every choice among experts 0-5: 6 and 7 are chosen by none."""
    x, weights = randn(6, 8, g=g), torch.softmax(randn(6, 2, g=g), -1)
    experts_idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(6)])
    return x, weights, experts_idx, _experts(g, 8, 8)


case(
    "ch03.grouped_dispatch",
    "6 tokens, 8 experts, k=2; experts 6 and 7 are chosen by no token: never called",
    _idle_inputs,
    _dispatched,
    atol=1e-5,
    seed=21,
)


def _bf16_dispatch(g):
    x, weights, idx, experts = _dispatch_inputs(10, 8, 4, 2)(g)
    return x.bfloat16(), weights.bfloat16(), idx, [e.bfloat16() for e in experts]


case(
    "ch03.grouped_dispatch",
    "bfloat16 tokens, weights and experts: the output is bfloat16",
    _bf16_dispatch,
    _dispatched,
    atol=2e-2,
    rtol=2e-2,
    seed=22,
)
for n in range(3):
    case(
        "ch03.grouped_dispatch",
        f"other sizes {n + 1}",
        _dispatch_hidden,
        _dispatched,
        atol=1e-5,
        hidden=True,
    )


@mistake(
    "ch03.grouped_dispatch",
    "the experts' outputs are summed without their routing weights; multiply each expert's "
    "output by the token's weight for that expert",
)
def dispatch_forgets_the_weights(x, weights, experts_idx, experts):
    return ref.grouped_dispatch(x, torch.ones_like(weights), experts_idx, experts)


@mistake(
    "ch03.grouped_dispatch",
    "an expert is called more than once; group its tokens and call it once (one call per "
    "expert, not per token or per slot)",
)
def dispatch_one_call_per_slot(x, weights, experts_idx, experts):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(experts_idx.shape[1]):
            out[t] += weights[t, s] * experts[int(experts_idx[t, s])](x[t : t + 1])[0]
    return out


@mistake(
    "ch03.grouped_dispatch",
    "every expert runs on the whole batch (a dense masked dispatch): run only the experts that "
    "received tokens, each on exactly the rows of the tokens that chose it",
)
def dispatch_dense_masked(x, weights, experts_idx, experts):
    out = torch.zeros_like(x)
    for e in range(len(experts)):
        w = (weights * (experts_idx == e)).sum(-1, keepdim=True)  # [N, 1], 0 if not chosen
        out += w * experts[e](x)
    return out


@mistake(
    "ch03.grouped_dispatch",
    "the outputs go back to the wrong tokens: slot s of the flattened [N·k] choices belongs to "
    "token s // k",
)
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


@mistake(
    "ch03.grouped_dispatch",
    "an expert no token chose is called (on zero rows): skip it; it is never called",
)
def dispatch_calls_idle_experts(x, weights, experts_idx, experts):
    out = torch.zeros_like(x)
    for e in range(len(experts)):
        token, slot = (experts_idx == e).nonzero(as_tuple=True)  # possibly none
        out.index_add_(0, token, experts[e](x[token]) * weights[token, slot, None])
    return out


@mistake(
    "ch03.grouped_dispatch",
    "the weight of a slot is taken at the token's index: weights.reshape(-1)[s] is slot s's "
    "weight, and slot s belongs to token s // k",
)
def dispatch_weight_at_token_index(x, weights, experts_idx, experts):
    N, k = experts_idx.shape
    flat = experts_idx.reshape(-1)
    out = torch.zeros_like(x)
    for e in flat.unique().tolist():
        slots = (flat == e).nonzero().squeeze(1)
        tokens = slots // k
        out.index_add_(0, tokens, experts[e](x[tokens]) * weights.reshape(-1)[tokens, None])
    return out


@mistake(
    "ch03.grouped_dispatch",
    "bfloat16 tokens give a float32 output: build the output like x (torch.zeros_like(x)), in "
    "the tokens' dtype",
)
def dispatch_float32_output(x, weights, experts_idx, experts):
    out = torch.zeros(x.shape)  # float32 whatever x is
    N, k = experts_idx.shape
    for e in experts_idx.unique().tolist():
        token, slot = (experts_idx == e).nonzero(as_tuple=True)
        out.index_add_(0, token, (experts[e](x[token]) * weights[token, slot, None]).float())
    return out


# --- shared_expert_output -------------------------------------------------------------------------


def _shared_inputs(*shape, gate_zero=False):
    def inputs(g):
        h = shape[-1]
        expert, gate = MLP(h, 2 * h), nn.Linear(h, 1, bias=False)
        with torch.no_grad():
            for p in list(expert.parameters()) + list(gate.parameters()):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            gate.weight.mul_(0 if gate_zero else 3)
        return randn(*shape, g=g), expert, gate

    return inputs


def _no_grad(fn):
    def call(impl, *arguments):
        with torch.no_grad():
            return fn(impl, *arguments)

    return call


shared = _no_grad(lambda impl, *arguments: impl(*arguments))
case(
    "ch03.shared_expert_output",
    "hand-worked: a gate logit of 0 halves the shared expert's output",
    _shared_inputs(1, 3, 4, gate_zero=True),
    shared,
    _no_grad(lambda x, expert, gate: 0.5 * expert(x)),
    atol=1e-6,
    seed=40,
)
case(
    "ch03.shared_expert_output",
    "random weights, tokens [B, T, H]",
    _shared_inputs(2, 5, 8),
    shared,
    atol=1e-6,
    rtol=1e-5,
    seed=42,
    variants=("bfloat16",),
)
case(
    "ch03.shared_expert_output",
    "tokens [N, H]",
    _shared_inputs(7, 16),
    shared,
    atol=1e-6,
    rtol=1e-5,
    hidden=True,
)


case(
    "ch03.shared_expert_output",
    "bfloat16 tokens and modules: the output is bfloat16",
    lambda g: tuple(a.bfloat16() for a in _shared_inputs(2, 3, 8)(g)),
    shared,
    atol=2e-2,
    rtol=2e-2,
    seed=43,
)


@mistake(
    "ch03.shared_expert_output",
    "the output is scaled by the raw gate logit; the sigmoid is missing: scale by "
    "sigmoid(shared_expert_gate(x)), a number between 0 and 1",
)
def shared_without_sigmoid(x, shared_expert, shared_expert_gate):
    return shared_expert_gate(x) * shared_expert(x)


@mistake(
    "ch03.shared_expert_output",
    "the output is the shared expert's, unscaled: the gate is missing (a softmax over one logit "
    "is always 1); scale by sigmoid(shared_expert_gate(x))",
)
def shared_with_softmax(x, shared_expert, shared_expert_gate):
    return torch.softmax(shared_expert_gate(x), dim=-1) * shared_expert(x)


@mistake(
    "ch03.shared_expert_output",
    "bfloat16 tokens give a float32 output: keep the gate and the product in the tokens' dtype",
)
def shared_gate_in_float32(x, shared_expert, shared_expert_gate):
    return torch.sigmoid(shared_expert_gate(x).float()) * shared_expert(x).float()


# --- routing_statistics ---------------------------------------------------------------------------


def _statistics(routing_statistics, logits, k):
    parts = "counts [E] (summing to N * k)", "prob_sums [E] (softmax over ALL experts)", "N"
    return named(routing_statistics(logits, k), *parts)


case(
    "ch03.routing_statistics",
    "hand-worked: 3 tokens, 3 experts, k = 2: every expert chosen twice",
    lambda g: (torch.tensor([[5.0, 4.0, 0.0], [0.0, 5.0, 4.0], [5.0, 0.0, 4.0]]), 2),
    _statistics,
    atol=1e-6,
)
case(
    "ch03.routing_statistics",
    "30 tokens, 8 experts, k=2",
    lambda g: (randn(30, 8, g=g) * 2, 2),
    _statistics,
    atol=1e-5,
    seed=50,
    variants=("meta",),
)


def _unused_last(g):  # 12 tokens, 6 experts, k = 2; expert 5 scores lowest for every token
    logits = randn(12, 6, g=g)
    logits[:, 5] = -10.0
    return logits, 2


case(
    "ch03.routing_statistics",
    "12 tokens, 6 experts, k=3",
    lambda g: (randn(12, 6, g=g) * 2, 3),
    _statistics,
    atol=1e-5,
    rtol=1e-5,
    seed=51,
)
case(
    "ch03.routing_statistics",
    "the last expert (of 6) is chosen by no token: its count is 0, and there are still 6 counts",
    _unused_last,
    _statistics,
    atol=1e-5,
    seed=52,
)
case(
    "ch03.routing_statistics",
    "bfloat16 logits: the softmax, the counts and the sums in float32",
    lambda g: ((randn(20, 8, g=g) * 2).bfloat16(), 2),
    _statistics,
    atol=1e-5,
    rtol=1e-5,
    seed=53,
)


def _statistics_gradient(routing_statistics, logits, k):
    (counts, prob_sums, n), (grad,) = gradients(routing_statistics, logits, k)
    return {"prob_sums": prob_sums, GRADIENT: grad}


GRADIENT = "the gradient of the result with respect to the router logits (what trains the router)"
DETACHED = (
    "no gradient reaches the router logits (.detach(), .item(), .tolist() or torch.tensor(...) "
    "of a computed value cut the graph): compute the probabilities from the logits themselves, "
    "so that a loss built on them trains the router"
)
case(
    "ch03.routing_statistics",
    "the probability sums carry the gradient back to the logits (the loss trains through them)",
    lambda g: (randn(10, 6, g=g) * 2, 2),
    _statistics_gradient,
    atol=1e-5,
    rtol=1e-5,
    seed=54,
)
case(
    "ch03.routing_statistics",
    "other sizes, with the gradient",
    lambda g: (randn(between(g, 2, 20), between(g, 3, 16), g=g) * 2, between(g, 1, 3)),
    _statistics_gradient,
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)
case(
    "ch03.routing_statistics",
    "other sizes",
    lambda g: (randn(between(g, 1, 30), 64, g=g) * 2, between(g, 1, 8)),
    _statistics,
    atol=1e-5,
    hidden=True,
)


@mistake(
    "ch03.routing_statistics",
    "counts are fractions; return raw counts (they sum to N * k), so that statistics of several "
    "batches can be added",
)
def stats_as_fractions(logits, k):
    counts, prob_sums, n = lab.routing_statistics(logits, k)
    return counts / (n * k), prob_sums, n


@mistake(
    "ch03.routing_statistics",
    "prob_sums add only the top-k weights: add the softmax over ALL experts of every token",
)
def stats_probs_of_the_top_k_only(logits, k):
    weights, idx = ref.route(logits, k, True)
    counts = torch.bincount(idx.reshape(-1), minlength=logits.shape[-1]).float()
    prob_sums = torch.zeros(logits.shape[-1]).index_add_(0, idx.reshape(-1), weights.reshape(-1))
    return counts, prob_sums, logits.shape[0]


@mistake("ch03.routing_statistics", DETACHED)
def stats_detached(logits, k):
    return lab.routing_statistics(logits.detach(), k)


@mistake(
    "ch03.routing_statistics",
    "k is hard-coded: count each token's top k experts for the k given",
)
def stats_k_hard_coded(logits, k):
    return lab.routing_statistics(logits, 2)


@mistake(
    "ch03.routing_statistics",
    "an expert no token chose is missing from the counts: bincount needs minlength=E, so that "
    "there is one count per expert even when the last ones are never chosen",
)
def stats_bincount_without_minlength(logits, k):
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    counts = torch.bincount(probs.topk(k, -1).indices.reshape(-1)).float()
    return counts, probs.sum(0), logits.shape[0]


@mistake(
    "ch03.routing_statistics",
    "bfloat16 logits: take the softmax in float32 (torch.softmax(..., dtype=torch.float32)) and "
    "return float32 counts and sums",
)
def stats_in_the_logits_dtype(logits, k):
    probs = torch.softmax(logits, -1)
    counts = torch.bincount(probs.topk(k, -1).indices.reshape(-1), minlength=logits.shape[-1])
    return counts.to(logits.dtype), probs.sum(0), logits.shape[0]


# --- load_balancing_loss --------------------------------------------------------------------------


def _balanced(g):  # token i chooses experts i and i + 1: every f_e = 1/2, every P_e = 1/4
    logits = torch.zeros(4, 4)
    for i in range(4):
        logits[i, i] = logits[i, (i + 1) % 4] = 30.0
    return [logits], 2


def _layers(n, N, E, k, scale=2.0):
    def inputs(g):
        layers = [randn(N, E, g=g) * scale for _ in range(n)]
        for i, x in enumerate(layers):  # layers preferring different experts: pooling matters
            x[:, (2 * i) % E] += 3
        return layers, k

    return inputs


def _layers_hidden(g):
    E = between(g, 3, 16)
    return _layers(between(g, 2, 4), between(g, 3, 12), E, between(g, 2, min(E, 4)), 3.0)(g)


case(
    "ch03.load_balancing_loss",
    "hand-worked: a perfectly balanced router scores exactly k",
    _balanced,
    expected=lambda *_: torch.tensor(2.0),
    atol=1e-5,
)
case(
    "ch03.load_balancing_loss",
    "one layer, E=8, k=2",
    _layers(1, 16, 8, 2),
    atol=1e-6,
    rtol=1e-5,
    seed=60,
    variants=("meta",),
)
case(
    "ch03.load_balancing_loss",
    "three layers pooled, E=8, k=2",
    _layers(3, 16, 8, 2),
    atol=1e-6,
    rtol=1e-5,
    seed=61,
)


case(
    "ch03.load_balancing_loss",
    "two layers, E=6, k=3",
    _layers(2, 12, 6, 3),
    atol=1e-6,
    rtol=1e-5,
    seed=62,
)


def _loss_gradient(loss_fn, router_logits, k):
    loss, grads = gradients(loss_fn, router_logits, k)
    return {"the loss": loss, GRADIENT: grads}


case(
    "ch03.load_balancing_loss",
    "the router trains through it: the gradient with respect to every layer's logits",
    _layers(2, 12, 6, 2),
    _loss_gradient,
    atol=1e-6,
    rtol=1e-5,
    seed=63,
)
case(
    "ch03.load_balancing_loss",
    "other layers, with the gradient",
    _layers_hidden,
    _loss_gradient,
    atol=1e-6,
    rtol=1e-5,
    hidden=True,
)
for n in range(2):
    case(
        "ch03.load_balancing_loss",
        f"other layers {n + 1}",
        _layers_hidden,
        atol=1e-6,
        rtol=1e-5,
        hidden=True,
    )


@mistake(
    "ch03.load_balancing_loss",
    "the loss is k times too small: f_e counted as a fraction of the N*k routing slots (summing "
    "to 1); here f_e is the fraction of TOKENS that chose expert e, which sums to k (as in "
    "transformers' load_balancing_loss_func)",
)
def loss_f_over_slots(router_logits, k):
    return lab.load_balancing_loss(router_logits, k) / k


@mistake("ch03.load_balancing_loss", "the factor E (number of experts) is missing")
def loss_without_factor_e(router_logits, k):
    return lab.load_balancing_loss(router_logits, k) / router_logits[0].shape[-1]


@mistake(
    "ch03.load_balancing_loss",
    "you averaged per-layer losses; pool the layers' statistics first (sum counts and "
    "probabilities over every layer's tokens), as transformers does",
)
def loss_mean_of_layers(router_logits, k):
    return torch.stack([lab.load_balancing_loss([x], k) for x in router_logits]).mean()


@mistake("ch03.load_balancing_loss", DETACHED)
def loss_from_detached_logits(router_logits, k):
    return lab.load_balancing_loss([x.detach() for x in router_logits], k)


@mistake("ch03.load_balancing_loss", "k is hard-coded: use the k given")
def loss_k_hard_coded(router_logits, k):
    return lab.load_balancing_loss(router_logits, 2)


# --- global_load_balancing_loss -------------------------------------------------------------------


def _domains(sizes, E, layers, k):
    """Micro-batches from different 'domains': micro-batch m prefers expert m strongly."""

    def inputs(g):
        micro = [[randn(n, E, g=g) for _ in range(layers)] for n in sizes]
        for m, batch in enumerate(micro):
            for x in batch:
                x[:, m % E] += 4
        return micro, k

    return inputs


def _domains_hidden(g):
    sizes = [between(g, 2, 12) for _ in range(between(g, 2, 4))]
    return _domains(sizes, 16, between(g, 1, 3), between(g, 1, 4))(g)


def _opposite(g):  # each domain sends every token to its own expert; globally f = P = (1/2, 1/2)
    a = torch.tensor([[30.0, 0.0]]).repeat(4, 1)
    return [[a], [a.flip(-1)]], 1


case(
    "ch03.global_load_balancing_loss",
    "3 micro-batches x 2 layers, k=2",
    _domains([6, 6, 6], 8, 2, 2),
    atol=1e-6,
    rtol=1e-5,
    seed=80,
)
case(
    "ch03.global_load_balancing_loss",
    "hand-worked: two opposite domains, E=2, k=1, balance globally: loss 1",
    _opposite,
    expected=lambda *_: torch.tensor(1.0),
    atol=1e-5,
)


case(
    "ch03.global_load_balancing_loss",
    "micro-batches of 3, 9 and 5 tokens (a mean over micro-batches weighs them wrongly), k=2",
    _domains([3, 9, 5], 8, 2, 2),
    atol=1e-6,
    rtol=1e-5,
    seed=81,
)
case(
    "ch03.global_load_balancing_loss",
    "unequal micro-batches",
    _domains_hidden,
    atol=1e-6,
    rtol=1e-5,
    hidden=True,
)
case(
    "ch03.global_load_balancing_loss",
    "the router trains through it: the gradient with respect to every micro-batch's logits",
    _domains([3, 5], 6, 2, 2),
    _loss_gradient,
    atol=1e-6,
    rtol=1e-5,
    seed=82,
)
case(
    "ch03.global_load_balancing_loss",
    "unequal micro-batches, with the gradient",
    _domains_hidden,
    _loss_gradient,
    atol=1e-6,
    rtol=1e-5,
    hidden=True,
)


@mistake("ch03.global_load_balancing_loss", DETACHED)
def global_from_detached_logits(micro_batches, k):
    return lab.global_load_balancing_loss([[x.detach() for x in m] for m in micro_batches], k)


@mistake(
    "ch03.global_load_balancing_loss",
    "you averaged the micro-batches' own losses (per-micro-batch balancing); count f_e over the "
    "whole global batch: add the statistics of every micro-batch first, then compute one loss",
)
def global_per_micro_batch(micro_batches, k):
    return torch.stack([lab.load_balancing_loss(m, k) for m in micro_batches]).mean()


@mistake(
    "ch03.global_load_balancing_loss",
    "only one micro-batch counts: add the statistics of every micro-batch, then compute one loss",
)
def global_last_micro_batch_only(micro_batches, k):
    return lab.load_balancing_loss(micro_batches[-1], k)


@mistake(
    "ch03.global_load_balancing_loss",
    "f_e and P_e are averaged over the micro-batches: that weighs a small micro-batch like a "
    "large one (right only when all have the same size); add the counts and sums of every "
    "micro-batch, then divide by the total number of tokens",
)
def global_mean_of_micro_fractions(micro_batches, k):
    fs, ps = [], []
    for micro in micro_batches:
        stats = [lab.routing_statistics(x, k) for x in micro]
        rows = sum(s[2] for s in stats)
        fs.append(sum(s[0] for s in stats) / rows)
        ps.append(sum(s[1] for s in stats) / rows)
    f, P = torch.stack(fs).mean(0), torch.stack(ps).mean(0)
    return micro_batches[0][0].shape[-1] * (f * P).sum()


# --- split_mlp ------------------------------------------------------------------------------------


def _dense(H, I, E):
    def inputs(g):
        mlp = MLP(H, I)
        with torch.no_grad():
            for p in mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        return mlp, E

    return inputs


def _split(split_mlp, dense, E):
    experts = split_mlp(dense, E)
    names = ("gate_proj", "up_proj", "down_proj")
    weights = [{n: getattr(expert, n).weight.detach().clone() for n in names} for expert in experts]
    with torch.no_grad():
        dense.gate_proj.weight.add_(1.0)  # a copy does not follow the dense MLP
    return {
        "the experts' weights": weights,
        "each expert's gate_proj after the dense MLP changes (a copy, not a view)": [
            expert.gate_proj.weight.detach().clone() for expert in experts
        ],
    }


case(
    "ch03.split_mlp",
    "a dense MLP of width 12 into 3 experts of width 4",
    _dense(6, 12, 3),
    _split,
    seed=100,
    variants=(
        "bfloat16",
        registered(lambda split_mlp, dense, E: split_mlp(dense, E), what="list of experts"),
    ),
)
case(
    "ch03.split_mlp",
    "other sizes",
    lambda g: _dense(4 * between(g, 1, 4), 8, 2 ** between(g, 0, 3))(g),
    _split,
    hidden=True,
)
case("ch03.split_mlp", "one expert", _dense(4, 10, 1), _split, hidden=True)

UNEVEN = "a ValueError: the intermediate size does not split into equal experts"


def _split_uneven(split_mlp, dense, E):
    try:
        split_mlp(dense, E)
    except ValueError:
        return {UNEVEN: True}
    return {UNEVEN: False}


case(
    "ch03.split_mlp",
    "a width of 10 into 4 experts: not a whole number of neurons each",
    _dense(6, 10, 4),
    _split_uneven,
)
case(
    "ch03.split_mlp",
    "other uneven sizes",
    lambda g: _dense(4, 4 * between(g, 1, 4) + between(g, 1, 3), 4)(g),
    _split_uneven,
    hidden=True,
)


def _experts_from(chunks, H):
    experts = nn.ModuleList()
    for gate, up, down in chunks:
        expert = MLP(H, gate.shape[0])
        expert.gate_proj.weight = nn.Parameter(gate.clone())
        expert.up_proj.weight = nn.Parameter(up.clone())
        expert.down_proj.weight = nn.Parameter(down.clone())
        experts.append(expert)
    return experts


def _weights(mlp):
    return (m.weight.detach() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))


ALONG = (
    "split along the INTERMEDIATE dimension (rows of gate_proj and up_proj, columns of "
    "down_proj), not along the hidden one"
)


@mistake("ch03.split_mlp", f"down_proj is split by rows: {ALONG}")
def split_down_proj_along_rows(mlp, num_experts):
    g, u, d = _weights(mlp)
    E = num_experts
    return _experts_from(zip(g.chunk(E, 0), u.chunk(E, 0), d.chunk(E, 0), strict=True), g.shape[1])


@mistake("ch03.split_mlp", f"the hidden dimension is split: {ALONG}")
def split_along_hidden(mlp, num_experts):
    g, u, d = _weights(mlp)
    E = num_experts
    return _experts_from(zip(g.chunk(E, 1), u.chunk(E, 1), d.chunk(E, 0), strict=True), g.shape[1])


@mistake(
    "ch03.split_mlp",
    "every E-th neuron is taken: expert j holds intermediate neurons j·I/E … (j+1)·I/E - 1 of "
    "the dense MLP (a contiguous block; for down_proj these are columns)",
)
def split_strided_neurons(mlp, num_experts):
    g, u, d = _weights(mlp)
    E = num_experts
    return _experts_from(((g[e::E], u[e::E], d[:, e::E]) for e in range(E)), g.shape[1])


@mistake(
    "ch03.split_mlp",
    "an intermediate size not divisible by the number of experts cannot be split into equal "
    "experts: raise a ValueError naming both sizes (I // E neurons each drops the last ones; "
    "chunk makes experts of different widths)",
)
def split_drops_neurons(mlp, num_experts):
    g, u, d = _weights(mlp)
    w = g.shape[0] // num_experts  # the mistake: I % E neurons are silently left out
    chunks = [(g[e * w : (e + 1) * w], u[e * w : (e + 1) * w], d[:, e * w : (e + 1) * w])
              for e in range(num_experts)]  # fmt: skip
    return _experts_from(chunks, g.shape[1])


@mistake(
    "ch03.split_mlp",
    "the experts share storage with the dense MLP (a view): copy the weights",
)
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


# --- SparseMoeBlock and SharedExpertMoeBlock: the blocks, built from the learner's class -------


def _moe_inputs(B, T, H, I, E, k, norm, fused=False, shared=0, dtype=torch.float32, idle=None):
    """(the block's arguments, weights for it, tokens [B, T, H]). `idle`: an expert that no
    token chooses (its router row points away from every token), so it must never run."""

    def inputs(g):
        args = (H, I, E, k) + ((shared,) if shared else ()) + (norm, fused)
        block = (ref.SharedExpertMoeBlock if shared else ref.SparseMoeBlock)(*args)
        weights = {}
        for name, p in block.state_dict().items():
            weights[name] = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            if name == "shared_expert_gate.weight":
                weights[name] = weights[name] * 4  # gate values spread over (0, 1)
        x = randn(B, T, H, g=g)
        if idle is not None:
            x = x + 2.0  # every token leans the same way, and the idle expert's row points away
            weights["gate.weight"][idle] = -torch.ones(H)
        return args, {n: w.to(dtype) for n, w in weights.items()}, x.to(dtype)

    return inputs


def _moe_hidden(shared):
    def inputs(g):
        E = between(g, 2, 12)
        B, T, H = between(g, 1, 3), between(g, 1, 6), 4 * between(g, 1, 4)
        k, norm, fused = between(g, 1, min(E, 4)), bool(between(g, 0, 1)), bool(between(g, 0, 1))
        return _moe_inputs(B, T, H, 8, E, k, norm, fused, 12 if shared else 0)(g)

    return inputs


# every case loads weights into the block: its experts must be registered first
_BLOCK_REGISTERED = registered(
    lambda block_class, args, weights, x: block_class(*args), what="block", first=True
)


def _moe_run(block_class, args, weights, x):
    """The learner's block with the given weights: its output, and how often and on how many
    rows each routed expert ran (counted in forward)."""
    H, I, E = args[:3]
    fused = args[-1]
    block = block_class(*args)
    calls, rows = [0] * E, [0] * E

    def count(n_rows, e):
        calls[e] += 1
        rows[e] += n_rows

    block.to(x.dtype).load_state_dict(weights)  # its own experts first: all names must fit
    if fused:
        experts = CountedFused(E, H, I)
        experts.count = count
    else:
        experts = nn.ModuleList(CountedMLP(H, I) for _ in range(E))
        for e, expert in enumerate(experts):
            expert.count = lambda n_rows, e=e: count(n_rows, e)
    own = {k.removeprefix("experts."): v for k, v in weights.items() if k.startswith("experts.")}
    experts.to(x.dtype).load_state_dict(own)  # here, before they go in: the block's code may
    block.experts = experts  # read the experts' weights, never change them
    with torch.no_grad():
        out = block(x)
    return {
        "output [B, T, H]": out,
        "calls of each routed expert (one per expert chosen, none for the others)": calls,
        "rows each routed expert ran on (the tokens that chose it)": rows,
    }


MOE = "ch03.SparseMoeBlock"
case(
    MOE,
    "2 x 5 tokens, 8 experts, top-2, renormalised; expert 7 is chosen by no token",
    _moe_inputs(2, 5, 8, 16, 8, 2, True, idle=7),
    _moe_run,
    atol=1e-5,
    rtol=1e-5,
    seed=110,
    variants=(_BLOCK_REGISTERED,),
)
case(
    MOE,
    "3 x 4 tokens, 6 experts, top-3, norm_topk_prob=False (the full-softmax probabilities)",
    _moe_inputs(3, 4, 8, 16, 6, 3, False),
    _moe_run,
    atol=1e-5,
    rtol=1e-5,
    seed=111,
)
case(
    MOE,
    "experts stored fused (the Qwen3.5-MoE layout), 10 experts, top-4",
    _moe_inputs(1, 7, 12, 8, 10, 4, True, fused=True),
    _moe_run,
    atol=1e-5,
    rtol=1e-5,
    seed=112,
)
case(
    MOE,
    "a bfloat16 block on bfloat16 tokens: the output is bfloat16",
    _moe_inputs(2, 6, 16, 32, 8, 2, True, dtype=torch.bfloat16),
    _moe_run,
    atol=2e-2,
    rtol=2e-2,
    seed=113,
)
for n in range(2):
    case(MOE, f"other blocks {n + 1}", _moe_hidden(False), _moe_run, atol=1e-5, rtol=1e-5,
         hidden=True)  # fmt: skip


def _flat_route(block, x):
    flat = x.reshape(-1, x.shape[-1])
    return flat, ref.route(block.gate(flat), block.top_k, block.norm_topk_prob)


@mistake(MOE, "top_k is hard-coded: route each token to self.top_k experts, as the block was built")
class MoeTopKHardCoded(ref.SparseMoeBlock):
    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        w, idx = ref.route(self.gate(flat), 2, self.norm_topk_prob)
        return ref.grouped_dispatch(flat, w, idx, self.experts).view(x.shape)


@mistake(
    MOE,
    "the weights are renormalised whatever norm_topk_prob says: pass self.norm_topk_prob to the "
    "router (with False the weights are the full-softmax probabilities)",
)
class MoeAlwaysRenormalised(ref.SparseMoeBlock):
    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        w, idx = ref.route(self.gate(flat), self.top_k, True)
        return ref.grouped_dispatch(flat, w, idx, self.experts).view(x.shape)


@mistake(
    MOE,
    "every expert runs on every token (a dense, masked mixture): an expert no token chose is "
    "never called, and a chosen one runs once, on the rows of the tokens that chose it",
)
class MoeDenseMasked(ref.SparseMoeBlock):
    def forward(self, x):
        flat, (w, idx) = _flat_route(self, x)
        out = torch.zeros_like(flat)
        for e in range(len(self.experts)):
            out += (w * (idx == e)).sum(-1, keepdim=True) * self.experts[e](flat)
        return out.view(x.shape)


@mistake(
    MOE,
    "an expert no token chose is called (on zero rows): skip it; it is never called",
)
class MoeCallsIdleExperts(ref.SparseMoeBlock):
    def forward(self, x):
        flat, (w, idx) = _flat_route(self, x)
        out = torch.zeros_like(flat)
        for e in range(len(self.experts)):
            token, slot = (idx == e).nonzero(as_tuple=True)  # possibly none
            out.index_add_(0, token, self.experts[e](flat[token]) * w[token, slot, None])
        return out.view(x.shape)


@mistake(
    MOE,
    "the experts' outputs are added without their routing weights: weight each expert's output "
    "by the token's router weight for it",
)
class MoeUnweighted(ref.SparseMoeBlock):
    def forward(self, x):
        flat, (w, idx) = _flat_route(self, x)
        return ref.grouped_dispatch(flat, torch.ones_like(w), idx, self.experts).view(x.shape)


@mistake(
    MOE,
    "a bfloat16 block returns float32: the router's softmax is float32, but the weights it "
    "returns, the experts' outputs and the block's output stay in the tokens' dtype",
)
class MoeFloat32Output(ref.SparseMoeBlock):
    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat), -1, dtype=torch.float32)
        w, idx = probs.topk(self.top_k, -1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros(flat.shape)  # float32
        for e in idx.unique().tolist():
            token, slot = (idx == e).nonzero(as_tuple=True)
            out.index_add_(0, token, (self.experts[e](flat[token]) * w[token, slot, None]).float())
        return out.view(x.shape)


SHARED = "ch03.SharedExpertMoeBlock"


def _zero_gate(inputs):
    def with_zero_gate(g):
        args, weights, x = inputs(g)
        weights["shared_expert_gate.weight"] = torch.zeros_like(
            weights["shared_expert_gate.weight"]
        )
        return args, weights, x

    return with_zero_gate


def _routed_plus_half_shared(args, weights, x):
    """By hand: sigmoid(0) = 1/2, so the block is the routed experts plus half the shared
    expert (both run as the package's, with the same weights)."""
    block = ref.SharedExpertMoeBlock(*args)
    block.load_state_dict(weights)
    with torch.no_grad():
        routed = ref.SparseMoeBlock.forward(block, x)
        out = routed + 0.5 * block.shared_expert(x)
    E = args[2]
    flat = x.reshape(-1, x.shape[-1])
    _, idx = ref.route(block.gate(flat), block.top_k, block.norm_topk_prob)
    chosen = torch.bincount(idx.reshape(-1), minlength=E)
    return {
        "output [B, T, H]": out,
        "calls of each routed expert (one per expert chosen, none for the others)": [
            int(c > 0) for c in chosen
        ],
        "rows each routed expert ran on (the tokens that chose it)": chosen.tolist(),
    }


case(
    SHARED,
    "hand-worked: a shared_expert_gate of 0 gives the routed output plus half the shared expert's",
    _zero_gate(_moe_inputs(2, 4, 8, 16, 6, 2, True, shared=24)),
    _moe_run,
    _routed_plus_half_shared,
    atol=1e-5,
    rtol=1e-5,
    seed=120,
    variants=(_BLOCK_REGISTERED,),
)
case(
    SHARED,
    "2 x 5 tokens, 8 experts, top-2, shared expert of width 24; expert 7 is chosen by no token",
    _moe_inputs(2, 5, 8, 16, 8, 2, True, shared=24, idle=7),
    _moe_run,
    atol=1e-5,
    rtol=1e-5,
    seed=121,
)
case(
    SHARED,
    "experts stored fused, top-3, norm_topk_prob=False",
    _moe_inputs(1, 6, 12, 8, 10, 3, False, fused=True, shared=16),
    _moe_run,
    atol=1e-5,
    rtol=1e-5,
    seed=122,
)
case(
    SHARED,
    "a bfloat16 block on bfloat16 tokens: the output is bfloat16",
    _moe_inputs(2, 6, 16, 32, 8, 2, True, shared=32, dtype=torch.bfloat16),
    _moe_run,
    atol=3e-2,
    rtol=3e-2,
    seed=123,
)
for n in range(2):
    case(SHARED, f"other blocks {n + 1}", _moe_hidden(True), _moe_run, atol=1e-5, rtol=1e-5,
         hidden=True)  # fmt: skip


def _routed(block, x):
    return ref.SparseMoeBlock.forward(block, x)


@mistake(
    SHARED,
    "the shared expert is added unscaled: scale it token by token by "
    "sigmoid(shared_expert_gate(x)), a number between 0 and 1 (a softmax over one logit is 1)",
)
class SharedUngated(ref.SharedExpertMoeBlock):
    def forward(self, x):
        return _routed(self, x) + self.shared_expert(x)


@mistake(
    SHARED,
    "the shared expert is scaled by the raw gate logit: squash it with a sigmoid, "
    "sigmoid(shared_expert_gate(x))",
)
class SharedRawLogit(ref.SharedExpertMoeBlock):
    def forward(self, x):
        return _routed(self, x) + self.shared_expert_gate(x) * self.shared_expert(x)


@mistake(
    SHARED,
    "the shared expert is missing: the block is the routed experts' output PLUS "
    "sigmoid(shared_expert_gate(x)) * shared_expert(x)",
)
class SharedLeftOut(ref.SharedExpertMoeBlock):
    def forward(self, x):
        return _routed(self, x)


@mistake(
    SHARED,
    "the routed experts are missing: the block is the routed experts' output (the sparse block's "
    "forward) PLUS the gated shared expert",
)
class SharedOnly(ref.SharedExpertMoeBlock):
    def forward(self, x):
        return ref.shared_expert_output(x, self.shared_expert, self.shared_expert_gate)


@mistake(
    SHARED,
    "the gate scales the routed experts too: sigmoid(shared_expert_gate(x)) scales only the "
    "shared expert; the routed output is added as the router weighted it",
)
class SharedGatesEverything(ref.SharedExpertMoeBlock):
    def forward(self, x):
        gate = torch.sigmoid(self.shared_expert_gate(x))
        return gate * (_routed(self, x) + self.shared_expert(x))


@mistake(
    SHARED,
    "a bfloat16 block returns float32: keep the gate and the sum in the tokens' dtype",
)
class SharedFloat32Output(ref.SharedExpertMoeBlock):
    def forward(self, x):
        gate = torch.sigmoid(self.shared_expert_gate(x).float())
        return _routed(self, x).float() + gate * self.shared_expert(x).float()
