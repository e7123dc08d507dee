"""Checks for chapter 3 (mixture of experts: routing, dispatch, load balancing, shared expert,
the expert split).

Expected values are worked out by hand or computed here the slow, obvious way (a loop over
tokens, one-hot counts), independently of the package's implementation. Where a typical mistake
has a recognisable result, the check names the idea instead of only reporting a number.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini import moe as ref
from qwen_mini.course.checking import (
    expect_close,
    expect_equal,
    hidden,
    public,
    randn,
    register,
    seeded,
)
from qwen_mini.course.lab import ch03 as lab
from qwen_mini.mlp import MLP

register("ch03.route", reference=ref.route, points=2, title="Router: softmax, top-k, renormalise")
register(
    "ch03.grouped_dispatch",
    reference=ref.grouped_dispatch,
    points=2,
    title="Grouped dispatch: one call per expert, results added back per token",
)
register(
    "ch03.shared_expert_output",
    reference=ref.shared_expert_output,
    points=1,
    title="The shared expert and its sigmoid gate",
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


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


# --- route ----------------------------------------------------------------------------------------


def _route_by_hand(logits: torch.Tensor, k: int, norm: bool):
    """softmax over every expert in float32, the k largest, optionally rescaled to sum to 1."""
    probs = torch.exp(logits.double() - logits.double().max(-1, keepdim=True).values)
    probs = probs / probs.sum(-1, keepdim=True)
    top = probs.topk(k, dim=-1)
    w = top.values / top.values.sum(-1, keepdim=True) if norm else top.values
    return w, top.indices


def _expect_route(route, logits: torch.Tensor, k: int, norm: bool, what: str) -> None:
    out = route(logits, k, norm)
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise AssertionError(f"{what}: return a pair (weights, experts), got {type(out).__name__}")
    weights, experts = out
    want_w, want_i = _route_by_hand(logits, k, norm)
    expect_equal(f"{what}: weights shape [N, k]", tuple(weights.shape), tuple(want_w.shape))
    expect_equal(f"{what}: experts chosen (the k most probable, in order)", experts, want_i)
    raw, renormed = _route_by_hand(logits, k, False)[0], _route_by_hand(logits, k, True)[0]
    differ = not _close(raw, renormed)  # with k = E both sum to 1 and cannot be told apart
    if differ and norm and _close(weights, raw):
        raise AssertionError(
            f"{what}: with norm_topk_prob=True the k weights must be renormalised to sum to 1; "
            "yours are the raw softmax probabilities (no renormalisation)"
        )
    if differ and not norm and _close(weights, renormed):
        raise AssertionError(
            f"{what}: with norm_topk_prob=False the weights are the probabilities of the softmax "
            "over ALL experts; yours sum to 1 over the top k (a softmax after top-k, or "
            "renormalised anyway)"
        )
    expect_close(f"{what}: weights", weights.double(), want_w, atol=1e-6, rtol=1e-5)


@public("ch03.route")
def _(route):
    """hand-worked: logits [ln 1, ln 2, ln 3, ln 4], k = 2"""
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).log()  # [0, 0.69, 1.10, 1.39]
    # softmax = [1, 2, 3, 4] / 10; top 2 = experts 3, 2 with 0.4, 0.3; renormalised 4/7, 3/7
    weights, experts = route(logits, 2, True)
    expect_equal("experts of the hand-worked example", experts.tolist(), [[3, 2]])
    if _close(weights, torch.tensor([[0.4, 0.3]])):
        raise AssertionError(
            "weights [0.4, 0.3] are the softmax probabilities; with norm_topk_prob=True "
            "renormalise the k kept weights to sum to 1 (expected [4/7, 3/7]) — no renormalisation"
        )
    expect_close("renormalised weights", weights, torch.tensor([[4 / 7, 3 / 7]]), atol=1e-6)
    weights, _ = route(logits, 2, False)
    if _close(weights, torch.tensor([[4 / 7, 3 / 7]])):
        raise AssertionError(
            "with norm_topk_prob=False the weights are the softmax over ALL experts, [0.4, 0.3]; "
            "yours sum to 1: a softmax taken after top-k renormalises whether asked or not"
        )
    expect_close("weights without renormalisation", weights, torch.tensor([[0.4, 0.3]]), atol=1e-6)


@public("ch03.route")
def _(route):
    """random logits, renormalisation on and off"""
    logits = randn(20, 8, seed=1) * 2
    _expect_route(route, logits, 3, True, "20 tokens, 8 experts, k=3, norm on")
    _expect_route(route, logits, 3, False, "20 tokens, 8 experts, k=3, norm off")


@public("ch03.route")
def _(route):
    """bfloat16 logits: float32 softmax, weights returned in bfloat16"""
    logits = (randn(64, 16, seed=2) * 2).bfloat16()
    weights, experts = route(logits, 4, True)
    expect_equal("weights dtype (the logits' dtype)", weights.dtype, torch.bfloat16)
    probs = torch.softmax(logits.float(), -1)
    top = probs.topk(4, -1)
    want = (top.values / top.values.sum(-1, keepdim=True)).bfloat16()
    if not torch.equal(weights, want):
        raise AssertionError(
            "bfloat16 logits: take the softmax and the renormalisation in float32 "
            "(torch.softmax(..., dtype=torch.float32)) and cast only the final weights; "
            f"{int((weights != want).sum())} of {want.numel()} weights differ from that"
        )
    expect_equal("experts for bfloat16 logits", experts, top.indices)


@hidden("ch03.route")
def _(route):
    for seed, (n, e, k) in enumerate([(1, 4, 1), (9, 6, 6), (33, 64, 8), (5, 128, 8)]):
        logits = randn(n, e, seed=10 + seed) * 3
        for norm in (True, False):
            _expect_route(route, logits, k, norm, f"{n} tokens, {e} experts, k={k}, norm={norm}")


# --- grouped_dispatch -----------------------------------------------------------------------------


class _Expert(nn.Sequential):
    """An expert that counts its calls in `forward` itself: a hook would not see a call of
    `expert.forward(x)`, which skips the hooks."""

    def forward(self, x):
        self.count(x.shape[0])
        return super().forward(x)


def _experts(n: int, h: int, seed: int) -> tuple[list[nn.Module], dict]:
    """n non-linear experts (tanh of a linear map: a sum of inputs would not pass) as torch
    modules, and a record of how often and on how many rows each is called."""
    g, experts, calls = seeded(seed), [], {}
    for e in range(n):
        linear = nn.Linear(h, h, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(h, h, generator=g) / h**0.5)
        expert = _Expert(linear, nn.Tanh())
        calls[e] = [0, 0]

        def count(rows, e=e):
            calls[e][0] += 1
            calls[e][1] += rows

        expert.count = count
        experts.append(expert)
    return experts, calls


def _apply(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The expert's function, computed here without calling (and counting) the module."""
    return torch.tanh(x @ expert[0].weight.T)


def _expect_dispatch(dispatch, n, h, e, k, seed, what):
    x = randn(n, h, seed=seed)
    logits = randn(n, e, seed=seed + 1) * 2
    weights, idx = ref.route(logits, k, True)
    experts, calls = _experts(e, h, seed + 2)
    want, unweighted = torch.zeros_like(x), torch.zeros_like(x)
    with torch.no_grad():
        for t in range(n):  # the definition, token by token
            for s in range(k):
                y = _apply(experts[int(idx[t, s])], x[t : t + 1])[0]
                want[t] += weights[t, s] * y
                unweighted[t] += y
        got = dispatch(x, weights, idx, experts)
    expect_equal(f"{what}: output shape", tuple(got.shape), (n, h))
    if not _close(want, unweighted) and _close(got, unweighted):
        raise AssertionError(
            f"{what}: the outputs are summed without their routing weights; multiply each "
            "expert's output by the token's weight for that expert"
        )
    expect_close(f"{what}: output vs the token-by-token definition", got, want, atol=1e-5)
    chosen = set(idx.flatten().tolist())
    for j in range(e):
        n_calls, rows = calls[j]
        if j not in chosen and n_calls:
            raise AssertionError(
                f"{what}: expert {j} was chosen by no token but was called: run only the "
                "experts that received tokens"
            )
        if j in chosen and not n_calls:
            raise AssertionError(
                f"{what}: expert {j} was chosen but never called: call experts[{j}] (the "
                "module) on the rows of its tokens, not a function of its weights"
            )
        if n_calls > 1:
            raise AssertionError(
                f"{what}: expert {j} was called {n_calls} times; group its tokens and call it "
                "once (one call per expert, not per token or per slot)"
            )
        expected_rows = int((idx == j).sum())
        if n_calls and rows != expected_rows:
            raise AssertionError(
                f"{what}: expert {j} ran on {rows} rows; it was chosen by {expected_rows} "
                "tokens, so it should see exactly those rows (not the whole batch, as a dense "
                "masked dispatch would)"
            )


@public("ch03.grouped_dispatch")
def _(grouped_dispatch):
    """hand-worked: 2 tokens, 3 experts that scale their input, k = 2"""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    experts = []
    for scale in (10.0, 100.0, 1000.0):
        expert = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            expert.weight.copy_(scale * torch.eye(2))
        experts.append(expert)
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    idx = torch.tensor([[2, 0], [0, 1]])
    # token 0: 0.75 * 1000 x0 + 0.25 * 10 x0 = 752.5 x0; token 1: 0.5 * 10 x1 + 0.5 * 100 x1
    got = grouped_dispatch(x, weights, idx, experts)
    if _close(got, torch.tensor([[1010.0, 2020.0], [330.0, 440.0]])):
        raise AssertionError(
            "the experts' outputs are summed without their routing weights; multiply each "
            "expert's output by the token's weight for that expert"
        )
    expect_close(
        "hand-worked dispatch (token 0 = 0.75 expert_2(x0) + 0.25 expert_0(x0), "
        "token 1 = 0.5 expert_0(x1) + 0.5 expert_1(x1))",
        got,
        torch.tensor([[752.5, 1505.0], [165.0, 220.0]]),
        atol=1e-4,
    )


@public("ch03.grouped_dispatch")
def _(grouped_dispatch):
    """random tokens: equal to the token-by-token definition, each chosen expert called once"""
    _expect_dispatch(grouped_dispatch, 12, 8, 6, 2, 20, "12 tokens, 6 experts, k=2")


@hidden("ch03.grouped_dispatch")
def _(grouped_dispatch):
    for seed, (n, h, e, k) in enumerate([(1, 4, 4, 1), (7, 16, 3, 3), (40, 8, 32, 4)]):
        _expect_dispatch(grouped_dispatch, n, h, e, k, 30 + 5 * seed, f"{n} tokens, {e} experts")


# --- shared_expert_output -------------------------------------------------------------------------


def _shared_parts(h: int, seed: int):
    expert = MLP(h, 2 * h)
    gate = nn.Linear(h, 1, bias=False)
    g = seeded(seed)
    with torch.no_grad():
        for p in list(expert.parameters()) + list(gate.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return expert, gate


def _expect_shared(fn, x, expert, gate, what):
    with torch.no_grad():
        got = fn(x, expert, gate)
        y, logit = expert(x), gate(x)
        want = y / (1 + torch.exp(-logit))  # sigmoid written out
    expect_equal(f"{what}: shape", tuple(got.shape), tuple(x.shape))
    if _close(got, y):
        raise AssertionError(
            f"{what}: the output is the shared expert's, unscaled: the gate is missing (a "
            "softmax over its ONE logit is always 1); scale by sigmoid(shared_expert_gate(x))"
        )
    if _close(got, logit * y):
        raise AssertionError(
            f"{what}: the output is scaled by the raw gate logit; the sigmoid is missing — "
            "scale by sigmoid(shared_expert_gate(x)), a number between 0 and 1"
        )
    expect_close(f"{what}: gated shared-expert output", got, want, atol=1e-6, rtol=1e-5)


@public("ch03.shared_expert_output")
def _(shared_expert_output):
    """hand-worked: a gate logit of 0 halves the shared expert's output"""
    expert, gate = _shared_parts(4, seed=40)
    with torch.no_grad():
        gate.weight.zero_()
        x = randn(1, 3, 4, seed=41)
        got, y = shared_expert_output(x, expert, gate), expert(x)
    if _close(got, y):
        raise AssertionError(
            "with a gate logit of 0 the output must be half the shared expert's, but it is "
            "unscaled: the gate is missing (a softmax over one logit is always 1); use a sigmoid"
        )
    if _close(got, torch.zeros_like(y)):
        raise AssertionError(
            "with a gate logit of 0 the output must be half the shared expert's, but it is 0: "
            "the raw logit multiplies the output; the sigmoid is missing"
        )
    expect_close("gate logit 0 -> 0.5 * shared_expert(x)", got, 0.5 * y, atol=1e-6)


@public("ch03.shared_expert_output")
def _(shared_expert_output):
    """random weights, tokens of shape [B, T, H]"""
    expert, gate = _shared_parts(8, seed=42)
    _expect_shared(shared_expert_output, randn(2, 5, 8, seed=43), expert, gate, "[2, 5, 8]")


@hidden("ch03.shared_expert_output")
def _(shared_expert_output):
    expert, gate = _shared_parts(16, seed=44)
    _expect_shared(shared_expert_output, randn(7, 16, seed=45) * 3, expert, gate, "[7, 16]")


# --- routing_statistics ---------------------------------------------------------------------------


def _stats_by_hand(logits, k):
    probs = torch.softmax(logits.double(), -1)
    onehot = F.one_hot(probs.topk(k, -1).indices, logits.shape[-1]).sum(1)  # [N, E] 0/1
    return onehot.sum(0).double(), probs.sum(0), logits.shape[0]


def _expect_stats(fn, logits, k, what):
    out = fn(logits, k)
    if not (isinstance(out, tuple | list) and len(out) == 3):
        raise AssertionError(f"{what}: return (counts, prob_sums, n_tokens)")
    counts, prob_sums, n = out
    want_c, want_p, want_n = _stats_by_hand(logits, k)
    if _close(counts.double(), want_c / (want_n * k)) or _close(counts.double(), want_c / want_n):
        raise AssertionError(
            f"{what}: counts are fractions; return raw counts (they sum to N * k), so that "
            "statistics of several batches can be added"
        )
    expect_close(f"{what}: counts (summing to N * k)", counts.double(), want_c, atol=0, rtol=0)
    if _close(prob_sums.double(), want_p / want_n):
        raise AssertionError(f"{what}: prob_sums are means; return sums over the tokens")
    expect_close(f"{what}: prob_sums (softmax over ALL experts)", prob_sums, want_p, atol=1e-5)
    expect_equal(f"{what}: number of tokens", int(n), want_n)


@public("ch03.routing_statistics")
def _(routing_statistics):
    """hand-worked: 3 tokens, 3 experts, k = 2"""
    logits = torch.tensor([[5.0, 4.0, 0.0], [0.0, 5.0, 4.0], [5.0, 0.0, 4.0]])
    counts, _, n = routing_statistics(logits, 2)
    if _close(counts, torch.tensor([1 / 3] * 3)) or _close(counts, torch.tensor([2 / 3] * 3)):
        raise AssertionError(
            "counts are fractions; return raw counts (here 2 per expert, summing to N * k = 6) "
            "so that statistics of several batches can be added"
        )
    expect_equal("counts of the hand-worked example", counts.tolist(), [2.0, 2.0, 2.0])
    expect_equal("n_tokens", int(n), 3)


@public("ch03.routing_statistics")
def _(routing_statistics):
    """random logits"""
    _expect_stats(routing_statistics, randn(30, 8, seed=50) * 2, 2, "30 tokens, 8 experts, k=2")


@hidden("ch03.routing_statistics")
def _(routing_statistics):
    _expect_stats(routing_statistics, randn(17, 64, seed=51) * 2, 8, "17 tokens, 64 experts, k=8")
    _expect_stats(routing_statistics, randn(5, 4, seed=52), 1, "5 tokens, 4 experts, k=1")


# --- load_balancing_loss --------------------------------------------------------------------------


def _loss_by_hand(layers, k, slots=False):
    """E * sum_e f_e P_e with the statistics of every layer pooled (f over tokens, or slots)."""
    counts = sum(_stats_by_hand(x, k)[0] for x in layers)
    probs = sum(_stats_by_hand(x, k)[1] for x in layers)
    rows = sum(x.shape[0] for x in layers)
    f = counts / (rows * k if slots else rows)
    return layers[0].shape[-1] * (f * probs / rows).sum()


def _expect_loss(fn, layers, k, what):
    got = fn(layers, k)
    got = torch.as_tensor(got).double()
    want = _loss_by_hand(layers, k)
    expect_equal(f"{what}: a scalar", tuple(got.shape), ())
    if k > 1 and _close(got, _loss_by_hand(layers, k, slots=True), 1e-6):
        raise AssertionError(
            f"{what}: your loss is {k}x too small: f_e counted as a fraction of the N*k routing "
            "slots (summing to 1); here f_e is the fraction of TOKENS that chose expert e, which "
            "sums to k (as in transformers' load_balancing_loss_func)"
        )
    E = layers[0].shape[-1]
    if _close(got * E, want, 1e-6):
        raise AssertionError(f"{what}: the factor E (number of experts) is missing")
    if len(layers) > 1:
        mean = torch.stack([_loss_by_hand([x], k) for x in layers]).mean()
        if not _close(mean, want, 1e-6) and _close(got, mean, 1e-6):
            raise AssertionError(
                f"{what}: you averaged per-layer losses; pool the layers' statistics first "
                "(sum counts and probabilities over every layer's tokens), as transformers does"
            )
    expect_close(f"{what}: loss", got, want, atol=1e-6, rtol=1e-5)


@public("ch03.load_balancing_loss")
def _(load_balancing_loss):
    """hand-worked: a perfectly balanced router scores exactly k"""
    E, k = 4, 2
    logits = torch.zeros(E, E)
    for i in range(E):
        logits[i, i] = logits[i, (i + 1) % E] = 6.0  # token i: experts i and i+1
    got = torch.as_tensor(load_balancing_loss([logits], k)).double()
    if _close(got, torch.tensor(1.0), 1e-6):
        raise AssertionError(
            "a perfectly balanced router must score k = 2, not 1: f_e is the fraction of TOKENS "
            "that chose expert e (the f_e sum to k), not the fraction of routing slots"
        )
    if _close(got, torch.tensor(0.5), 1e-6):
        raise AssertionError(
            "a perfectly balanced router must score k = 2; yours gives k / E = 0.5: the factor E "
            "(number of experts) is missing"
        )
    expect_close("balanced router, E=4, k=2", got, torch.tensor(2.0), atol=1e-6, rtol=0)


@public("ch03.load_balancing_loss")
def _(load_balancing_loss):
    """random logits, one layer and three layers pooled"""
    layers = [randn(16, 8, seed=60 + i) * 2 for i in range(3)]
    for i in range(3):  # a layer preferring experts 0-1, pooled with balanced ones: hidden
        layers[i][:, 2 * i] += 3
    _expect_loss(load_balancing_loss, layers[:1], 2, "one layer, E=8, k=2")
    _expect_loss(load_balancing_loss, layers, 2, "three layers pooled, E=8, k=2")


@hidden("ch03.load_balancing_loss")
def _(load_balancing_loss):
    layers = [randn(9, 16, seed=70 + i) * 3 for i in range(4)]
    _expect_loss(load_balancing_loss, layers, 4, "four layers, E=16, k=4")
    _expect_loss(load_balancing_loss, [randn(5, 3, seed=75)], 1, "E=3, k=1")


# --- global_load_balancing_loss -------------------------------------------------------------------


def _domains(sizes, E, layers, seed):
    """Micro-batches from different 'domains': micro-batch m prefers expert m strongly."""
    micro = []
    for m, n in enumerate(sizes):
        micro.append([randn(n, E, seed=seed + 10 * m + i) for i in range(layers)])
        for x in micro[-1]:
            x[:, m % E] += 4
    return micro


def _expect_global(fn, micro, k, what):
    got = torch.as_tensor(fn(micro, k)).double()
    layers = len(micro[0])
    joined = [torch.cat([m[i] for m in micro]) for i in range(layers)]
    want = _loss_by_hand(joined, k)
    per_micro = torch.stack([_loss_by_hand(m, k) for m in micro]).mean()
    if _close(got, per_micro, 1e-6) and not _close(want, per_micro, 1e-6):
        raise AssertionError(
            f"{what}: you averaged the micro-batches' own losses (per-micro-batch balancing); "
            "count f_e over the whole global batch: add the statistics of every micro-batch "
            "first, then compute one loss"
        )
    expect_close(f"{what}: global-batch loss", got, want, atol=1e-6, rtol=1e-5)


@public("ch03.global_load_balancing_loss")
def _(global_load_balancing_loss):
    """hand-worked: two domains, each sending every token to its own expert, balance globally"""
    a = torch.tensor([[8.0, 0.0]]).repeat(4, 1)
    b = torch.tensor([[0.0, 8.0]]).repeat(4, 1)
    got = torch.as_tensor(global_load_balancing_loss([[a], [b]], 1)).double()
    p = float(torch.sigmoid(torch.tensor(8.0)))
    if _close(got, torch.tensor(2 * p), 1e-6):
        raise AssertionError(
            f"got {float(got):.4f} = 2p, the mean of the two micro-batches' losses: that is "
            "per-micro-batch balancing; over the global batch f = (1/2, 1/2) and P = (1/2, 1/2), "
            "so the loss is 1"
        )
    expect_close("two opposite domains, E=2, k=1", got, torch.tensor(1.0), atol=1e-6, rtol=0)


@public("ch03.global_load_balancing_loss")
def _(global_load_balancing_loss):
    """three domain micro-batches, two layers"""
    micro = _domains([6, 6, 6], 8, 2, seed=80)
    _expect_global(global_load_balancing_loss, micro, 2, "3 micro-batches x 2 layers, k=2")


@hidden("ch03.global_load_balancing_loss")
def _(global_load_balancing_loss):
    micro = _domains([3, 11, 5, 8], 16, 3, seed=90)
    _expect_global(global_load_balancing_loss, micro, 4, "unequal micro-batches, k=4")


# --- split_mlp ------------------------------------------------------------------------------------


def _dense(h: int, i: int, seed: int) -> MLP:
    mlp = MLP(h, i)
    g = seeded(seed)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return mlp


def _expect_split(split_mlp, h, i, e, seed, what):
    dense = _dense(h, i, seed)
    experts = split_mlp(dense, e)
    expect_equal(f"{what}: number of experts", len(experts), e)
    w = i // e
    for name, shape in [("gate_proj", (w, h)), ("up_proj", (w, h)), ("down_proj", (h, w))]:
        got = tuple(getattr(experts[0], name).weight.shape)
        if got != shape:
            raise AssertionError(
                f"{what}: expert 0's {name}.weight is {list(got)}, expected {list(shape)}: split "
                "along the INTERMEDIATE dimension (rows of gate_proj and up_proj, columns of "
                "down_proj), not along the hidden one"
            )
    for j in (0, e - 1):
        rows = slice(j * w, (j + 1) * w)
        for name, want in [
            ("gate_proj", dense.gate_proj.weight[rows]),
            ("up_proj", dense.up_proj.weight[rows]),
            ("down_proj", dense.down_proj.weight[:, rows]),
        ]:
            if not torch.equal(getattr(experts[j], name).weight, want):
                raise AssertionError(
                    f"{what}: expert {j}'s {name} must hold intermediate neurons "
                    f"{j * w}..{(j + 1) * w - 1} of the dense MLP (a contiguous block; for "
                    "down_proj these are columns)"
                )
    x = randn(5, h, seed=seed + 1)
    with torch.no_grad():
        total = sum(expert(x) for expert in experts)
        expect_close(f"{what}: sum of the experts vs the dense MLP", total, dense(x), atol=1e-5)
    with torch.no_grad():
        dense.gate_proj.weight.add_(1.0)
        if torch.equal(experts[0].gate_proj.weight, dense.gate_proj.weight[:w]):
            raise AssertionError(
                f"{what}: the experts share storage with the dense MLP (a view): copy the weights"
            )


@public("ch03.split_mlp")
def _(split_mlp):
    """a dense MLP of width 12 into 3 experts of width 4"""
    _expect_split(split_mlp, 6, 12, 3, seed=100, what="H=6, I=12, E=3")


@hidden("ch03.split_mlp")
def _(split_mlp):
    _expect_split(split_mlp, 16, 64, 8, seed=110, what="H=16, I=64, E=8")
    _expect_split(split_mlp, 4, 10, 1, seed=120, what="H=4, I=10, E=1")
