# Generated from solutions/ch05_deltanet.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""The gated delta rule (recurrent and chunkwise), its causal convolution, the state it keeps and
Qwen3.5's Gated DeltaNet mixer.

The gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", 2024) keeps one matrix per value head, the state S [d_k, d_v], and for every token

    S  <- exp(g) * S                        decay (gating): forget a fraction of everything
    u   = beta * (v - S^T k)                 delta rule: the part of v the state does not predict
    S  <- S + k u^T                          write that correction under key k
    o   = S^T q                              read with the query

Layout of every function here: q, k [B, T, H_k, d_k]; v [B, T, H_v, d_v]; g, beta [B, T, H_v];
state [B, H_v, d_k, d_v] in float32. Value head j reads key head j // (H_v / H_k) (interleaved).
q is scaled by d_k^-0.5 inside; q and k are expected L2-normalised (`l2norm`) by the caller.
"""

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.config import Config
from qwen_mini.norms import GatedRMSNorm


def expand_key_heads(x: torch.Tensor, n_value_heads: int) -> torch.Tensor:
    """[B, T, H_k, d] -> [B, T, H_v, d]: value head j gets key head j // (H_v / H_k)."""
    ratio = n_value_heads // x.shape[2]
    return x.repeat_interleave(ratio, dim=2)  # heads 0,0,1,1,...: neighbours share a key head


def recurrent_step(S, q, k, v, g, beta):
    """One token of the gated delta rule for every (batch, head): returns (o, S_new).

    S [B, H, d_k, d_v]; q, k [B, H, d_k]; v [B, H, d_v]; g, beta [B, H] (all float32).
    """
    S = S * g.exp()[..., None, None]  # decay first: the old memory fades by exp(g) <= 1
    predicted = (k[..., None, :] @ S).squeeze(-2)  # [B, H, d_v]: what S recalls for key k
    u = beta[..., None] * (v - predicted)  # delta rule: write only the error, scaled by beta
    S = S + k[..., :, None] * u[..., None, :]  # rank-one write k u^T
    o = (q[..., None, :] @ S).squeeze(-2)  # [B, H, d_v]: read after the write
    return o, S


def _check_shapes(q, k, v, g, beta, initial_state):
    """Clear errors for the mistakes a caller makes most (transposed layouts, wrong head counts)."""
    B, T, H_k, d_k = k.shape
    H_v, d_v = v.shape[2], v.shape[3]
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    if v.shape[:2] != (B, T) or H_v % H_k:
        raise ValueError(
            f"v {tuple(v.shape)} must be [B, T, H_v, d_v] with H_v a multiple of H_k = {H_k}"
        )
    if g.shape != (B, T, H_v) or beta.shape != (B, T, H_v):
        raise ValueError(
            f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [B, T, H_v] = {(B, T, H_v)}"
        )
    if initial_state is not None and initial_state.shape != (B, H_v, d_k, d_v):
        raise ValueError(
            f"initial_state {tuple(initial_state.shape)} must be [B, H_v, d_k, d_v] = "
            f"{(B, H_v, d_k, d_v)}"
        )


def _heads_first(q, k, v, g, beta, scale):
    """Float32 (float64 stays float64), key heads expanded, heads before time: [B, H_v, T, d]
    and [B, H_v, T]."""
    H_v = v.shape[2]
    if q.shape[2] != H_v:  # (with as many key heads as value heads there is nothing to copy)
        q, k = expand_key_heads(q, H_v), expand_key_heads(k, H_v)
    wide = torch.promote_types(v.dtype, torch.float32)  # bfloat16 -> float32
    # contiguous once here, rather than a hidden copy in every later reshape and product
    q, k, v, g, beta = (x.transpose(1, 2).to(wide).contiguous() for x in (q, k, v, g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def _start_state(initial_state, q, v) -> torch.Tensor:
    """The state before the first token: the given one (as float32), or zeros (empty memory)."""
    if initial_state is None:
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])  # [B, H, d_k, d_v]
    return initial_state.to(q.dtype)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token: (output [B, T, H_v, d_v], final state fp32).

    One step per token, each a few small matrix-vector products: the form used to decode.
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    B, T, H_v, d_v = v.shape
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale)  # [B, H_v, T, ...]
    S = _start_state(initial_state, q, v)
    out = q.new_empty(B, H_v, T, d_v)
    for t in range(T):
        step = (x[:, :, t] for x in (q, k, v, g, beta))
        out[:, :, t], S = recurrent_step(S, *step)
    return out.transpose(1, 2).to(dtype), S


def decay_mask(g_cum: torch.Tensor) -> torch.Tensor:
    """[..., C] cumulative log-decay -> [..., C, C]: exp(g_cum[t] - g_cum[s]) for s <= t, else 0.

    Entry (t, s) is how much of what token s wrote is left when token t reads. Taken from the
    difference of the cumulative sums, which is <= 0 where it is kept: exp never overflows. The
    ratio exp(g_cum[t]) / exp(g_cum[s]) is the same number on paper but divides 0 by 0 (NaN)
    once the decays are strong, and the masked-out upper triangle would be exp(+large) = inf.
    """
    diff = g_cum[..., :, None] - g_cum[..., None, :]  # [..., C, C]: t down, s across
    C = g_cum.shape[-1]
    future = torch.ones(C, C, dtype=torch.bool, device=g_cum.device).triu(1)  # s > t
    return diff.masked_fill(future, float("-inf")).exp()  # exp(-inf) = 0: no contribution


def solve_unit_lower(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """X with (I + A) X = rhs, A [..., C, C] strictly lower triangular, rhs [..., C, n].

    Forward substitution, as the delta rule runs: row t is rhs[t] minus what earlier rows
    already explain, X[t] = rhs[t] - sum_{s<t} A[t, s] X[s]. torch's triangular solver does
    exactly that, with the unit diagonal assumed.
    """
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)


def pad_to_chunks(x: torch.Tensor, chunk_size: int, dim: int) -> torch.Tensor:
    """Zeros appended along `dim` up to a multiple of chunk_size.

    Zeros are a no-op token: g = 0 leaves the state undecayed, beta = 0 and k = 0 write nothing,
    so the final state is that of the real tokens.
    """
    pad = -x.shape[dim] % chunk_size
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def chunk_loop(U0, W, scores, q_decayed, k_to_end, chunk_decay, S):
    """The sequential part of the chunk form: (out [B, H, N, C, d_v], final state).

    Per chunk n (index [:, :, n]): U0, W [B, H, N, C, d_v | d_k]; scores [B, H, N, C, C];
    q_decayed, k_to_end [B, H, N, C, d_k]; chunk_decay [B, H, N, 1, 1]; S [B, H, d_k, d_v] is
    the state entering the first chunk.
    """
    out = torch.empty_like(U0)  # [B, H, N, C, d_v]
    for n in range(U0.shape[2]):  # the only sequential part: N = T / C steps instead of T
        U = U0[:, :, n] - W[:, :, n] @ S  # [B, H, C, d_v]: minus what S already predicts
        out[:, :, n] = q_decayed[:, :, n] @ S + scores[:, :, n] @ U  # S's part + the chunk's
        S = chunk_decay[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ U  # pass it on
    return out, S


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule, chunk by chunk: (output [B, T, H_v, d_v], final state fp32).

    Inside a chunk of C tokens, with G the cumulative log-decay from the chunk start and S0 the
    state entering the chunk, unrolling the recurrence gives

        (I + A) U = beta*V - beta*exp(G)*K S0,   A[t, s] = beta_t exp(G_t - G_s) k_t.k_s, s < t
        O  = exp(G) * Q S0 + (Q K^T * M) U,      M[t, s] = exp(G_t - G_s), s <= t
        S1 = exp(G_C) S0 + (exp(G_C - G) * K)^T U

    All chunks' matrices are computed at once; only the state passes from chunk to chunk.
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    B, T, H_v, d_v = v.shape
    C, dtype = chunk_size, v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale)  # [B, H, T, ...]
    q, k, v = (pad_to_chunks(x, C, dim=2) for x in (q, k, v))
    g, beta = (pad_to_chunks(x, C, dim=2) for x in (g, beta))
    N = q.shape[2] // C
    q, k, v = (x.reshape(B, H_v, N, C, x.shape[-1]) for x in (q, k, v))  # [B, H, N, C, d]
    g, beta = g.reshape(B, H_v, N, C), beta.reshape(B, H_v, N, C)

    # [B, H, N, C]: log of the decay from the chunk start to each token. Summed in float64: with
    # strong decays it reaches thousands, where float32 keeps 3 decimals, and the difference of
    # two neighbouring sums would lose the small decay between them.
    G = g.double().cumsum(-1)
    M = decay_mask(G).to(q.dtype)  # [B, H, N, C, C]
    decay_in = G.exp().to(q.dtype)[..., None]  # [B, H, N, C, 1]: from the chunk start to t
    decay_out = (G[..., -1:] - G).exp().to(q.dtype)[..., None]  # from t to the chunk's end
    chunk_decay = G[..., -1].exp().to(q.dtype)[..., None, None]  # [B, H, N, 1, 1]

    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)).mul_(M).tril_(-1)  # [B, H, N, C, C], strictly lower
    # (I + A)^-1 once per chunk (the identity as right-hand side), then two batched products:
    # U0, the writes if every chunk started at S0 = 0, and W, how S0 changes them
    # (U = U0 - W S0). On a CPU this is faster than solving for the d_v + d_k columns directly.
    eye = torch.eye(C, dtype=A.dtype, device=A.device).expand(A.shape).clone()
    A_inv = solve_unit_lower(A, eye)  # [B, H, N, C, C]
    U0 = A_inv @ (v * beta[..., None])  # [B, H, N, C, d_v]
    W = A_inv @ (k_beta * decay_in)  # [B, H, N, C, d_k]
    scores = (q @ k.transpose(-1, -2)).mul_(M)  # [B, H, N, C, C]: causal, decayed
    q_decayed = q * decay_in  # reads S0 through the decay since the chunk start
    k_to_end = k * decay_out  # writes, decayed to the chunk's end

    S0 = _start_state(initial_state, q, v)
    out, S = chunk_loop(U0, W, scores, q_decayed, k_to_end, chunk_decay, S0)
    out = out.reshape(B, H_v, N * C, d_v)[:, :, :T]
    return out.transpose(1, 2).to(dtype), S


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution that continues from a state.

    x [B, C, T] new inputs; weight [C, 1, K] (one K-tap filter per channel); conv_state
    [B, C, K-1] the inputs of the K-1 tokens before x (zeros at the start of a sequence).
    Returns (y [B, C, T], new state [B, C, K-1] = the last K-1 inputs seen).
    """
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # [B, C, K-1+T]: history, then x
    y = F.conv1d(full, weight, groups=x.shape[1])  # no padding: output t sees inputs t..t+K-1
    return y, full[:, :, full.shape[-1] - conv_state.shape[-1] :]


def deltanet_gates(
    b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta, g) [B, T, H_v] from b, a [B, T, H_v] and the per-head weights A_log, dt_bias [H_v].

    beta = sigmoid(b), in b's dtype: how much of the error each token writes (0..1).
    g = -exp(A_log) * softplus(a + dt_bias), in float32: the log-decay, < 0.
    """
    beta = b.sigmoid()
    # both factors are positive, so g < 0: exp(g) in (0, 1) is the fraction of the state kept
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return beta, g


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the convention of the released kernels)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def conv_qkv(
    qkv: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    n_k: int,
    d_k: int,
    n_v: int,
    d_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """in_proj_qkv's output [B, T, 2 n_k d_k + n_v d_v] -> (q, k [B, T, n_k, d_k] float32, unit
    length; v [B, T, n_v, d_v] in qkv's dtype; the new conv state [B, conv_dim, K-1]).

    Causal conv over time (continuing from conv_state), SiLU, split into q | k | v heads.
    """
    B, T, _ = qkv.shape
    mixed, new_state = causal_conv1d(qkv.transpose(1, 2), weight, conv_state)  # [B, C, T]
    mixed = F.silu(mixed).transpose(1, 2)  # [B, T, conv_dim]
    q, k, v = mixed.split([n_k * d_k, n_k * d_k, n_v * d_v], dim=-1)
    q = l2norm(q.reshape(B, T, n_k, d_k).float())  # unit length, in float32
    k = l2norm(k.reshape(B, T, n_k, d_k).float())
    return q, k, v.reshape(B, T, n_v, d_v), new_state


class DeltaNetState:
    """One Gated DeltaNet layer's memory of every token seen: a fixed size, whatever the length.

    conv [B, conv_dim, K-1]: the last K-1 inputs of the causal conv (model dtype).
    recurrent [B, H_v, d_k, d_v]: the delta-rule state (float32).
    `update` only stages the new states; `commit` makes them current, `discard` drops them, so
    a pass that fails half-way leaves the memory of the tokens before it (qwen_mini/cache.py).
    """

    can_rewind = False  # every token is folded into one matrix: no going back to a prefix

    def __init__(self, batch_size, conv_dim, kernel_size, n_heads, d_k, d_v, dtype, device):
        self.conv = torch.zeros(batch_size, conv_dim, kernel_size - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            batch_size, n_heads, d_k, d_v, dtype=torch.float32, device=device
        )
        self.length = 0  # tokens committed
        self.staged_conv = self.staged_recurrent = None  # what update staged, until commit

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Stage the states after this pass (new tensors; the current ones stay as they are)."""
        self.staged_conv, self.staged_recurrent = conv, recurrent.float()

    def commit(self, n_tokens: int) -> None:
        """The pass over n_tokens finished in every layer: its states become the current ones."""
        if self.staged_conv is not None:
            self.conv, self.recurrent = self.staged_conv, self.staged_recurrent
            self.staged_conv = self.staged_recurrent = None
        self.length += n_tokens

    def discard(self) -> None:
        self.staged_conv = self.staged_recurrent = None

    def truncate(self, n: int) -> None:
        if n != self.length:
            raise ValueError(
                f"a Gated DeltaNet state cannot be truncated to {n} tokens: it holds a summary "
                f"of all {self.length} tokens, not the tokens themselves. Start a new cache and "
                f"feed the first {n} tokens again."
            )

    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer. Names follow the checkpoint: `linear_attn.in_proj_qkv`...

    x -> in_proj_qkv -> causal conv1d -> SiLU -> q | k | v heads; q, k L2-normalised;
    beta = sigmoid(in_proj_b x); g = -exp(A_log) * softplus(in_proj_a x + dt_bias);
    gated delta rule -> GatedRMSNorm(., z = in_proj_z x) -> out_proj.
    """

    # the config fields it is built from, which a config must set (> 0) for such layers
    config_fields = (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
    )

    def __init__(self, cfg: Config, layer_idx: int = 0, arch=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.d_k, self.d_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel_size = cfg.linear_conv_kernel_dim
        key_dim, value_dim = self.n_k * self.d_k, self.n_v * self.d_v
        self.conv_dim = 2 * key_dim + value_dim  # q, k and v pass through one convolution
        hidden = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_dim, bias=False)  # the output gate
        self.in_proj_b = nn.Linear(hidden, self.n_v, bias=False)  # beta, per value head
        self.in_proj_a = nn.Linear(hidden, self.n_v, bias=False)  # decay input, per value head
        # depthwise: one filter of K taps per channel (weight [conv_dim, 1, K], no bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.kernel_size,
            groups=self.conv_dim,
            padding=self.kernel_size - 1,
            bias=False,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.d_v, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)

    def new_state(self, batch_size: int, dtype: torch.dtype, device=None) -> DeltaNetState:
        shape = (self.conv_dim, self.kernel_size, self.n_v, self.d_k, self.d_v)
        return DeltaNetState(batch_size, *shape, dtype, device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, hidden] -> the four input projections: qkv [B, T, conv_dim] (all q, all k,
        all v), z [B, T, H_v * d_v], b and a [B, T, H_v]. A layer that stores them another way
        (Qwen3-Next: fused, grouped per key head) overrides only this."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(beta, g) [B, T, H_v] with this layer's A_log and dt_bias."""
        return deltanet_gates(b, a, self.A_log, self.dt_bias)

    def forward(self, x, cos=None, sin=None, cache: DeltaNetState | None = None):
        """x [B, T, hidden] -> [B, T, hidden]. cos, sin are unused (no positions: order comes
        from the recurrence and the convolution). With a cache, continue from its states and
        stage the new ones."""
        B, T, _ = x.shape
        qkv, z, b, a = self.project(x)
        if cache is not None:  # continue from what the cache has seen
            conv_state, state = cache.conv, cache.recurrent
        else:  # no history: zero inputs before token 0, an empty memory
            conv_state, state = qkv.new_zeros(B, self.conv_dim, self.kernel_size - 1), None
        heads = (self.n_k, self.d_k, self.n_v, self.d_v)
        q, k, v, new_conv = conv_qkv(qkv, self.conv1d.weight, conv_state, *heads)
        beta, g = self.gates(b, a)
        # decoding one token: a step of the recurrence; a prompt or a piece of one: chunks
        decoding = cache is not None and T == 1
        rule = recurrent_gated_delta_rule if decoding else chunk_gated_delta_rule
        out, new_state = rule(q, k, v, g, beta, initial_state=state)
        if cache is not None:
            cache.update(new_conv, new_state)  # staged: the model commits after every layer
        z = z.reshape(B, T, self.n_v, self.d_v)
        out = self.norm(out.to(x.dtype), z)  # [B, T, H_v, d_v]: per value head, gated by z
        return self.out_proj(out.reshape(B, T, -1))
