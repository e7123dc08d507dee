"""Checks for chapter 5 (Gated DeltaNet: the recurrent step, the decay mask, the triangular
solve, the chunk loop with state passing, the causal conv state, the gated norm).

Expected values come from hand-worked examples, from naive loops written here (one token, one
head at a time), from `torch.linalg.solve`, and from the package's reference. Each public check
that targets a typical mistake compares the answer with that mistake first, so the message can
name the idea that is wrong.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from qwen_mini import deltanet as ref
from qwen_mini import norms
from qwen_mini.course.checking import (
    expect_close,
    expect_equal,
    hidden,
    public,
    randn,
    register,
    seeded,
)

register(
    "ch05.expand_key_heads",
    reference=ref.expand_key_heads,
    points=1,
    title="Value head j reads key head j // ratio",
)
register(
    "ch05.recurrent_step",
    reference=ref.recurrent_step,
    points=2,
    title="One step of the gated delta rule",
)
register(
    "ch05.decay_mask",
    reference=ref.decay_mask,
    points=2,
    title="Decay mask from differences of cumulative log-decay",
)
register(
    "ch05.solve_unit_lower",
    reference=ref.solve_unit_lower,
    points=1,
    title="Solve (I + A) X = B, A strictly lower triangular",
)
register(
    "ch05.pad_to_chunks",
    reference=ref.pad_to_chunks,
    points=1,
    title="Pad to whole chunks with no-op tokens",
)
register(
    "ch05.chunk_loop",
    reference=ref.chunk_loop,
    points=3,
    title="The chunk loop: state passed from chunk to chunk",
)
register(
    "ch05.causal_conv1d",
    reference=ref.causal_conv1d,
    points=2,
    title="Causal depthwise conv that continues from its state",
)
register(
    "ch05.GatedRMSNorm",
    reference=norms.GatedRMSNorm,
    points=1,
    title="Gated RMSNorm: x_hat * w * silu(z)",
)


def _close(a, b, tol: float = 1e-5) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and bool(torch.allclose(a.double(), b.double(), atol=tol, rtol=tol))
    )


def _unit(*shape, seed):
    x = randn(*shape, seed=seed)
    return x / x.norm(dim=-1, keepdim=True)


# --- expand_key_heads ---------------------------------------------------------------------------


@public("ch05.expand_key_heads")
def _(expand_key_heads):
    x = torch.arange(3.0).view(1, 1, 3, 1).expand(2, 4, 3, 5)  # key head h holds the value h
    got = expand_key_heads(x, 6)
    expect_equal("shape of expand_key_heads([2, 4, 3, 5], 6)", tuple(got.shape), (2, 4, 6, 5))
    heads = got[0, 0, :, 0].tolist()
    if heads == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]:
        raise AssertionError(
            "value heads read key heads 0,1,2,0,1,2 (tiled): neighbouring value heads share a "
            "key head, so value head j reads key head j // ratio (0,0,1,1,2,2), as "
            "repeat_interleave does"
        )
    expect_equal("key head read by each value head", heads, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0])
    expect_equal("ratio 1 changes nothing", expand_key_heads(x, 3), x)


@hidden("ch05.expand_key_heads")
def _(expand_key_heads):
    x = randn(1, 3, 2, 4, seed=11)
    expect_equal("ratio 4", expand_key_heads(x, 8), x.repeat_interleave(4, dim=2))


# --- recurrent_step -----------------------------------------------------------------------------


def _step_inputs(seed: int, B: int = 1, H: int = 2, d_k: int = 4, d_v: int = 3):
    S = randn(B, H, d_k, d_v, seed=seed)
    q, k = _unit(B, H, d_k, seed=seed + 1), _unit(B, H, d_k, seed=seed + 2)
    v = randn(B, H, d_v, seed=seed + 3)
    g = -torch.rand(B, H, generator=seeded(seed + 4)) - 0.1
    beta = torch.rand(B, H, generator=seeded(seed + 5)) * 0.8 + 0.1
    return S, q, k, v, g, beta


@public("ch05.recurrent_step")
def _(recurrent_step):
    """no write (k = 0): the state only decays"""
    S, q, k, v, g, beta = _step_inputs(0)
    _, S_new = recurrent_step(S, q, torch.zeros_like(k), v, g, beta)
    if _close(S_new, g[..., None, None] * S):
        raise AssertionError(
            "the state was multiplied by g: g is the log of the decay (g <= 0), so the state is "
            "multiplied by exp(g), a number between 0 and 1"
        )
    if _close(S_new, S):
        raise AssertionError("the state did not decay: multiply it by exp(g) first")
    expect_close("state after a step with k = 0", S_new, g.exp()[..., None, None] * S)


@public("ch05.recurrent_step")
def _(recurrent_step):
    """empty state: the first write is beta k v^T"""
    S, q, k, v, g, beta = _step_inputs(1)
    o, S_new = recurrent_step(torch.zeros_like(S), q, k, v, g, beta)
    write = k[..., :, None] * v[..., None, :]  # k v^T
    expected = beta[..., None, None] * write
    if _close(S_new, write):
        raise AssertionError(
            "the write is k v^T: beta (the writing strength, 0..1) is missing; the delta rule "
            "writes beta * k (v - S^T k)^T"
        )
    if _close(S_new, g.exp()[..., None, None] * expected):
        raise AssertionError(
            "the new write was decayed: decay the OLD state first, then write; the current "
            "token's write is not decayed"
        )
    expect_close("state after one write into an empty state", S_new, expected)
    if _close(o, torch.zeros_like(o), 1e-7):
        raise AssertionError("the output is 0: read the state AFTER this token's write")


@public("ch05.recurrent_step")
def _(recurrent_step):
    """the delta rule writes the error v - S^T k"""
    S, q, k, v, g, beta = _step_inputs(2)
    o, S_new = recurrent_step(S, q, k, v, g, beta)
    decayed = g.exp()[..., None, None] * S
    predicted = (k[..., None, :] @ decayed).squeeze(-2)  # what the decayed state recalls for k
    plain = decayed + beta[..., None, None] * k[..., :, None] * v[..., None, :]
    if _close(S_new, plain):
        raise AssertionError(
            "v was written as it is: the delta rule writes only the error v - S^T k (what the "
            "decayed state does not already recall for k), which is what makes it overwrite "
            "instead of pile up"
        )
    err = beta[..., None] * (v - predicted)
    expected = decayed + k[..., :, None] * err[..., None, :]
    expect_close("state after a step", S_new, expected)
    if _close(o, (q[..., None, :] @ S).squeeze(-2)) or _close(
        o, (q[..., None, :] @ decayed).squeeze(-2)
    ):
        raise AssertionError("the output read the old state: read S^T q after the write")
    expect_close("output S^T q", o, (q[..., None, :] @ expected).squeeze(-2))


@hidden("ch05.recurrent_step")
def _(recurrent_step):
    S, q, k, v, g, beta = _step_inputs(5, B=3, H=4, d_k=8, d_v=5)
    o, S_new = recurrent_step(S, q, k, v, g, beta)
    o_ref, S_ref = ref.recurrent_step(S, q, k, v, g, beta)
    expect_close("state [3, 4, 8, 5]", S_new, S_ref)
    expect_close("output [3, 4, 5]", o, o_ref)


# --- decay_mask ---------------------------------------------------------------------------------


@public("ch05.decay_mask")
def _(decay_mask):
    """hand example"""
    G = torch.tensor([-0.5, -1.0, -3.0])  # cumulative log-decay of 3 tokens
    e = torch.exp
    expected = torch.tensor(
        [
            [1.0, 0.0, 0.0],
            [e(torch.tensor(-0.5)), 1.0, 0.0],
            [e(torch.tensor(-2.5)), e(torch.tensor(-2.0)), 1.0],
        ]
    )
    M = decay_mask(G)
    if _close(M, expected.T):
        raise AssertionError(
            "the mask is transposed: row t (the reader), column s (the writer), "
            "M[t, s] = exp(G[t] - G[s]) for s <= t, 0 above the diagonal"
        )
    if _close(M, expected.tril(-1)):
        raise AssertionError(
            "the diagonal is 0: a token reads its own write undecayed, M[t, t] = exp(0) = 1"
        )
    expect_close("decay_mask([-0.5, -1, -3])", M, expected, atol=1e-6, rtol=1e-6)


@public("ch05.decay_mask")
def _(decay_mask):
    """strong decays: no inf, no NaN"""
    G = torch.tensor([-100.0, -200.0, -300.0, -400.0])  # exp(-400) underflows to 0
    M = decay_mask(G)
    if not torch.isfinite(M).all():
        raise AssertionError(
            "inf or NaN for strong decays: exp(G[t]) / exp(G[s]) is 0 / 0 once exp underflows, "
            "and exp of the (positive) upper-triangle differences overflows. Take "
            "exp(G[t] - G[s]) of the difference, with the future (s > t) set to -inf BEFORE exp"
        )
    expected = torch.exp(torch.tensor([[0.0, 0, 0, 0], [-100, 0, 0, 0], [-200, -100, 0, 0],
                                       [-300, -200, -100, 0]])).tril()  # fmt: skip
    expect_close("decay_mask of strong decays", M, expected, atol=1e-30, rtol=1e-5)


@hidden("ch05.decay_mask")
def _(decay_mask):
    G = (-torch.rand(2, 3, 5, 16, generator=seeded(21)) * 3).cumsum(-1)  # [B, H, N, C]
    expect_close("batched [2, 3, 5, 16]", decay_mask(G), ref.decay_mask(G), atol=1e-6)


# --- solve_unit_lower ---------------------------------------------------------------------------


def _lower(n: int, seed: int, batch=()):
    return (randn(*batch, n, n, seed=seed) * 0.3).tril(-1)


@public("ch05.solve_unit_lower")
def _(solve_unit_lower):
    """hand example"""
    A = torch.tensor([[0.0, 0.0], [0.5, 0.0]])
    b = torch.tensor([[1.0], [2.0]])
    X = solve_unit_lower(A, b)
    # (I + A) X = b: x0 = 1, x1 = 2 - 0.5 * x0 = 1.5
    if _close(X, torch.tensor([[1.0], [2.5]])):
        raise AssertionError("solved (I - A) X = b: the system is (I + A) X = b")
    if _close(X, torch.tensor([[0.0], [2.0]])):
        raise AssertionError(
            "solved with A transposed (upper triangular): row t depends on the rows BEFORE it "
            "(forward substitution)"
        )
    expect_close("solve_unit_lower([[0, 0], [0.5, 0]], [1, 2])", X, torch.tensor([[1.0], [1.5]]))


@public("ch05.solve_unit_lower")
def _(solve_unit_lower):
    """random 6 x 6, two right-hand sides, against torch.linalg.solve"""
    A, b = _lower(6, 30), randn(6, 2, seed=31)
    X = solve_unit_lower(A, b)
    expected = torch.linalg.solve(torch.eye(6) + A, b)
    if _close(X, torch.linalg.solve(torch.eye(6) + A.T, b), 1e-4):
        raise AssertionError(
            "solved with A transposed (upper triangular): row t depends on the rows BEFORE it "
            "(forward substitution)"
        )
    expect_close("(I + A) X = b", X, expected, atol=1e-5, rtol=1e-5)


@hidden("ch05.solve_unit_lower")
def _(solve_unit_lower):
    A, b = _lower(16, 32, batch=(2, 3)), randn(2, 3, 16, 5, seed=33)
    expected = torch.linalg.solve(torch.eye(16) + A, b)
    expect_close("batched [2, 3, 16, 16]", solve_unit_lower(A, b), expected, atol=1e-4)


# --- pad_to_chunks ------------------------------------------------------------------------------


@public("ch05.pad_to_chunks")
def _(pad_to_chunks):
    x = torch.ones(2, 3, 5)
    got = pad_to_chunks(x, 4, dim=1)
    expect_equal("shape of pad_to_chunks([2, 3, 5], 4, dim=1)", tuple(got.shape), (2, 4, 5))
    expect_equal("the real tokens are kept", got[:, :3], x)
    if not torch.equal(got[:, 3:], torch.zeros(2, 1, 5)):
        raise AssertionError(
            "the padding is not zeros: only g = 0 (no decay), beta = 0 and k = 0 (no write) "
            "make a token that leaves the state exactly as it is"
        )
    expect_equal("a whole number of chunks is left as it is", pad_to_chunks(x, 3, dim=1), x)


@hidden("ch05.pad_to_chunks")
def _(pad_to_chunks):
    x = randn(2, 7, seed=40)
    expect_equal("last dim", pad_to_chunks(x, 5, dim=-1), F.pad(x, (0, 3)))
    expect_equal("chunk of 1", pad_to_chunks(x, 1, dim=1), x)


# --- chunk_loop ---------------------------------------------------------------------------------


@contextmanager
def _chunk_rule_with(chunk_loop):
    """The package's chunk_gated_delta_rule running the given loop."""
    saved = ref.chunk_loop
    ref.chunk_loop = chunk_loop
    try:
        yield ref.chunk_gated_delta_rule
    finally:
        ref.chunk_loop = saved


def _rule_inputs(T: int, seed: int, H_k: int = 2, ratio: int = 1, d_k: int = 8, d_v: int = 4):
    H_v = H_k * ratio
    q, k = _unit(1, T, H_k, d_k, seed=seed), _unit(1, T, H_k, d_k, seed=seed + 1)
    v = randn(1, T, H_v, d_v, seed=seed + 2)
    g = -torch.rand(1, T, H_v, generator=seeded(seed + 3)) * 0.2  # a long memory
    beta = torch.rand(1, T, H_v, generator=seeded(seed + 4))
    S0 = randn(1, H_v, d_k, d_v, seed=seed + 5)
    return q, k, v, g, beta, S0


@public("ch05.chunk_loop")
def _(chunk_loop):
    """one chunk, empty state: equals the recurrent form"""
    q, k, v, g, beta, _ = _rule_inputs(8, 50)
    with _chunk_rule_with(chunk_loop) as chunk_gated_delta_rule:
        out, S = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8)
    out_r, S_r = ref.recurrent_gated_delta_rule(q, k, v, g, beta)
    expect_close("output of one chunk vs the recurrent form", out, out_r, atol=1e-5)
    expect_close("final state of one chunk vs the recurrent form", S, S_r, atol=1e-5)


@public("ch05.chunk_loop")
def _(chunk_loop):
    """three chunks: the state passes from one to the next"""
    q, k, v, g, beta, _ = _rule_inputs(20, 60)
    with _chunk_rule_with(chunk_loop) as chunk_gated_delta_rule:
        out, S = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8)
    out_r, S_r = ref.recurrent_gated_delta_rule(q, k, v, g, beta)
    first = out[:, :8]
    expect_close("first chunk", first, out_r[:, :8], atol=1e-5)
    if not _close(out[:, 8:], out_r[:, 8:]):
        alone, _ = ref.recurrent_gated_delta_rule(*(x[:, 8:16] for x in (q, k, v, g, beta)))
        if _close(out[:, 8:16], alone):
            raise AssertionError(
                "the second chunk starts from an empty state: pass the state on, "
                "S <- exp(G_last) S + (exp(G_last - G) K)^T U after each chunk"
            )
        raise AssertionError(
            "the second chunk differs from the recurrent form: its writes must subtract what "
            "the entering state already predicts (U = U0 - W S), its reads add q_decayed S, "
            "and the state must decay by exp(G_last) over the chunk"
        )
    expect_close("output over 3 chunks", out, out_r, atol=1e-5)
    expect_close("final state", S, S_r, atol=1e-5)


@public("ch05.chunk_loop")
def _(chunk_loop):
    """continuing from initial_state"""
    q, k, v, g, beta, S0 = _rule_inputs(12, 70)
    with _chunk_rule_with(chunk_loop) as chunk_gated_delta_rule:
        out, S = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=S0)
    out_r, S_r = ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0)
    fresh, _ = ref.recurrent_gated_delta_rule(q, k, v, g, beta)
    if _close(out, fresh):
        raise AssertionError(
            "the state S given to the loop was ignored (initial_state): a continuation (the "
            "rest of a prompt, fed after a first piece) must start from the state the first "
            "piece left, not from zeros"
        )
    expect_close("output continuing from a state", out, out_r, atol=1e-5)
    expect_close("final state continuing from a state", S, S_r, atol=1e-5)


@hidden("ch05.chunk_loop")
def _(chunk_loop):
    q, k, v, g, beta, S0 = _rule_inputs(37, 80, H_k=2, ratio=2, d_k=16, d_v=8)
    for C in (4, 16, 64):
        with _chunk_rule_with(chunk_loop) as chunk_gated_delta_rule:
            out, S = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=C, initial_state=S0)
        out_r, S_r = ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0)
        expect_close(f"H_v = 2 H_k, chunk {C}: output", out, out_r, atol=2e-5)
        expect_close(f"H_v = 2 H_k, chunk {C}: state", S, S_r, atol=2e-5)


# --- causal_conv1d ------------------------------------------------------------------------------


def _naive_conv(x, weight, state):
    """y[c, t] = sum_j weight[c, 0, j] * history[c, t + j], history = state then x."""
    full = torch.cat([state, x], dim=-1)
    K, T = weight.shape[-1], x.shape[-1]
    y = torch.zeros_like(x)
    for t in range(T):
        y[..., t] = (full[..., t : t + K] * weight[:, 0, :]).sum(-1)
    return y, full[..., -(K - 1) :]


@public("ch05.causal_conv1d")
def _(causal_conv1d):
    """from an empty state: y[t] sees inputs t-K+1 .. t"""
    x, w = randn(1, 3, 6, seed=90), randn(3, 1, 4, seed=91)
    state = torch.zeros(1, 3, 3)
    y, new = causal_conv1d(x, w, state)
    expected, expected_state = _naive_conv(x, w, state)
    expect_equal("shape of y", tuple(y.shape), (1, 3, 6))
    later = x.clone()
    later[..., -1] += 10.0  # change only the last input: no earlier output may move
    if not _close(causal_conv1d(later, w, state)[0][..., :-1], y[..., :-1]):
        raise AssertionError(
            "the output sees future inputs: a causal conv pads K-1 inputs on the LEFT only, so "
            "y[t] uses x[t-K+1 .. t]"
        )
    expect_close("y from an empty state", y, expected, atol=1e-5)
    expect_close("new state: the last K-1 inputs", new, expected_state, atol=0, rtol=0)


@public("ch05.causal_conv1d")
def _(causal_conv1d):
    """continuing: the state holds the inputs before x"""
    x, w, state = randn(2, 3, 5, seed=92), randn(3, 1, 4, seed=93), randn(2, 3, 3, seed=94)
    y, new = causal_conv1d(x, w, state)
    expected, expected_state = _naive_conv(x, w, state)
    if _close(y, _naive_conv(x, w, torch.zeros_like(state))[0]):
        raise AssertionError(
            "conv_state was ignored: the first K-1 outputs of a continuation need the inputs "
            "of the K-1 tokens before it"
        )
    expect_close("y continuing from a state", y, expected, atol=1e-5)
    expect_close("new state", new, expected_state, atol=0, rtol=0)


@public("ch05.causal_conv1d")
def _(causal_conv1d):
    """one token at a time (decoding): the state still holds K-1 inputs"""
    x, w, state = randn(1, 3, 1, seed=95), randn(3, 1, 4, seed=96), randn(1, 3, 3, seed=97)
    y, new = causal_conv1d(x, w, state)
    expected, expected_state = _naive_conv(x, w, state)
    expect_equal("shape of the new state after 1 token", tuple(new.shape), (1, 3, 3))
    if not torch.equal(new, expected_state):
        raise AssertionError(
            "the new state is not the last K-1 inputs of (old state, x): with fewer new tokens "
            "than K-1 (decoding), part of it comes from the old state"
        )
    expect_close("y of one token", y, expected, atol=1e-5)


@hidden("ch05.causal_conv1d")
def _(causal_conv1d):
    x, w, state = randn(2, 5, 9, seed=98), randn(5, 1, 3, seed=99), randn(2, 5, 2, seed=100)
    y, new = causal_conv1d(x, w, state)
    expected, expected_state = _naive_conv(x, w, state)
    expect_close("kernel 3, 9 tokens", y, expected, atol=1e-5)
    expect_close("kernel 3 state", new, expected_state, atol=0, rtol=0)


# --- GatedRMSNorm -------------------------------------------------------------------------------


def _gated(x, z, w, eps=1e-6):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w * F.silu(z.float())


@public("ch05.GatedRMSNorm")
def _(GatedRMSNorm):
    norm = GatedRMSNorm(6, eps=1e-6)
    expect_equal("weight starts at ones", norm.weight.detach(), torch.ones(6))
    with torch.no_grad():
        norm.weight.copy_(randn(6, seed=110) * 0.3 + 1)
    w = norm.weight.detach()
    x, z = randn(2, 3, 6, seed=111), randn(2, 3, 6, seed=112)
    y = norm(x, z)
    x32 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    if _close(y, x32 * (1 + w) * F.silu(z)):
        raise AssertionError(
            "the weight was used as (1 + w): that is the zero-centred norm of the decoder "
            "layers; the gated norm inside Gated DeltaNet scales by w itself"
        )
    if _close(y, x32 * w * torch.sigmoid(z)):
        raise AssertionError("the gate is sigmoid(z): Gated DeltaNet gates with silu(z) = z·σ(z)")
    gated_first = x * F.silu(z)
    if _close(y, gated_first * torch.rsqrt(gated_first.pow(2).mean(-1, keepdim=True) + 1e-6) * w):
        raise AssertionError("the gate was applied before the norm: normalise x, then gate")
    expect_close("x_hat * w * silu(z)", y, _gated(x, z, w), atol=1e-5)


@hidden("ch05.GatedRMSNorm")
def _(GatedRMSNorm):
    norm = GatedRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(16, seed=113) + 1)
    x, z = randn(4, 16, seed=114) * 30, randn(4, 16, seed=115)
    expect_close("larger inputs", norm(x, z), _gated(x, z, norm.weight.detach()), atol=1e-4)
    xb, zb = x.bfloat16(), z.bfloat16()
    out = norm.to(torch.bfloat16)(xb, zb)
    expect_equal("dtype follows x", out.dtype, torch.bfloat16)
    expect_close(
        "bfloat16", out.float(), _gated(xb, zb, norm.weight.detach().float()), atol=0.1, rtol=0.02
    )
