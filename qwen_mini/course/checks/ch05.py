"""Checks for chapter 5 (Gated DeltaNet: the recurrent step, the decay mask, the triangular
solve, the chunk loop with state passing, the causal conv state, the gated norm).

Each exercise is a list of cases and a catalogue of typical mistakes whose ideas the messages name.
Expected values come from hand-worked examples, from naive loops written here (one token at a
time), from `torch.linalg.solve`, from the recurrent form of the rule, and from the package's
reference.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

from qwen_mini import attention, norms, rope
from qwen_mini import deltanet as ref
from qwen_mini.architectures import ARCHITECTURES
from qwen_mini.config import Config
from qwen_mini.course.checking import between, mistake, named, randn, register, seeded
from qwen_mini.course.observing import graded, observe
from qwen_mini.course.variants import bfloat16, case, meta, registered
from qwen_mini.rope import apply_rope, rope_cos_sin
from qwen_mini.rope_scaling import rotary_cos_sin

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


def _unit(*shape, g):
    x = randn(*shape, g=g)
    return x / x.norm(dim=-1, keepdim=True)


# --- expand_key_heads ---------------------------------------------------------------------------

EXPAND = "ch05.expand_key_heads"
HEADS = torch.arange(3.0).view(1, 1, 3, 1).expand(2, 4, 3, 5)  # key head h holds the value h
case(EXPAND, "expand_key_heads([2, 4, 3, 5], 6): key head h holds h", lambda g: (HEADS, 6))
case(EXPAND, "ratio 1 changes nothing", lambda g: (HEADS, 3))
case(EXPAND, "ratio 3 (2 key heads, 6 value heads)", lambda g: (randn(1, 2, 2, 3, g=g), 6), seed=5)
case(
    EXPAND, "bfloat16 in, bfloat16 out", lambda g: (randn(2, 3, 2, 4, g=g, dtype=torch.bfloat16), 4)
)
case(
    EXPAND,
    "other ratios",
    lambda g: (randn(1, 3, between(g, 1, 4), 4, g=g), 0),
    lambda expand, x, _: expand(x, x.shape[2] * 4),
    hidden=True,
)


@mistake(
    EXPAND,
    "value heads read key heads 0,1,2,0,1,2 (tiled): neighbouring value heads share a key head, "
    "so value head j reads key head j // ratio (0,0,1,1,2,2), as repeat_interleave does",
)
def expand_tiled(x, n_value_heads):
    return x.repeat(1, 1, n_value_heads // x.shape[2], 1)


@mistake(EXPAND, "the ratio is n_value_heads // H_k (here not 2): compute it from the shapes")
def expand_ratio_two(x, n_value_heads):
    return x.repeat_interleave(2, dim=2)


# --- recurrent_step -----------------------------------------------------------------------------

STEP = "ch05.recurrent_step"


def _step_inputs(B=1, H=2, d_k=4, d_v=3, write=True, empty=False):
    def inputs(g):
        S = randn(B, H, d_k, d_v, g=g) * (0 if empty else 1)
        q, k = _unit(B, H, d_k, g=g), _unit(B, H, d_k, g=g) * (1 if write else 0)
        v = randn(B, H, d_v, g=g)
        decay = -torch.rand(B, H, generator=g) - 0.1
        beta = torch.rand(B, H, generator=g) * 0.8 + 0.1
        return S, q, k, v, decay, beta

    return inputs


def _step(recurrent_step, *arguments):
    return named(recurrent_step(*arguments), "output S^T q [B, H, d_v]", "state [B, H, d_k, d_v]")


def _step_hidden(g):
    sizes = dict(B=between(g, 1, 3), H=between(g, 1, 4), d_k=4 * between(g, 1, 4))
    return _step_inputs(**sizes, d_v=between(g, 1, 8))(g)


case(
    STEP,
    "no write (k = 0): the state only decays",
    _step_inputs(write=False),
    _step,
    atol=1e-5,
    rtol=1e-5,
)
case(
    STEP,
    "empty state: the first write is beta k v^T",
    _step_inputs(empty=True),
    _step,
    atol=1e-5,
    rtol=1e-5,
    seed=1,
)
case(
    STEP,
    "the delta rule writes the error v - S^T k",
    _step_inputs(),
    _step,
    atol=1e-5,
    rtol=1e-5,
    seed=2,
    # the rule written with an identity (I - beta k k^T) S makes one: on the state's device
    variants=("meta",),
)
case(
    STEP,
    "B = 2, 3 heads, d_k = 8, d_v = 5",
    _step_inputs(B=2, H=3, d_k=8, d_v=5),
    _step,
    atol=1e-5,
    rtol=1e-5,
    seed=3,
)
for n in range(2):
    case(STEP, f"other sizes {n + 1}", _step_hidden, _step, atol=1e-5, rtol=1e-5, hidden=True)


def _read(q, S):
    return (q[..., None, :] @ S).squeeze(-2)


@mistake(
    STEP,
    "the state was multiplied by g: g is the log of the decay (g <= 0), so the state is "
    "multiplied by exp(g), a number between 0 and 1",
)
def step_g_as_multiplier(S, q, k, v, g, beta):
    return ref.recurrent_step(S * g[..., None, None] / g.exp()[..., None, None], q, k, v, g, beta)


@mistake(STEP, "the state did not decay: multiply it by exp(g) first")
def step_no_decay(S, q, k, v, g, beta):
    return ref.recurrent_step(S, q, k, v, torch.zeros_like(g), beta)


@mistake(
    STEP,
    "the write is k v^T: beta (the writing strength, 0..1) is missing; the delta rule writes "
    "beta * k (v - S^T k)^T",
)
def step_no_beta(S, q, k, v, g, beta):
    return ref.recurrent_step(S, q, k, v, g, torch.ones_like(beta))


@mistake(
    STEP,
    "the new write was decayed: decay the OLD state first, then write; the current token's "
    "write is not decayed",
)
def step_decay_after_write(S, q, k, v, g, beta):
    u = beta[..., None] * (v - (k[..., None, :] @ S).squeeze(-2))
    S = (S + k[..., :, None] * u[..., None, :]) * g.exp()[..., None, None]
    return _read(q, S), S


@mistake(
    STEP,
    "v was written as it is: the delta rule writes only the error v - S^T k (what the decayed "
    "state does not already recall for k), which is what makes it overwrite instead of pile up",
)
def step_plain_write(S, q, k, v, g, beta):
    S = S * g.exp()[..., None, None]
    S = S + k[..., :, None] * (beta[..., None] * v)[..., None, :]
    return _read(q, S), S


@mistake(STEP, "the output read the old state: read S^T q AFTER this token's write")
def step_read_before_write(S, q, k, v, g, beta):
    _, S_new = ref.recurrent_step(S, q, k, v, g, beta)
    return _read(q, S * g.exp()[..., None, None]), S_new


# --- decay_mask ---------------------------------------------------------------------------------

MASK = "ch05.decay_mask"
e = torch.exp
case(
    MASK,
    "hand example: G = [-0.5, -1, -3]",
    lambda g: (torch.tensor([-0.5, -1.0, -3.0]),),
    expected=lambda G: torch.tensor(
        [[1.0, 0.0, 0.0], [e(-G[0] + G[1]), 1.0, 0.0], [e(G[2] - G[0]), e(G[2] - G[1]), 1.0]]
    ).tril(),
    atol=1e-6,
    rtol=1e-6,
    variants=("meta",),
)
case(
    MASK,
    "strong decays (exp(-400) underflows to 0): no inf, no NaN",
    lambda g: (torch.tensor([-100.0, -200.0, -300.0, -400.0]),),
    expected=lambda G: torch.exp(
        torch.tensor([[0.0, 0, 0, 0], [-100, 0, 0, 0], [-200, -100, 0, 0], [-300, -200, -100, 0]])
    ).tril(),
    atol=1e-30,
    rtol=1e-5,
)
case(
    MASK,
    "batched [B, H, N, C] = [2, 3, 2, 8]",
    lambda g: ((-torch.rand(2, 3, 2, 8, generator=g) * 3).cumsum(-1),),
    atol=1e-6,
    seed=4,
)
case(
    MASK,
    "float64 sums in the thousands (G from -3000 down, steps of 0.001 to 0.01): keep the dtype",
    lambda g: ((-3000 - (torch.rand(8, generator=g) * 0.01 + 1e-3).cumsum(-1)).double(),),
    expected=lambda G: torch.exp(G[:, None] - G[None, :]).tril(),
    atol=1e-9,
    rtol=1e-9,
    seed=6,
)


def _watched_mask(decay_mask, G):
    """The mask, and whether any operation in it overflowed: the tiny model trains through the
    chunk form, and an inf zeroed after `exp` (by tril or where) gives NaN gradients. Observed
    where the code runs (when graded: in the sandbox)."""
    with observe("overflows") as seen:
        M = decay_mask(G)
    return {"mask": M, "an operation overflowed to +inf or NaN (NaN gradients)": bool(seen.value)}


def _naive_mask(G):  # M[t, s] = exp(G[t] - G[s]) for s <= t, one entry at a time
    C = G.shape[-1]
    M = torch.zeros(C, C, dtype=G.dtype)
    for t in range(C):
        for s in range(t + 1):
            M[t, s] = torch.exp(G[t] - G[s])
    return {"mask": M, "an operation overflowed to +inf or NaN (NaN gradients)": False}


case(
    MASK,
    "|G| in the thousands (float64, the chunk form's dtype): nothing overflows",
    lambda g: ((-torch.rand(12, generator=g) * 400).cumsum(-1).double(),),
    _watched_mask,
    _naive_mask,
    atol=1e-9,
    rtol=1e-7,
    seed=7,
)
case(
    MASK,
    "batched [B, H, N, C]",
    lambda g: ((-torch.rand(2, 3, between(g, 1, 5), 16, generator=g) * 3).cumsum(-1),),
    atol=1e-6,
    hidden=True,
)


@mistake(
    MASK,
    "inf or NaN for strong decays: exp(G[t]) / exp(G[s]) is 0 / 0 once exp underflows; take "
    "exp(G[t] - G[s]) of the difference",
)
def mask_ratio_of_exponentials(G):
    E = G.exp()
    return (E[..., :, None] / E[..., None, :]).tril()


@mistake(
    MASK,
    "the mask is transposed: row t (the reader), column s (the writer), M[t, s] = "
    "exp(G[t] - G[s]) for s <= t, 0 above the diagonal",
)
def mask_transposed(G):
    return ref.decay_mask(G).transpose(-1, -2)


@mistake(MASK, "the diagonal is 0: a token reads its own write undecayed, M[t, t] = exp(0) = 1")
def mask_strict(G):
    return ref.decay_mask(G).tril(-1)


@mistake(
    MASK,
    "inf or NaN for strong decays: exp of the (positive) upper-triangle differences overflows; "
    "set the future (s > t) to -inf BEFORE exp",
)
def mask_exp_then_zero(G):
    diff = G[..., :, None] - G[..., None, :]
    C = G.shape[-1]
    return diff.exp() * torch.ones(C, C).tril()  # exp overflows above the diagonal: inf * 0


@mistake(
    MASK,
    "exp overflowed for strong decays: exp(...).tril() (or torch.where after exp) zeroes the "
    "inf above the diagonal in the forward pass, but the backward multiplies that inf by 0, so "
    "the gradients are NaN; set the future to -inf BEFORE exp (masked_fill)",
)
def mask_exp_tril(G):
    return (G[..., :, None] - G[..., None, :]).exp().tril()


@mistake(
    MASK,
    "keep G's dtype (float64 in the chunk form): at sums in the thousands float32 keeps 3 "
    "decimals and the small decays between neighbours are lost",
)
def mask_float32(G):
    return ref.decay_mask(G.float())


# --- solve_unit_lower ---------------------------------------------------------------------------

SOLVE = "ch05.solve_unit_lower"


def _lower(*batch, n, rhs):
    return lambda g: ((randn(*batch, n, n, g=g) * 0.3).tril(-1), randn(*batch, n, rhs, g=g))


def _solved(A, b):
    return torch.linalg.solve(torch.eye(A.shape[-1]) + A, b)


# (I + A) X = b: x0 = 1, x1 = 2 - 0.5 * x0 = 1.5
case(
    SOLVE,
    "hand example: A = [[0, 0], [0.5, 0]], b = [1, 2]",
    lambda g: (torch.tensor([[0.0, 0.0], [0.5, 0.0]]), torch.tensor([[1.0], [2.0]])),
    expected=lambda A, b: torch.tensor([[1.0], [1.5]]),
    atol=1e-5,
    variants=("meta",),
)
case(
    SOLVE,
    "random 6 x 6, two right-hand sides, against torch.linalg.solve",
    _lower(n=6, rhs=2),
    expected=_solved,
    atol=1e-5,
    rtol=1e-5,
    seed=30,
)
case(
    SOLVE,
    "batched [2, 3, 8, 8], three right-hand sides",
    lambda g: _lower(2, 3, n=8, rhs=3)(g),
    expected=_solved,
    atol=1e-4,
    rtol=1e-4,
    seed=31,
)
case(
    SOLVE,
    "batched",
    lambda g: _lower(2, 3, n=4 * between(g, 1, 6), rhs=between(g, 1, 5))(g),
    expected=_solved,
    atol=1e-4,
    rtol=1e-4,
    hidden=True,
)


@mistake(SOLVE, "solved (I - A) X = b: the system is (I + A) X = b")
def solve_minus(A, rhs):
    return ref.solve_unit_lower(-A, rhs)


@mistake(
    SOLVE,
    "solved with A transposed (upper triangular): row t depends on the rows BEFORE it (forward "
    "substitution)",
)
def solve_transposed(A, rhs):
    return torch.linalg.solve(torch.eye(A.shape[-1]) + A.transpose(-1, -2), rhs)


# --- pad_to_chunks ------------------------------------------------------------------------------

PAD = "ch05.pad_to_chunks"


def _pad(pad_to_chunks, x, chunk_size, dim):
    return pad_to_chunks(x, chunk_size, dim=dim)


case(
    PAD,
    "pad_to_chunks(ones [2, 3, 5], 4, dim=1)",
    lambda g: (torch.ones(2, 3, 5), 4, 1),
    _pad,
    variants=("meta",),
)
case(PAD, "a whole number of chunks is left as it is", lambda g: (torch.ones(2, 3, 5), 3, 1), _pad)
case(PAD, "the last dim (dim=-1), 7 -> 9", lambda g: (randn(2, 7, g=g), 3, -1), _pad, seed=8)
case(PAD, "a chunk of 1 changes nothing", lambda g: (randn(2, 7, g=g), 1, 1), _pad, seed=9)
case(
    PAD,
    "bfloat16 stays bfloat16",
    lambda g: (randn(1, 5, 2, g=g, dtype=torch.bfloat16), 4, 1),
    _pad,
    seed=10,
)
case(
    PAD,
    "the last dim",
    lambda g: (randn(2, between(g, 1, 9), g=g), between(g, 2, 6), -1),
    _pad,
    hidden=True,
)
case(PAD, "a chunk of 1", lambda g: (randn(2, 7, g=g), 1, 1), _pad, hidden=True)


@mistake(
    PAD,
    "the padding is not zeros: only g = 0 (no decay), beta = 0 and k = 0 (no write) make a "
    "token that leaves the state exactly as it is",
)
def pad_with_ones(x, chunk_size, dim):
    pad = -x.shape[dim] % chunk_size
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_ones(shape)], dim=dim)


@mistake(PAD, "the padding must have x's dtype (x.new_zeros): torch.zeros is float32")
def pad_float32_zeros(x, chunk_size, dim):
    pad = -x.shape[dim] % chunk_size
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x.float(), torch.zeros(shape)], dim=dim)


# --- chunk_loop ---------------------------------------------------------------------------------

LOOP = "ch05.chunk_loop"


@contextmanager
def _chunk_rule_with(chunk_loop):
    """The package's chunk_gated_delta_rule running the given loop."""
    saved = ref.chunk_loop
    ref.chunk_loop = chunk_loop
    try:
        yield ref.chunk_gated_delta_rule
    finally:
        ref.chunk_loop = saved


def _rule_inputs(T, C, H_k=2, ratio=1, d_k=8, d_v=4, initial=False):
    def inputs(g):
        H_v = H_k * ratio
        q, k = _unit(1, T, H_k, d_k, g=g), _unit(1, T, H_k, d_k, g=g)
        v = randn(1, T, H_v, d_v, g=g)
        decay = -torch.rand(1, T, H_v, generator=g) * 0.2  # a long memory
        beta = torch.rand(1, T, H_v, generator=g)
        S0 = randn(1, H_v, d_k, d_v, g=g) if initial else None
        return q, k, v, decay, beta, S0, C

    return inputs


def _rule_hidden(g):
    C = (4, 16, 64)[between(g, 0, 2)]
    return _rule_inputs(between(g, 5, 40), C, ratio=2, d_k=16, d_v=8, initial=True)(g)


def _chunked(chunk_loop, q, k, v, g, beta, S0, C):
    with _chunk_rule_with(chunk_loop) as chunk_gated_delta_rule:
        out, S = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=C, initial_state=S0)
    return {"output": out, "final state": S}


def _recurrent(q, k, v, g, beta, S0, C):  # the same rule, one token at a time
    out, S = ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0)
    return {"output": out, "final state": S}


tol = dict(atol=1e-5, rtol=1e-5)
case(
    LOOP,
    "one chunk, empty state: equals the recurrent form",
    _rule_inputs(8, 8),
    _chunked,
    _recurrent,
    **tol,
    seed=50,
)
case(
    LOOP,
    "three chunks: the state passes from one to the next",
    _rule_inputs(20, 8),
    _chunked,
    _recurrent,
    **tol,
    seed=60,
    variants=("meta",),  # the output it fills (or the state) made on its inputs' device
)
case(
    LOOP,
    "continuing from initial_state",
    _rule_inputs(12, 8, initial=True),
    _chunked,
    _recurrent,
    **tol,
    seed=70,
)
case(
    LOOP,
    "4 value heads on 2 key heads, 5 chunks of 4, from a state",
    _rule_inputs(18, 4, ratio=2, d_k=16, d_v=8, initial=True),
    _chunked,
    _recurrent,
    atol=2e-5,
    rtol=2e-5,
    seed=80,
)


for n in range(3):
    case(
        LOOP,
        f"H_v = 2 H_k, other chunk sizes {n + 1}",
        _rule_hidden,
        _chunked,
        _recurrent,
        atol=2e-5,
        rtol=2e-5,
        hidden=True,
    )


def _loop_variant(
    restart_each_chunk=False, ignore_initial=False, no_state_correction=False, no_decay=False
):
    """The chunk loop with one typical mistake."""

    def chunk_loop(U0, W, scores, q_decayed, k_to_end, chunk_decay, S):
        if ignore_initial:
            S = torch.zeros_like(S)
        out = torch.empty_like(U0)
        for n in range(U0.shape[2]):
            if restart_each_chunk:
                S = torch.zeros_like(S)
            U = U0[:, :, n] if no_state_correction else U0[:, :, n] - W[:, :, n] @ S
            out[:, :, n] = q_decayed[:, :, n] @ S + scores[:, :, n] @ U
            S = (1 if no_decay else chunk_decay[:, :, n]) * S + k_to_end[:, :, n].transpose(
                -1, -2
            ) @ U
        return out, S

    return chunk_loop


for flag, idea in {
    "restart_each_chunk": "the second chunk starts from an empty state: pass the state on, "
    "S <- exp(G_last) S + (exp(G_last - G) K)^T U after each chunk",
    "ignore_initial": "the state S given to the loop was ignored (initial_state): a continuation "
    "(the rest of a prompt, fed after a first piece) must start from the state the first piece "
    "left, not from zeros",
    "no_state_correction": "the writes of a later chunk must subtract what the entering state "
    "already predicts (U = U0 - W S)",
    "no_decay": "the entering state must decay by exp(G_last) over the chunk",
}.items():
    mistake(LOOP, idea, name=f"loop_{flag}")(_loop_variant(**{flag: True}))


# --- causal_conv1d ------------------------------------------------------------------------------

CONV = "ch05.causal_conv1d"


def _conv_inputs(B, C, T, K, empty=False):
    def inputs(g):
        x, w, state = randn(B, C, T, g=g), randn(C, 1, K, g=g), randn(B, C, K - 1, g=g)
        return x, w, state * (0 if empty else 1)

    return inputs


def _conv(causal_conv1d, x, weight, state):
    return named(causal_conv1d(x, weight, state), "y [B, C, T]", "new state [B, C, K-1]")


def _naive_conv(x, weight, state):
    """y[c, t] = sum_j weight[c, 0, j] * history[c, t + j], history = state then x."""
    full = torch.cat([state, x], dim=-1)
    K, T = weight.shape[-1], x.shape[-1]
    y = torch.zeros_like(x)
    for t in range(T):
        y[..., t] = (full[..., t : t + K] * weight[:, 0, :]).sum(-1)
    # not full[..., -(K - 1):]: with K = 1 that is full[..., -0:], every input
    return {"y [B, C, T]": y, "new state [B, C, K-1]": full[..., full.shape[-1] - (K - 1) :]}


def _conv_hidden(g):
    return _conv_inputs(between(g, 1, 3), between(g, 1, 6), between(g, 1, 12), between(g, 1, 5))(g)


case(
    CONV,
    "from an empty state: y[t] sees inputs t-K+1 .. t",
    _conv_inputs(1, 3, 6, 4, empty=True),
    _conv,
    _naive_conv,
    atol=1e-5,
    seed=90,
    variants=("bfloat16", "meta"),
)
case(
    CONV,
    "continuing: the state holds the inputs before x",
    _conv_inputs(2, 3, 5, 4),
    _conv,
    _naive_conv,
    atol=1e-5,
    seed=92,
)
case(
    CONV,
    "one token at a time (decoding): the state still holds K-1 inputs",
    _conv_inputs(1, 3, 1, 4),
    _conv,
    _naive_conv,
    atol=1e-5,
    seed=95,
)
case(
    CONV,
    "a kernel of 2 (a state of one input)",
    _conv_inputs(2, 4, 3, 2),
    _conv,
    _naive_conv,
    atol=1e-5,
    seed=96,
)

case(
    CONV,
    "a kernel of 1: no state (K-1 = 0 inputs), y = w * x",
    _conv_inputs(2, 3, 4, 1),
    _conv,
    _naive_conv,
    atol=1e-5,
    seed=98,
)


def _conv_bf16(g):
    return tuple(t.to(torch.bfloat16) for t in _conv_inputs(1, 3, 5, 4)(g))


case(CONV, "bfloat16 in, bfloat16 out", _conv_bf16, _conv, atol=2e-2, rtol=2e-2, seed=97)
for n in range(2):
    case(CONV, f"other kernels {n + 1}", _conv_hidden, _conv, _naive_conv, atol=1e-5, hidden=True)
case(
    CONV,
    "a kernel of 1, one token at a time",
    lambda g: _conv_inputs(between(g, 1, 3), between(g, 1, 6), 1, 1)(g),
    _conv,
    _naive_conv,
    atol=1e-5,
    hidden=True,
)


@mistake(
    CONV,
    "conv_state was ignored: the first K-1 outputs of a continuation need the inputs of the K-1 "
    "tokens before it",
)
def conv_no_state(x, weight, conv_state):
    return ref.causal_conv1d(x, weight, torch.zeros_like(conv_state))


@mistake(
    CONV,
    "the output sees future inputs: a causal conv pads K-1 inputs on the LEFT only, so y[t] uses "
    "x[t-K+1 .. t]",
)
def conv_symmetric_padding(x, weight, conv_state):
    K = weight.shape[-1]
    y = F.conv1d(x, weight, padding=K // 2, groups=x.shape[1])[..., : x.shape[-1]]
    return y, torch.cat([conv_state, x], -1)[..., -(K - 1) :]


@mistake(
    CONV,
    "the new state is not the last K-1 inputs of (old state, x): with fewer new tokens than K-1 "
    "(decoding), part of it comes from the old state",
)
def conv_state_from_x_only(x, weight, conv_state):
    y, _ = ref.causal_conv1d(x, weight, conv_state)
    K = weight.shape[-1]
    return y, F.pad(x, (max(0, K - 1 - x.shape[-1]), 0))[..., -(K - 1) :]


@mistake(
    CONV,
    "a kernel of 1 keeps no state: x[..., -(K-1):] with K - 1 = 0 is x[..., -0:], the WHOLE "
    "tensor; slice from the end's position instead, full[..., full.shape[-1] - (K - 1):]",
)
def conv_state_negative_zero(x, weight, conv_state):
    y, _ = ref.causal_conv1d(x, weight, conv_state)
    K = weight.shape[-1]
    return y, torch.cat([conv_state, x], -1)[..., -(K - 1) :]


# --- GatedRMSNorm -------------------------------------------------------------------------------

NORM = "ch05.GatedRMSNorm"


def _norm_inputs(*shape, scale=1.0, dtype=torch.float32):
    def inputs(g):
        D = shape[-1]
        return D, randn(D, g=g) * 0.3 + 1, randn(*shape, g=g) * scale, randn(*shape, g=g), dtype

    return inputs


def _normed(GatedRMSNorm, D, weight, x, z, dtype):
    norm = GatedRMSNorm(D, eps=1e-6)
    start = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.copy_(weight)
    norm = norm.to(dtype)
    with torch.no_grad():
        y = norm(x.to(dtype), z.to(dtype))
    return {"weight at the start (ones)": start, "x_hat * w * silu(z)": y}


case(
    NORM,
    "x_hat * w * silu(z), weight from ones",
    _norm_inputs(2, 3, 6),
    _normed,
    atol=1e-5,
    rtol=1e-5,
    seed=110,
)
case(
    NORM,
    "larger inputs",
    _norm_inputs(4, 16, scale=30.0),
    _normed,
    atol=1e-4,
    rtol=1e-4,
    hidden=True,
)
IN_INPUT_DTYPE = (
    "the norm was computed in the input's dtype: in bfloat16 the mean of squares and its root "
    "keep 3 significant digits; compute x_hat in float32 (x.float()) and cast the result back"
)
NOT_FLOAT32 = "the mean of squares or its root computed in another dtype than float32"


def _normed_watched(GatedRMSNorm, D, weight, x, z, dtype):
    with observe("norm_dtypes") as seen:  # made where the code runs (when graded: there)
        out = _normed(GatedRMSNorm, D, weight, x, z, dtype)
    out[NOT_FLOAT32] = any(d != torch.float32 for d in seen.value if d is not None)
    return out


case(
    NORM,
    "bfloat16 in, bfloat16 out; the mean of squares and its root in float32",
    _norm_inputs(4, 16, dtype=torch.bfloat16),
    _normed_watched,
    atol=0.1,
    rtol=0.02,
    seed=111,
)
case(
    NORM,
    "inputs of RMS 1e-3 (mean of squares 1e-6 = eps: eps inside the square root)",
    _norm_inputs(3, 8, scale=1e-3),
    _normed,
    atol=1e-4,
    rtol=1e-4,
    seed=112,
)


def _x_hat(norm, x):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)


@mistake(
    NORM,
    "the weight was used as (1 + w): that is the zero-centred norm of the decoder layers; the "
    "gated norm inside Gated DeltaNet scales by w itself",
)
class NormZeroCentred(norms.GatedRMSNorm):
    def forward(self, x, z):
        return (_x_hat(self, x) * (1 + self.weight) * F.silu(z.float())).to(x.dtype)


@mistake(NORM, "the gate is sigmoid(z): Gated DeltaNet gates with silu(z) = z·σ(z)")
class NormSigmoidGate(norms.GatedRMSNorm):
    def forward(self, x, z):
        return (_x_hat(self, x) * self.weight * torch.sigmoid(z.float())).to(x.dtype)


@mistake(NORM, "the gate was applied before the norm: normalise x, then gate")
class NormGateFirst(norms.GatedRMSNorm):
    def forward(self, x, z):
        return (_x_hat(self, x.float() * F.silu(z.float())) * self.weight).to(x.dtype)


@mistake(NORM, "eps belongs inside the square root: x / sqrt(mean(x^2) + eps)")
class NormEpsOutside(norms.GatedRMSNorm):
    def forward(self, x, z):
        xf = x.float()
        x_hat = xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)
        return (x_hat * self.weight * F.silu(z.float())).to(x.dtype)


@mistake(NORM, IN_INPUT_DTYPE)
class NormInInputDtype(norms.GatedRMSNorm):
    def forward(self, x, z):
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x_hat * self.weight * F.silu(z)


@mistake(NORM, "the result must be cast back to x's dtype (bfloat16 in, bfloat16 out)")
class NormFloat32Out(norms.GatedRMSNorm):
    def forward(self, x, z):
        return _x_hat(self, x) * self.weight.float() * F.silu(z.float())


# ================================================================================================
# The Gated DeltaNet layer in pieces, the gated attention, partial RoPE, the zero-centred norm
# ================================================================================================

register("ch05.l2norm", reference=ref.l2norm, points=1, title="L2 norm with eps inside the root")
register(
    "ch05.deltanet_gates",
    reference=ref.deltanet_gates,
    points=2,
    title="beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)",
)
register(
    "ch05.conv_qkv",
    reference=ref.conv_qkv,
    points=2,
    title="Conv, SiLU, q | k | v heads, L2-normalised q and k",
)
register(
    "ch05.GatedDeltaNet",
    reference=ref.GatedDeltaNet,
    points=3,
    title="The Gated DeltaNet layer, continuing from its cache",
)
register(
    "ch05.ZeroCentredRMSNorm",
    reference=norms.ZeroCentredRMSNorm,
    points=1,
    title="Zero-centred RMSNorm: x_hat * (1 + w)",
)
register(
    "ch05.apply_partial_rope",
    reference=rope.apply_partial_rope,
    points=1,
    title="RoPE on the first rotary_dim dims of each head",
)
register(
    "ch05.split_query_gate",
    reference=attention.split_query_gate,
    points=1,
    title="q_proj holds query and gate interleaved per head",
)
register(
    "ch05.GatedAttention",
    reference=attention.GatedAttention,
    points=3,
    title="Gated attention: sigmoid gate, partial RoPE, zero-centred q/k norms",
)

BF16 = torch.bfloat16


# --- l2norm -------------------------------------------------------------------------------------

L2 = "ch05.l2norm"


def _l2_formula(x, eps=1e-6):  # independent: a division by the square root
    x64 = x.double()
    return (x64 / torch.sqrt((x64**2).sum(-1, keepdim=True) + eps)).to(x.dtype)


case(
    L2,
    "l2norm([[3, 4]]) = [[0.6, 0.8]] (|x|^2 = 25, eps negligible)",
    lambda g: (torch.tensor([[3.0, 4.0]]),),
    expected=lambda x: torch.tensor([[0.6, 0.8]]),
    atol=1e-6,
)
case(
    L2,
    "a short vector, |x|^2 = 1e-6 = eps: x / sqrt(2e-6), eps inside the square root",
    lambda g: (torch.tensor([[6e-4, 8e-4]]),),
    expected=lambda x: x / math.sqrt(2e-6),
    atol=1e-5,
    rtol=1e-5,
)
case(
    L2,
    "random [2, 3, 8] against x / sqrt(sum(x^2) + eps)",
    lambda g: (randn(2, 3, 8, g=g),),
    expected=_l2_formula,
    atol=1e-6,
    rtol=1e-5,
    seed=200,
    variants=("bfloat16",),
)
case(
    L2,
    "eps passed in (eps = 0.5)",
    lambda g: (randn(3, 4, g=g) * 0.3, 0.5),
    expected=_l2_formula,
    atol=1e-6,
    rtol=1e-5,
    seed=201,
)
case(
    L2,
    "bfloat16 in, bfloat16 out",
    lambda g: (randn(2, 16, g=g, dtype=BF16),),
    atol=1e-2,
    rtol=1e-2,
    seed=202,
)
case(
    L2,
    "other shapes and lengths",
    lambda g: (randn(between(g, 1, 3), between(g, 1, 5), 16, g=g) * 10 ** between(g, -3, 1),),
    expected=_l2_formula,
    atol=1e-5,
    rtol=1e-4,
    hidden=True,
)


@mistake(
    L2,
    "F.normalize divides by max(|x|, eps): the kernels' l2norm is x / sqrt(sum(x^2) + eps), eps "
    "INSIDE the square root (they differ for short vectors)",
)
def l2_normalize(x, eps=1e-6):
    return F.normalize(x, dim=-1, eps=eps)


@mistake(L2, "eps was added outside the square root: x / sqrt(sum(x^2) + eps), eps inside")
def l2_eps_outside(x, eps=1e-6):
    return x / (x.pow(2).sum(-1, keepdim=True).sqrt() + eps)


@mistake(
    L2,
    "the mean of squares is an RMS norm: the L2 norm takes the SUM of squares (a unit vector, "
    "not a vector of RMS 1)",
)
def l2_mean(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@mistake(L2, "eps is an argument: use the eps passed in, not 1e-6 always")
def l2_fixed_eps(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


@mistake(L2, "the result must keep x's dtype (bfloat16 in, bfloat16 out)")
def l2_float32(x, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# --- deltanet_gates -----------------------------------------------------------------------------

GATES = "ch05.deltanet_gates"


def _gates_inputs(B=1, T=3, H=4, dtype=torch.float32, strong=False):
    def inputs(g):
        b, a = randn(B, T, H, g=g) * 2, randn(B, T, H, g=g) * 2
        A_log = randn(H, g=g) * 0.5 + (2.5 if strong else 0.0)  # exp(A_log) near 12: strong
        dt_bias = randn(H, g=g)
        return tuple(t.to(dtype) for t in (b, a, A_log, dt_bias))

    return inputs


def _gates(deltanet_gates, *arguments):
    return named(deltanet_gates(*arguments), "beta", "g")


def _gates_formula(b, a, A_log, dt_bias):  # independent: 1 / (1 + e^-b), log(1 + e^x)
    x = a.double() + dt_bias.double()
    beta = 1 / (1 + torch.exp(-b.double()))
    return {
        "beta": beta.to(b.dtype),
        "g": (-torch.exp(A_log.double()) * torch.log1p(x.exp())).float(),
    }


case(
    GATES,
    "b = 0, a = -dt_bias, A_log = ln 2: beta = 1/2, g = -2 ln 2 (exp(g) = 1/4)",
    lambda g: (
        torch.zeros(1, 2, 3),
        -torch.tensor([0.5, -1.0, 2.0]).expand(1, 2, 3).clone(),
        torch.full((3,), math.log(2)),
        torch.tensor([0.5, -1.0, 2.0]),
    ),
    _gates,
    expected=lambda *_: {
        "beta": torch.full((1, 2, 3), 0.5),
        "g": torch.full((1, 2, 3), -2 * math.log(2)),
    },
    atol=1e-6,
    rtol=1e-6,
)
case(
    GATES,
    "random b, a, A_log, dt_bias against the formula",
    _gates_inputs(B=2),
    _gates,
    _gates_formula,
    atol=1e-5,
    rtol=1e-5,
    seed=210,
    # a softplus in bfloat16 is off by up to 36 % in one chunk's decay
    variants=(bfloat16(float32=("softplus_dtypes", "softplus(a + dt_bias)")),),
)
case(
    GATES,
    "strong decays (exp(A_log) near 12): g in the tens",
    _gates_inputs(strong=True),
    _gates,
    _gates_formula,
    atol=1e-5,
    rtol=1e-5,
    seed=211,
)
case(
    GATES,
    "a bfloat16 model: beta in bfloat16, g in float32",
    _gates_inputs(dtype=BF16),
    _gates,
    atol=1e-2,
    rtol=1e-2,
    seed=212,
)
case(
    GATES,
    "other sizes",
    lambda g: _gates_inputs(between(g, 1, 3), between(g, 1, 9), between(g, 1, 8))(g),
    _gates,
    _gates_formula,
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)


def _g(a, A_log, dt_bias):
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())


@mistake(GATES, "dt_bias is missing: g = -exp(A_log) * softplus(a + dt_bias)")
def gates_no_dt_bias(b, a, A_log, dt_bias):
    return b.sigmoid(), _g(a, A_log, torch.zeros_like(dt_bias))


@mistake(
    GATES,
    "A_log is the LOG of the decay rate: multiply by exp(A_log) (> 0), not by A_log itself",
)
def gates_A_log_as_rate(b, a, A_log, dt_bias):
    return b.sigmoid(), -A_log.float() * F.softplus(a.float() + dt_bias.float())


@mistake(
    GATES,
    "g must be <= 0 (the log of a decay between 0 and 1): g = -exp(A_log) * softplus(...), with "
    "the minus sign",
)
def gates_positive(b, a, A_log, dt_bias):
    return b.sigmoid(), -_g(a, A_log, dt_bias)


@mistake(
    GATES,
    "that is exp(g), the decay factor: return g, its log (the rule takes exp itself)",
)
def gates_decay_factor(b, a, A_log, dt_bias):
    return b.sigmoid(), _g(a, A_log, dt_bias).exp()


@mistake(GATES, "softplus(x) = log(1 + e^x) is smooth: relu is not softplus")
def gates_relu(b, a, A_log, dt_bias):
    return b.sigmoid(), -A_log.float().exp() * F.relu(a.float() + dt_bias.float())


@mistake(GATES, "beta = sigmoid(b) (a writing strength between 0 and 1), from b, not from a")
def gates_swapped(b, a, A_log, dt_bias):
    return a.sigmoid(), _g(b, A_log, dt_bias)


@mistake(
    GATES,
    "g must be computed in float32 (a.float(), A_log.float()): in bfloat16 every decay moves by "
    "up to 0.4 %, and the chunk form sums and exponentiates them",
)
def gates_low_precision(b, a, A_log, dt_bias):
    return b.sigmoid(), -A_log.exp() * F.softplus(a + dt_bias)


@mistake(GATES, "beta keeps b's dtype (bfloat16 in, bfloat16 out); only g is float32")
def gates_beta_float32(b, a, A_log, dt_bias):
    return b.float().sigmoid(), _g(a, A_log, dt_bias)


# --- conv_qkv -----------------------------------------------------------------------------------

QKV = "ch05.conv_qkv"


def _qkv_inputs(B=1, T=5, n_k=2, d_k=4, n_v=2, d_v=3, K=4, empty=False, dtype=torch.float32):
    def inputs(g):
        conv_dim = 2 * n_k * d_k + n_v * d_v
        qkv, w = randn(B, T, conv_dim, g=g), randn(conv_dim, 1, K, g=g) * 0.5
        state = randn(B, conv_dim, K - 1, g=g) * (0 if empty else 1)
        return qkv.to(dtype), w.to(dtype), state.to(dtype), n_k, d_k, n_v, d_v

    return inputs


QKV_NAMES = ("q [B, T, n_k, d_k]", "k [B, T, n_k, d_k]", "v [B, T, n_v, d_v]", "new conv state")


def _qkv(conv_qkv, *arguments):
    return named(conv_qkv(*arguments), *QKV_NAMES)


def _naive_qkv(qkv, weight, conv_state, n_k, d_k, n_v, d_v):
    """Independent: the conv as a loop (_naive_conv), silu = x * sigmoid(x), slices per head."""
    conv = _naive_conv(qkv.transpose(1, 2), weight, conv_state)
    mixed = conv["y [B, C, T]"]
    mixed = (mixed * torch.sigmoid(mixed)).transpose(1, 2)  # [B, T, conv_dim]
    B, T, _ = qkv.shape
    heads = []
    for start, n, d in ((0, n_k, d_k), (n_k * d_k, n_k, d_k), (2 * n_k * d_k, n_v, d_v)):
        heads.append(
            torch.stack([mixed[..., start + h * d : start + (h + 1) * d] for h in range(n)], 2)
        )
    q, k, v = heads
    return dict(
        zip(
            QKV_NAMES,
            (_l2_formula(q.float()), _l2_formula(k.float()), v, conv["new state [B, C, K-1]"]),
            strict=True,
        )
    )


case(
    QKV,
    "from an empty conv state: 2 key heads of 4, 2 value heads of 3",
    _qkv_inputs(empty=True),
    _qkv,
    _naive_qkv,
    atol=1e-5,
    rtol=1e-5,
    seed=220,
    variants=("meta",),  # (bfloat16: a case of its own below)
)
case(
    QKV,
    "continuing from a conv state; 4 value heads share 2 key heads",
    _qkv_inputs(B=2, T=3, n_v=4, d_v=2),
    _qkv,
    _naive_qkv,
    atol=1e-5,
    rtol=1e-5,
    seed=221,
)
case(
    QKV,
    "one token (decoding), a kernel of 3",
    _qkv_inputs(T=1, K=3),
    _qkv,
    _naive_qkv,
    atol=1e-5,
    rtol=1e-5,
    seed=222,
)
case(
    QKV,
    "a bfloat16 model: q, k in float32; v and the conv state in bfloat16",
    _qkv_inputs(dtype=BF16),
    _qkv,
    atol=2e-2,
    rtol=2e-2,
    seed=223,
)
case(
    QKV,
    "other sizes",
    lambda g: _qkv_inputs(
        between(g, 1, 2), between(g, 1, 9), between(g, 1, 3), 4 * between(g, 1, 2), 3, 5, 4
    )(g),
    _qkv,
    _naive_qkv,
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)


def _qkv_variant(silu=True, silu_first=False, norm=True, order="qkv", heads_first=False,
                 state=True, wide=True, norm_v=False):  # fmt: skip
    def conv_qkv(qkv, weight, conv_state, n_k, d_k, n_v, d_v):
        B, T, _ = qkv.shape
        x = qkv.transpose(1, 2)
        x = F.silu(x) if silu_first else x
        mixed, new = ref.causal_conv1d(
            x, weight, conv_state if state else torch.zeros_like(conv_state)
        )
        mixed = (F.silu(mixed) if silu and not silu_first else mixed).transpose(1, 2)
        sizes = {"q": n_k * d_k, "k": n_k * d_k, "v": n_v * d_v}
        parts = dict(zip(order, mixed.split([sizes[c] for c in order], dim=-1), strict=True))

        def split(t, n, d):
            return t.reshape(B, T, d, n).transpose(-1, -2) if heads_first else t.reshape(B, T, n, d)

        q, k, v = (
            split(parts["q"], n_k, d_k),
            split(parts["k"], n_k, d_k),
            split(parts["v"], n_v, d_v),
        )
        if norm:
            q, k = (ref.l2norm(t.float() if wide else t) for t in (q, k))
        elif wide:
            q, k = q.float(), k.float()
        if norm_v:
            v = ref.l2norm(v)
        return q, k, v, new

    return conv_qkv


for name, flags, idea in (
    ("qkv_no_silu", dict(silu=False), "SiLU after the conv is missing: q, k, v = silu(conv(x))"),
    (
        "qkv_silu_first",
        dict(silu_first=True),
        "SiLU comes AFTER the conv: silu(conv(x)), not conv(silu(x))",
    ),
    (
        "qkv_no_l2norm",
        dict(norm=False),
        "q and k must be L2-normalised (l2norm per head): the delta rule needs unit-length keys",
    ),
    (
        "qkv_order",
        dict(order="kqv"),
        "the channels are all q heads, then all k heads, then all v heads: split in that order",
    ),
    (
        "qkv_heads_transposed",
        dict(heads_first=True),
        "each head is d consecutive channels: reshape to [B, T, n_heads, d] (head h = channels "
        "h*d .. h*d+d-1)",
    ),
    (
        "qkv_no_state",
        dict(state=False),
        "conv_state was ignored: a continuation's first outputs need the inputs of the K-1 "
        "tokens before it",
    ),
    (
        "qkv_low_precision",
        dict(wide=False),
        "q and k go to the rule in float32 (.float() before l2norm), whatever the model's dtype",
    ),
    (
        "qkv_v_normalised",
        dict(norm_v=True),
        "only q and k are L2-normalised; v is the value written, of any length",
    ),
):
    mistake(QKV, idea, name=name)(_qkv_variant(**flags))


# --- ZeroCentredRMSNorm -------------------------------------------------------------------------

ZC = "ch05.ZeroCentredRMSNorm"


def _zc_inputs(*shape, scale=1.0, dtype=torch.float32):
    def inputs(g):
        D = shape[-1]
        return D, randn(D, g=g) * 0.3, randn(*shape, g=g) * scale, dtype

    return inputs


def _zc(ZeroCentredRMSNorm, D, weight, x, dtype):
    norm = ZeroCentredRMSNorm(D, eps=1e-6)
    start = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.copy_(weight)
    norm = norm.to(dtype)
    with torch.no_grad():
        y = norm(x.to(dtype))
    return {"weight at the start (zeros: a scale of 1)": start, "x_hat * (1 + w)": y}


def _zc_bf16(ZeroCentredRMSNorm, D, weight, x, dtype):
    return _zc(ZeroCentredRMSNorm, D, weight, x, torch.bfloat16)


def _zc_formula(D, weight, x, dtype):  # independent: sqrt of the mean of squares, in float64
    x64 = x.to(dtype).double()
    y = x64 / torch.sqrt((x64**2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.to(dtype).double())
    return {
        "weight at the start (zeros: a scale of 1)": torch.zeros(D),
        "x_hat * (1 + w)": y.to(dtype),
    }


case(
    ZC,
    "x = [3, 4], w = [0, 1]: x_hat = [0.8485, 1.1314], times (1, 2)",
    lambda g: (2, torch.tensor([0.0, 1.0]), torch.tensor([[3.0, 4.0]]), torch.float32),
    _zc,
    expected=lambda *_: {
        "weight at the start (zeros: a scale of 1)": torch.zeros(2),
        "x_hat * (1 + w)": torch.tensor([[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]]),
    },
    atol=1e-5,
    rtol=1e-5,
)
case(
    ZC,
    "random, against the formula",
    _zc_inputs(2, 3, 8),
    _zc,
    _zc_formula,
    atol=1e-5,
    rtol=1e-5,
    seed=230,
    variants=(bfloat16(call=_zc_bf16, float32=("add_dtypes", "1 + w (like the whole norm)")),),
)
case(
    ZC,
    "inputs of RMS 1e-3 (mean of squares 1e-6 = eps: eps inside the square root)",
    _zc_inputs(2, 8, scale=1e-3),
    _zc,
    _zc_formula,
    atol=1e-4,
    rtol=1e-4,
    seed=231,
)


def _zc_watched(ZeroCentredRMSNorm, D, weight, x, dtype):
    with observe("norm_dtypes") as seen:  # made where the code runs (when graded: there)
        out = _zc(ZeroCentredRMSNorm, D, weight, x, dtype)
    computed = [d for d in seen.value if d is not None]
    out[NOT_FLOAT32] = any(d != torch.float32 for d in computed)
    return out


case(
    ZC,
    "bfloat16 in, bfloat16 out; the mean of squares and its root in float32",
    _zc_inputs(4, 16, dtype=BF16),
    _zc_watched,
    atol=0.05,
    rtol=0.02,
    seed=232,
)
case(
    ZC,
    "larger inputs (RMS 30)",
    _zc_inputs(3, 16, scale=30.0),
    _zc,
    _zc_formula,
    atol=1e-4,
    rtol=1e-4,
    hidden=True,
)


def _rms_hat(x, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@mistake(
    ZC,
    "the scale is (1 + w), not w: Qwen3.5 stores the offset from 1 (w starts at 0), so x_hat * w "
    "multiplies everything by a number near 0",
)
class ZeroCentredPlain(norms.ZeroCentredRMSNorm):
    def forward(self, x):
        return (_rms_hat(x, self.eps) * self.weight.float()).to(x.dtype)


@mistake(ZC, "eps belongs inside the square root: x / sqrt(mean(x^2) + eps)")
class ZeroCentredEpsOutside(norms.ZeroCentredRMSNorm):
    def forward(self, x):
        xf = x.float()
        x_hat = xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)
        return (x_hat * (1 + self.weight.float())).to(x.dtype)


@mistake(ZC, IN_INPUT_DTYPE)
class ZeroCentredInInputDtype(norms.ZeroCentredRMSNorm):
    def forward(self, x):
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x_hat * (1.0 + self.weight)


@mistake(ZC, "the result must be cast back to x's dtype (bfloat16 in, bfloat16 out)")
class ZeroCentredFloat32Out(norms.ZeroCentredRMSNorm):
    def forward(self, x):
        return _rms_hat(x, self.eps) * (1 + self.weight.float())


# --- apply_partial_rope -------------------------------------------------------------------------

PROPE = "ch05.apply_partial_rope"


def _prope_inputs(B=1, H=2, T=3, D=16, r=4, dtype=torch.float32, start=0):
    def inputs(g):
        cos, sin = rope_cos_sin(torch.arange(start, start + T), r, 10000.0, dtype)
        return randn(B, H, T, D, g=g).to(dtype), cos, sin

    return inputs


def _naive_partial_rope(x, cos, sin):
    """Independent: pair (i, i + r/2) of the first r dims turned by its angle, pair by pair."""
    r = cos.shape[-1]
    out = x.clone()
    for i in range(r // 2):
        c, s, j = cos[:, i], sin[:, i], i + r // 2
        out[..., i] = x[..., i] * c - x[..., j] * s
        out[..., j] = x[..., j] * c + x[..., i] * s
    return out


case(
    PROPE,
    "D = 16, rotary width 4: pairs (0, 2) and (1, 3) turn, dims 4..15 pass",
    _prope_inputs(),
    expected=_naive_partial_rope,
    atol=1e-5,
    rtol=1e-5,
    seed=240,
    variants=("bfloat16",),
)
case(
    PROPE,
    "rotary width = head_dim: all of RoPE",
    _prope_inputs(D=8, r=8, T=5, start=3),
    expected=_naive_partial_rope,
    atol=1e-5,
    rtol=1e-5,
    seed=241,
)
case(
    PROPE,
    "bfloat16 in, bfloat16 out",
    _prope_inputs(B=2, D=32, r=8, dtype=BF16),
    atol=2e-2,
    rtol=2e-2,
    seed=242,
)
case(
    PROPE,
    "other sizes",
    lambda g: _prope_inputs(
        between(g, 1, 2), 3, between(g, 1, 6), 32, 4 * between(g, 1, 4), start=5
    )(g),
    expected=_naive_partial_rope,
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)


@mistake(PROPE, "RoPE turns the FIRST r dims of each head (x[..., :r]); the rest pass unchanged")
def prope_last_dims(x, cos, sin):
    r = cos.shape[-1]
    return torch.cat([x[..., :-r], apply_rope(x[..., -r:], cos, sin)], dim=-1)


@mistake(PROPE, "the dims past r pass UNCHANGED: keep them, do not zero them")
def prope_rest_zeroed(x, cos, sin):
    r = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :r], cos, sin), torch.zeros_like(x[..., r:])], dim=-1)


@mistake(
    PROPE,
    "pairs are (i, i + r/2) within the rotary part (rotate_half of the first r dims), not "
    "neighbours (2i, 2i + 1)",
)
def prope_interleaved(x, cos, sin):
    r = cos.shape[-1]
    part = x[..., :r]
    pairs = torch.stack([-part[..., 1::2], part[..., 0::2]], dim=-1).flatten(-2)
    c = torch.repeat_interleave(cos[..., : r // 2], 2, dim=-1)
    s = torch.repeat_interleave(sin[..., : r // 2], 2, dim=-1)
    return torch.cat([part * c + pairs * s, x[..., r:]], dim=-1)


# --- split_query_gate ---------------------------------------------------------------------------

SPLIT = "ch05.split_query_gate"


def _split(split_query_gate, x, n_heads):
    return named(split_query_gate(x, n_heads), "q [B, T, H, D]", "gate [B, T, H, D]")


def _naive_split(x, n_heads):
    D = x.shape[-1] // n_heads // 2
    q = torch.stack([x[..., 2 * D * h : 2 * D * h + D] for h in range(n_heads)], dim=-2)
    gate = torch.stack([x[..., 2 * D * h + D : 2 * D * (h + 1)] for h in range(n_heads)], dim=-2)
    return {"q [B, T, H, D]": q, "gate [B, T, H, D]": gate}


case(
    SPLIT,
    "3 heads of 2 on 0, 1, 2, ...: head 0 is query 0, 1 and gate 2, 3",
    lambda g: (torch.arange(12.0).view(1, 1, 12), 3),
    _split,
    _naive_split,
)
case(
    SPLIT,
    "B = 2, T = 3, 4 heads of 5",
    lambda g: (randn(2, 3, 40, g=g), 4),
    _split,
    _naive_split,
    seed=250,
)
case(
    SPLIT,
    "other sizes",
    lambda g: (randn(between(g, 1, 3), between(g, 1, 4), 2 * 3 * 6, g=g), 3),
    _split,
    _naive_split,
    hidden=True,
)


@mistake(
    SPLIT,
    "the checkpoint interleaves per head (head 0's query, head 0's gate, head 1's query, ...): "
    "view as [B, T, H, 2D] and split each head, not the whole vector in halves",
)
def split_halves(x, n_heads):
    B, T, _ = x.shape
    q, gate = x.chunk(2, dim=-1)
    return q.reshape(B, T, n_heads, -1), gate.reshape(B, T, n_heads, -1)


@mistake(SPLIT, "each head holds its query FIRST, then its gate")
def split_gate_first(x, n_heads):
    q, gate = attention.split_query_gate(x, n_heads)
    return gate, q


# --- GatedAttention -----------------------------------------------------------------------------

GATT = "ch05.GatedAttention"


def _qwen35_cfg(n_heads=4, n_kv=2, head_dim=8, factor=0.5, n_k=2, n_v=2, d_k=4, d_v=4) -> Config:
    return Config(
        model_type="qwen3_5_text",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        partial_rotary_factor=factor,
        layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=n_k,
        linear_num_value_heads=n_v,
        linear_key_head_dim=d_k,
        linear_value_head_dim=d_v,
        linear_conv_kernel_dim=4,
        max_position_embeddings=128,
        rope_theta=10000.0,
    )


def _randomized(module, seed, zero_centred=()):
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=seeded(seed + p.numel()))
            p.copy_(
                noise * (0.1 if "norm" in name else 0.3) + (1.0 if name == "norm.weight" else 0)
            )
            if name == "A_log":
                p.copy_(noise.clamp(-1, 1) * 0.5 - 1.0)
    return module


def _attention_pair(GatedAttention, cfg, seed, dtype=torch.float32, on_meta=False):
    reference = _randomized(attention.GatedAttention(cfg, 1, ARCHITECTURES[cfg.model_type]), seed)
    mine = GatedAttention(cfg, 1, ARCHITECTURES[cfg.model_type])
    if on_meta:  # built with the default device set to meta: its weights to the CPU first
        mine.to_empty(device="cpu")
    mine.load_state_dict(reference.state_dict())
    return mine.to(dtype), reference.to(dtype)


def _gated_attention(GatedAttention, cfg, seed, x, pieces, dtype=torch.float32, on_meta=False):
    """The learner's layer on x with no cache, and fed in `pieces` through a KVCache.
    `on_meta`: its forward runs with the default device set to meta (as in _deltanet)."""
    _mine, _ = _attention_pair(GatedAttention, cfg, seed, dtype, on_meta)

    def mine(*args):
        with torch.device("meta") if on_meta and not graded() else nullcontext():
            return _mine(*args)

    x = x.to(dtype)
    T = x.shape[1]
    out = {}
    with torch.no_grad():
        cos, sin = rotary_cos_sin(cfg, torch.arange(T), dtype)
        out["output, no cache"] = mine(x, cos, sin)
        cache = attention.KVCache(x.shape[0], cfg.num_key_value_heads, cfg.head_dim, dtype)
        outs, start = [], 0
        for n in pieces:
            outs.append(
                mine(x[:, start : start + n], cos[start : start + n], sin[start : start + n], cache)
            )
            cache.commit(n)
            start += n
        out[f"fed in pieces {list(pieces)} through a KVCache"] = torch.cat(outs, 1)
    return out


def _attention_formula(cfg, seed, x, pieces, dtype=torch.float32):
    """Independent of the package's layer: the same weights, written out with torch's attention."""
    _, m = _attention_pair(attention.GatedAttention, cfg, seed)
    B, T, _ = x.shape
    H, H_kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    with torch.no_grad():
        qg = m.q_proj(x).view(B, T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k, v = m.k_proj(x).view(B, T, H_kv, D), m.v_proj(x).view(B, T, H_kv, D)

        def zero_centred(t, w):
            return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * (1 + w)

        q, k = zero_centred(q, m.q_norm.weight), zero_centred(k, m.k_norm.weight)
        cos, sin = rope_cos_sin(torch.arange(T), cfg.rotary_dim, cfg.rope_theta)
        q = _naive_partial_rope(q.transpose(1, 2), cos, sin)
        k = _naive_partial_rope(k.transpose(1, 2), cos, sin)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
        o = o.transpose(1, 2).reshape(B, T, H * D) * torch.sigmoid(gate.reshape(B, T, H * D))
        y = m.o_proj(o)
    return {"output, no cache": y, f"fed in pieces {list(pieces)} through a KVCache": y}


def _layer_inputs(cfg, B=1, T=6, pieces=(4, 1, 1), dtype=torch.float32):
    """(config, a weight seed, x [B, T, 16], how the prompt is fed in pieces, dtype) for a check
    of a layer built from the learner's class (the attention here, the DeltaNet layer below)."""
    return lambda g: (
        cfg,
        int(torch.randint(1000, (), generator=g)),
        randn(B, T, 16, g=g),
        pieces,
        dtype,
    )


case(
    GATT,
    "4 query heads, 2 KV heads of 8, RoPE on 4 of 8 dims: against torch's attention",
    _layer_inputs(_qwen35_cfg(), B=2),
    _gated_attention,
    _attention_formula,
    atol=1e-5,
    rtol=1e-4,
    seed=260,
    variants=(
        registered(
            lambda GatedAttention, cfg, *_: GatedAttention(cfg, 1, ARCHITECTURES[cfg.model_type]),
            what="layer",
            first=True,
        ),
    ),
)
case(
    GATT,
    "prompt of 4, then 2 tokens at once (a mask for the queries after a cache)",
    _layer_inputs(_qwen35_cfg(), T=6, pieces=(4, 2)),
    _gated_attention,
    atol=1e-5,
    rtol=1e-4,
    seed=262,
    variants=(meta(call=lambda G, *inputs: _gated_attention(G, *inputs, on_meta=True)),),
)
case(
    GATT,
    "prompt of 3, then 2 tokens, then 1 (a KVCache)",
    _layer_inputs(_qwen35_cfg(), T=6, pieces=(3, 2, 1)),
    _gated_attention,
    atol=1e-5,
    rtol=1e-4,
    seed=261,
)
case(
    GATT,
    "a bfloat16 layer: bfloat16 out",
    _layer_inputs(_qwen35_cfg(), T=4, pieces=(2, 2), dtype=BF16),
    _gated_attention,
    atol=3e-2,
    rtol=3e-2,
    seed=262,
)


def _attention_hidden(g):
    T = between(g, 3, 7)
    cfg = _qwen35_cfg(n_heads=6, n_kv=3, head_dim=16, factor=0.25)
    return _layer_inputs(cfg, B=between(g, 1, 2), T=T, pieces=(T - 2, 1, 1))(g)


case(
    GATT,
    "other heads and widths",
    _attention_hidden,
    _gated_attention,
    atol=1e-5,
    rtol=1e-4,
    hidden=True,
)


def _attention_variant(gate="sigmoid", split="per head", norm_after_rope=False, k_norm=True):
    class Variant(attention.GatedAttention):
        def forward(self, x, cos, sin, cache=None):
            B, T, _ = x.shape
            if split == "per head":
                q, g = attention.split_query_gate(self.q_proj(x), self.n_heads)
            else:
                q, g = (t.reshape(B, T, self.n_heads, -1) for t in self.q_proj(x).chunk(2, -1))
            q = q.transpose(1, 2)
            k = attention.split_heads(self.k_proj(x), self.n_kv_heads)
            v = attention.split_heads(self.v_proj(x), self.n_kv_heads)
            if not norm_after_rope:
                q, k = self.q_norm(q), self.k_norm(k) if k_norm else k
            q, k = rope.apply_partial_rope(q, cos, sin), rope.apply_partial_rope(k, cos, sin)
            if norm_after_rope:
                q, k = self.q_norm(q), self.k_norm(k)
            out = attention.merge_heads(self.attend(q, k, v, cache))
            g = g.reshape(B, T, -1)
            if gate == "sigmoid":
                out = out * torch.sigmoid(g)
            elif gate == "silu":
                out = out * F.silu(g)
            return self.o_proj(out)

    return Variant


for name, flags, idea in (
    (
        "attention_no_gate",
        dict(gate=None),
        "the output gate is missing: multiply the merged heads by sigmoid(gate) before o_proj",
    ),
    ("attention_silu_gate", dict(gate="silu"), "the output gate is sigmoid(gate), not silu"),
    (
        "attention_halves",
        dict(split="halves"),
        "q_proj interleaves query and gate per head: split each head's 2D outputs "
        "(split_query_gate), not the whole output in halves",
    ),
    (
        "attention_norm_after_rope",
        dict(norm_after_rope=True),
        "order of QK-Norm and RoPE: normalise the heads first, then rotate",
    ),
    ("attention_no_k_norm", dict(k_norm=False), "the keys need their norm too (self.k_norm)"),
):
    mistake(GATT, idea, name=name)(_attention_variant(**flags))


# --- GatedDeltaNet ------------------------------------------------------------------------------

LAYER = "ch05.GatedDeltaNet"


def _deltanet_pair(GatedDeltaNet, cfg, seed, dtype=torch.float32, on_meta=False):
    reference = _randomized(ref.GatedDeltaNet(cfg, 0), seed)
    mine = GatedDeltaNet(cfg, 0)
    if on_meta:  # built with the default device set to meta: its weights to the CPU first
        mine.to_empty(device="cpu")
    mine.load_state_dict(reference.state_dict())
    return mine.to(dtype), reference.to(dtype)


def _deltanet(GatedDeltaNet, cfg, seed, x, pieces, dtype=torch.float32, on_meta=False):
    """The learner's layer on x with no cache, then fed in `pieces` through a DeltaNetState:
    the outputs and the states it leaves. `on_meta`: its forward runs with the default device
    set to meta (the meta variant; when graded, the sandbox sets it around every call)."""
    mine, _ = _deltanet_pair(GatedDeltaNet, cfg, seed, dtype, on_meta)
    x = x.to(dtype)
    out = {}

    def run(*args, **kwargs):
        with torch.device("meta") if on_meta and not graded() else nullcontext():
            return mine(*args, **kwargs)

    with torch.no_grad():
        out["output, no cache"] = run(x)
        # the checks' own state object (the package's), as chapter 1's checks pass a KVCache
        state = ref.DeltaNetState(
            x.shape[0], cfg.linear_num_key_heads * cfg.linear_key_head_dim * 2
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
            cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
            dtype, "cpu",
        )  # fmt: skip
        outs, start = [], 0
        for n in pieces:
            outs.append(run(x[:, start : start + n], cache=state))
            state.commit(n)
            start += n
        out[f"fed in pieces {list(pieces)}: outputs"] = torch.cat(outs, 1)
        out["conv state after the pieces (cache.update)"] = state.conv
        out["recurrent state after the pieces (cache.update)"] = state.recurrent
    return out


def _deltanet_formula(cfg, seed, x, pieces, dtype=torch.float32):
    """Independent of the package's layer: the same weights, one token at a time through a
    naive conv, the gate formulas and the recurrent step, the gated norm written out."""
    _, m = _deltanet_pair(ref.GatedDeltaNet, cfg, seed)
    B, T, _ = x.shape
    n_k, d_k, n_v, d_v = m.n_k, m.d_k, m.n_v, m.d_v
    with torch.no_grad():
        conv_state = torch.zeros(B, m.conv_dim, m.kernel_size - 1)
        heads = _naive_qkv(m.in_proj_qkv(x), m.conv1d.weight, conv_state, n_k, d_k, n_v, d_v)
        q, k, v, conv = (heads[n] for n in QKV_NAMES)
        gates = _gates_formula(m.in_proj_b(x), m.in_proj_a(x), m.A_log, m.dt_bias)
        ratio = n_v // n_k
        S = torch.zeros(B, n_v, d_k, d_v)
        outs = []
        for t in range(T):
            step = (
                q[:, t].repeat_interleave(ratio, 1) * d_k**-0.5,
                k[:, t].repeat_interleave(ratio, 1),
                v[:, t],
                gates["g"][:, t],
                gates["beta"][:, t],
            )
            o, S = ref.recurrent_step(S, *step)
            outs.append(o)
        o = torch.stack(outs, 1)  # [B, T, H_v, d_v]
        z = m.in_proj_z(x).view(B, T, n_v, d_v)
        o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * m.norm.weight
        y = m.out_proj((o * z * torch.sigmoid(z)).reshape(B, T, -1))
    return {
        "output, no cache": y,
        f"fed in pieces {list(pieces)}: outputs": y,
        "conv state after the pieces (cache.update)": conv,
        "recurrent state after the pieces (cache.update)": S,
    }


_LAYER_REGISTERED = registered(
    lambda GatedDeltaNet, cfg, *_: GatedDeltaNet(cfg, 0), what="layer", first=True
)
case(
    LAYER,
    "2 key heads, 2 value heads, prompt of 3 then 1 token then 2: against a token-by-token loop",
    _layer_inputs(_qwen35_cfg(), B=2, pieces=(3, 1, 2)),
    _deltanet,
    _deltanet_formula,
    atol=1e-5,
    rtol=1e-4,
    seed=270,
    # meta: what its forward makes (the zero conv state of a prompt) on its input's device
    variants=(
        _LAYER_REGISTERED,
        meta(call=lambda G, *inputs: _deltanet(G, *inputs, on_meta=True)),
    ),
)
case(
    LAYER,
    "4 value heads share 2 key heads; pieces of 2, 1, 1, 3",
    _layer_inputs(_qwen35_cfg(n_v=4, d_v=3), T=7, pieces=(2, 1, 1, 3)),
    _deltanet,
    atol=1e-5,
    rtol=1e-4,
    seed=271,
)
case(
    LAYER,
    "a bfloat16 layer: bfloat16 out, the recurrent state in float32",
    _layer_inputs(_qwen35_cfg(), T=4, pieces=(2, 1, 1), dtype=BF16),
    _deltanet,
    atol=3e-2,
    rtol=3e-2,
    seed=272,
)


def _deltanet_hidden(g):
    T = between(g, 66, 70)  # past one chunk of 64
    cfg = _qwen35_cfg(n_k=1, n_v=3, d_k=8, d_v=4)
    return _layer_inputs(cfg, T=T, pieces=(T - 3, 1, 2))(g)


case(
    LAYER,
    "past a chunk, 3 value heads per key head",
    _deltanet_hidden,
    _deltanet,
    atol=1e-4,
    rtol=1e-3,
    hidden=True,
)


def _deltanet_variant(
    restart=False, decode_from_zero=False, conv_zeros=False, no_update=False, no_norm=False
):
    class Variant(ref.GatedDeltaNet):
        def forward(self, x, cos=None, sin=None, cache=None):
            B, T, _ = x.shape
            qkv, z, b, a = self.project(x)
            zeros = qkv.new_zeros(B, self.conv_dim, self.kernel_size - 1)
            conv_state = cache.conv if cache is not None and not conv_zeros else zeros
            state = cache.recurrent if cache is not None else None
            if (restart and T > 1) or (decode_from_zero and T == 1):
                state = None
            heads = (self.n_k, self.d_k, self.n_v, self.d_v)
            q, k, v, new_conv = ref.conv_qkv(qkv, self.conv1d.weight, conv_state, *heads)
            beta, g = self.gates(b, a)
            decoding = cache is not None and T == 1
            rule = ref.recurrent_gated_delta_rule if decoding else ref.chunk_gated_delta_rule
            out, new_state = rule(q, k, v, g, beta, initial_state=state)
            if cache is not None and not no_update:
                cache.update(new_conv, new_state)
            if no_norm:
                return self.out_proj(out.to(x.dtype).reshape(B, T, -1))
            out = self.norm(out.to(x.dtype), z.reshape(B, T, self.n_v, self.d_v))
            return self.out_proj(out.reshape(B, T, -1))

    return Variant


for name, flags, idea in (
    (
        "deltanet_restart",
        dict(restart=True),
        "a piece of several tokens after a cache restarted from an empty state: the chunk form "
        "must start from the cached state (initial_state=cache.recurrent)",
    ),
    (
        "deltanet_decode_from_zero",
        dict(decode_from_zero=True),
        "decoding one token ignored the cached state: the recurrent step continues from "
        "cache.recurrent",
    ),
    (
        "deltanet_conv_zeros",
        dict(conv_zeros=True),
        "the conv started from zeros after a cache: continue from cache.conv (the inputs of the "
        "K-1 tokens before)",
    ),
    (
        "deltanet_no_update",
        dict(no_update=True),
        "the new states were not given to the cache: cache.update(new_conv_state, new_state)",
    ),
    (
        "deltanet_no_norm",
        dict(no_norm=True),
        "the gated norm is missing: self.norm(out, z) per value head, then out_proj",
    ),
):
    mistake(LAYER, idea, name=name)(_deltanet_variant(**flags))
