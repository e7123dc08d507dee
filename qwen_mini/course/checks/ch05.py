"""Checks for chapter 5 (Gated DeltaNet: the recurrent step, the decay mask, the triangular
solve, the chunk loop with state passing, the causal conv state, the gated norm).

Each exercise is a list of cases and a catalogue of typical mistakes whose ideas the messages name.
Expected values come from hand-worked examples, from naive loops written here (one token at a
time), from `torch.linalg.solve`, from the recurrent form of the rule, and from the package's
reference.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from qwen_mini import deltanet as ref
from qwen_mini import norms
from qwen_mini.course.checking import between, case, mistake, named, randn, register

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


case(PAD, "pad_to_chunks(ones [2, 3, 5], 4, dim=1)", lambda g: (torch.ones(2, 3, 5), 4, 1), _pad)
case(PAD, "a whole number of chunks is left as it is", lambda g: (torch.ones(2, 3, 5), 3, 1), _pad)
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
    return {"y [B, C, T]": y, "new state [B, C, K-1]": full[..., -(K - 1) :]}


def _conv_hidden(g):
    return _conv_inputs(between(g, 1, 3), between(g, 1, 6), between(g, 1, 12), between(g, 2, 5))(g)


case(
    CONV,
    "from an empty state: y[t] sees inputs t-K+1 .. t",
    _conv_inputs(1, 3, 6, 4, empty=True),
    _conv,
    _naive_conv,
    atol=1e-5,
    seed=90,
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
for n in range(2):
    case(CONV, f"other kernels {n + 1}", _conv_hidden, _conv, _naive_conv, atol=1e-5, hidden=True)


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
case(
    NORM,
    "bfloat16: the dtype follows x",
    _norm_inputs(4, 16, dtype=torch.bfloat16),
    _normed,
    atol=0.1,
    rtol=0.02,
    hidden=True,
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
