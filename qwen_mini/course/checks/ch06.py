"""Checks for chapter 6 (the rest of the family: the fused-projection permutation, the sparse
attention's block scores and selection, the read and write gates of the residual streams, the
n-gram shift with its reset after eos, the n-gram table's memory).

Expected values come from naive loops written here (row by row, query by query, position by
position), from hand-worked examples and from the package's reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from qwen_mini import fused_deltanet, ngram_embedding, sparse_attention, streams
from qwen_mini.architectures import config_from_dict
from qwen_mini.course.checking import between, mistake, randn, register
from qwen_mini.course.experiments.ch06 import TINY_CONFIGS
from qwen_mini.course.lab import ch06 as lab
from qwen_mini.course.variants import case

register(
    "ch06.fused_projection_order",
    reference=fused_deltanet.fused_projection_order,
    points=2,
    title="Qwen3-Next's fused projections: a permutation of Qwen3.5's",
)
register(
    "ch06.index_scores",
    reference=sparse_attention.index_scores,
    points=1,
    title="Block scores: sum over heads of relu(q . k) / sqrt(d)",
)
register(
    "ch06.select_blocks",
    reference=sparse_attention.select_blocks,
    points=2,
    title="Keep the top blocks a query sees, and its tail",
)
register(
    "ch06.read_gate",
    reference=streams.read_gate,
    points=1,
    title="The read gate: streams mixed into one input",
)
register(
    "ch06.write_gate",
    reference=streams.write_gate,
    points=1,
    title="The write gate: the output added to each stream",
)
register(
    "ch06.shift_within_segment",
    reference=ngram_embedding.shift_within_segment,
    points=1,
    title="n-grams never cross an eos",
)
register(
    "ch06.ngram_memory",
    reference=lab.ngram_memory,
    points=1,
    title="The n-gram tables' memory and the bytes a token reads",
)


# --- fused_projection_order ---------------------------------------------------------------------

ORDER = "ch06.fused_projection_order"


def naive_order(n_k, d_k, n_v, d_v):
    """Row by row: per key head g, q_g, k_g, then v and z of its r value heads; then b_g, a_g."""
    r, K, V = n_v // n_k, n_k * d_k, n_v * d_v
    rows = []
    for g in range(n_k):
        rows += [g * d_k + i for i in range(d_k)]
        rows += [K + g * d_k + i for i in range(d_k)]
        rows += [2 * K + (g * r + j) * d_v + i for j in range(r) for i in range(d_v)]
        rows += [2 * K + V + (g * r + j) * d_v + i for j in range(r) for i in range(d_v)]
    for g in range(n_k):
        rows += [2 * K + 2 * V + g * r + j for j in range(r)]
        rows += [2 * K + 2 * V + n_v + g * r + j for j in range(r)]
    return torch.tensor(rows, dtype=torch.int64)


case(
    ORDER,
    "2 key heads of 8, 6 value heads of 4 (r = 3)",
    lambda g: (2, 8, 6, 4),
    expected=naive_order,
)
case(
    ORDER,
    "3 key heads of 2, 6 value heads of 3 (r = 2)",
    lambda g: (3, 2, 6, 3),
    expected=naive_order,
)
case(
    ORDER,
    "other head counts",
    lambda g: (between(g, 2, 4), 2 * between(g, 1, 3), 0, 0),
    lambda f, n_k, d_k, _a, _b: f(n_k, d_k, n_k * (n_k % 3 + 1), d_k + 1),
    expected=lambda n_k, d_k, _a, _b: naive_order(n_k, d_k, n_k * (n_k % 3 + 1), d_k + 1),
    hidden=True,
)


@mistake(
    ORDER,
    "the rows are in Qwen3.5's order: Qwen3-Next groups them per key head, q_g k_g "
    "v_g z_g for each head g (and b_g a_g), so the order is a permutation, not arange",
)
def order_unfused(n_k, d_k, n_v, d_v):
    return torch.arange(2 * n_k * d_k + 2 * n_v * d_v + 2 * n_v)


@mistake(
    ORDER,
    "this is the inverse permutation: order[i] must be the Qwen3.5 row that fused "
    "row i is (fused = unfused[order]), not where Qwen3.5's row i goes",
)
def order_inverse(n_k, d_k, n_v, d_v):
    return fused_deltanet.fused_projection_order(n_k, d_k, n_v, d_v).argsort()


@mistake(
    ORDER,
    "b and a are interleaved per value head (b_j a_j): in_proj_ba holds, per key "
    "head, the r betas of its value heads, then their r decays (b_g | a_g)",
)
def order_ba_per_value_head(n_k, d_k, n_v, d_v):
    order = fused_deltanet.fused_projection_order(n_k, d_k, n_v, d_v)
    qkvz, base = order[: -2 * n_v], 2 * n_k * d_k + 2 * n_v * d_v
    ba = torch.tensor([base + w * n_v + j for j in range(n_v) for w in range(2)])
    return torch.cat([qkvz, ba])


@mistake(
    ORDER,
    "in_proj_ba is not grouped: like qkvz, it is grouped per key head, b_0 a_0 | "
    "b_1 a_1 | ..., each with the r value heads of that key head",
)
def order_ba_not_grouped(n_k, d_k, n_v, d_v):
    order = fused_deltanet.fused_projection_order(n_k, d_k, n_v, d_v)
    base = 2 * n_k * d_k + 2 * n_v * d_v
    return torch.cat([order[: -2 * n_v], torch.arange(base, base + 2 * n_v)])


@mistake(ORDER, "z comes before v: each group of in_proj_qkvz is q_g | k_g | v_g | z_g")
def order_z_before_v(n_k, d_k, n_v, d_v):
    r, K, V = n_v // n_k, n_k * d_k, n_v * d_v
    order = fused_deltanet.fused_projection_order(n_k, d_k, n_v, d_v)
    groups = order[: 2 * K + 2 * V].view(n_k, -1)
    q_k, v, z = groups.split([2 * d_k, r * d_v, r * d_v], dim=1)
    return torch.cat([torch.cat([q_k, z, v], 1).flatten(), order[2 * K + 2 * V :]])


@mistake(
    ORDER,
    "key head g's value heads were taken strided (g, g + n_k, ...): it serves the r "
    "consecutive value heads g r .. g r + r - 1, and its group holds their v, then their z",
)
def order_value_heads_strided(n_k, d_k, n_v, d_v):
    r, K, V = n_v // n_k, n_k * d_k, n_v * d_v
    heads = torch.arange(n_v).view(r, n_k).T  # [n_k, r]: g, g + n_k, ... (the mistake)

    def rows(start, width):  # [n_k, r * width]: the rows of each key head's value heads
        return (start + heads[..., None] * width + torch.arange(width)).flatten(1)

    q = torch.arange(K).view(n_k, d_k)
    qkvz = torch.cat([q, K + q, rows(2 * K, d_v), rows(2 * K + V, d_v)], dim=1).flatten()
    ba = torch.cat([rows(2 * K + 2 * V, 1), rows(2 * K + 2 * V + n_v, 1)], dim=1).flatten()
    return torch.cat([qkvz, ba])


# --- index_scores -------------------------------------------------------------------------------

SCORES = "ch06.index_scores"


def naive_scores(q, keys):
    B, h, T, d = q.shape
    out = torch.zeros(B, T, keys.shape[1])
    for b in range(B):
        for t in range(T):
            for n in range(keys.shape[1]):
                for head in range(h):
                    dot = float((q[b, head, t].double() * keys[b, n].double()).sum())
                    out[b, t, n] += max(dot, 0.0) / math.sqrt(d)
    return out


def _score_inputs(B=1, h=3, T=4, n=5, d=8, dtype=torch.float32):
    return lambda g: (randn(B, h, T, d, g=g, dtype=dtype), randn(B, n, d, g=g, dtype=dtype))


case(
    SCORES,
    "3 heads, 4 queries, 5 blocks of d = 8",
    _score_inputs(),
    expected=naive_scores,
    atol=1e-5,
    rtol=1e-5,
    variants=("meta",),
)
case(
    SCORES,
    "bfloat16 inputs: float32 scores",
    _score_inputs(B=2, dtype=torch.bfloat16),
    expected=naive_scores,
    atol=1e-4,
    rtol=1e-4,
    seed=1,
)
case(
    SCORES,
    "no complete block yet (n = 0): scores [B, T, 0]",
    _score_inputs(n=0),
    expected=naive_scores,
)
case(
    SCORES,
    "other sizes",
    lambda g: _score_inputs(
        between(g, 1, 2), between(g, 1, 4), between(g, 1, 5), between(g, 1, 6), 4 * between(g, 1, 4)
    )(g),
    expected=naive_scores,
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)


@mistake(
    SCORES,
    "relu after the sum over heads: each head's dot goes through relu first, so "
    "a head that dislikes a block cannot cancel one that likes it",
)
def scores_relu_after_sum(q, keys):
    dots = q.float() @ keys.float()[:, None].transpose(-1, -2)
    return dots.sum(dim=1).relu() / math.sqrt(q.shape[-1])


@mistake(SCORES, "the scores are not divided by sqrt(d), the index head size")
def scores_no_scale(q, keys):
    return sparse_attention.index_scores(q, keys) * math.sqrt(q.shape[-1])


@mistake(SCORES, "the heads are averaged: the score is their sum, divided by sqrt(d) only")
def scores_mean_over_heads(q, keys):
    return sparse_attention.index_scores(q, keys) / q.shape[1]


@mistake(
    SCORES,
    "the scores are in the inputs' dtype: compute them in float32, whatever q "
    "and keys are (bf16 would round near-equal blocks into ties)",
)
def scores_input_dtype(q, keys):
    dots = q @ keys[:, None].transpose(-1, -2)
    return dots.relu().sum(dim=1) / math.sqrt(q.shape[-1])


# --- select_blocks ------------------------------------------------------------------------------

SELECT = "ch06.select_blocks"


def naive_select(scores, t_all, ratio, top_blocks):
    B, T, n = scores.shape
    keep = torch.zeros(B, T, t_all, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            t = t_all - T + i
            complete = (t + 1) // ratio
            seen = sorted(range(complete), key=lambda j: -float(scores[b, i, j]))
            for j in seen[: min(top_blocks, complete)]:
                keep[b, i, j * ratio : (j + 1) * ratio] = True
            keep[b, i, complete * ratio : t + 1] = True
    return keep


def _select_inputs(B, T, t_all, ratio, top):
    return lambda g: (torch.rand(B, T, t_all // ratio, generator=g), t_all, ratio, top)


case(
    SELECT,
    "a prompt of 18 tokens, blocks of 3, top 2",
    _select_inputs(2, 18, 18, 3, 2),
    expected=naive_select,
    variants=("meta",),
)
case(
    SELECT,
    "decoding: 1 new query after 22 cached, blocks of 4, top 3",
    _select_inputs(2, 1, 23, 4, 3),
    expected=naive_select,
    seed=1,
)
case(
    SELECT,
    "a piece of 5 queries after 11 cached, blocks of 2, top 4",
    _select_inputs(1, 5, 16, 2, 4),
    expected=naive_select,
    seed=2,
)
case(SELECT, "top 0: the tail only", _select_inputs(1, 9, 9, 2, 0), expected=naive_select)
case(
    SELECT,
    "a prompt shorter than the budget: 7 tokens, blocks of 2 (3 complete), top 5",
    _select_inputs(2, 7, 7, 2, 5),
    expected=naive_select,
    seed=3,
)
case(
    SELECT,
    "decoding when the context holds fewer blocks than top_blocks",
    lambda g: _select_inputs(1, 1, between(g, 1, 12), between(g, 2, 4), between(g, 4, 8))(g),
    expected=naive_select,
    hidden=True,
)
case(
    SELECT,
    "a prompt of 3 tokens, blocks of 4: no complete block (n = 0), the tail only",
    _select_inputs(2, 3, 3, 4, 2),
    expected=naive_select,
)
case(
    SELECT,
    "other sizes",
    lambda g: _select_inputs(
        between(g, 1, 2), between(g, 1, 6), between(g, 6, 20), between(g, 2, 4), between(g, 1, 4)
    )(g),
    expected=naive_select,
    hidden=True,
)


@mistake(
    SELECT,
    "the tail is missing: a query also reads every token after its last complete "
    "block, up to itself (its own token included)",
)
def select_no_tail(scores, t_all, ratio, top_blocks):
    keep = sparse_attention.select_blocks(scores, t_all, ratio, top_blocks)
    q_pos = torch.arange(t_all - scores.shape[1], t_all)[:, None]
    tail = torch.arange(t_all) >= (q_pos + 1) // ratio * ratio
    return keep & ~tail


@mistake(
    SELECT,
    "a block the query cannot see completely was chosen: only its complete blocks "
    "((t + 1) // ratio of them) compete; mask the others before top-k",
)
def select_unseen_blocks(scores, t_all, ratio, top_blocks):
    B, T, n = scores.shape
    q_pos = torch.arange(t_all - T, t_all)[:, None]
    complete = (q_pos + 1) // ratio
    chosen = torch.zeros(B, T, n, dtype=torch.bool)
    if min(top_blocks, n):
        chosen = chosen.scatter(-1, scores.topk(min(top_blocks, n), dim=-1).indices, True)
    k_pos = torch.arange(t_all)
    keep = ((k_pos >= complete * ratio) & (k_pos <= q_pos)).expand(B, T, t_all)
    block_of = (k_pos // ratio).clamp(max=max(n - 1, 0))
    return keep | (chosen[..., block_of] & (k_pos < n * ratio) & (k_pos <= q_pos))


@mistake(
    SELECT,
    "the tail reaches past the query: a query reads its tail only up to itself "
    "(nothing after position t, ever)",
)
def select_tail_not_causal(scores, t_all, ratio, top_blocks):
    keep = sparse_attention.select_blocks(scores, t_all, ratio, top_blocks)
    q_pos = torch.arange(t_all - scores.shape[1], t_all)[:, None]
    return keep | (torch.arange(t_all) >= (q_pos + 1) // ratio * ratio)


@mistake(SELECT, "the lowest-scoring blocks were kept: keep the top scores")
def select_lowest(scores, t_all, ratio, top_blocks):
    return sparse_attention.select_blocks(-scores, t_all, ratio, top_blocks)


@mistake(
    SELECT,
    "a block that ends at the query is not counted as complete: a query at t sees "
    "(t + 1) // ratio complete blocks (t // ratio misses the one it closes)",
)
def select_complete_off_by_one(scores, t_all, ratio, top_blocks):
    B, T, n = scores.shape
    keep = torch.zeros(B, T, t_all, dtype=torch.bool)
    for i in range(T):  # each query as if one position earlier closed its blocks
        t = t_all - T + i
        sub = sparse_attention.select_blocks(scores[:, i : i + 1], t, ratio, top_blocks)
        keep[:, i, :t] = sub[:, 0]
        keep[:, i, t] = True
    return keep


@mistake(
    SELECT,
    "the queries were placed at 0 .. T-1: they are the LAST T of t_all positions "
    "(after the cached ones)",
)
def select_queries_from_zero(scores, t_all, ratio, top_blocks):
    B, T, n = scores.shape
    q_pos = torch.arange(T)[:, None]  # the mistake: the queries' positions are t_all - T ..
    complete = (q_pos + 1) // ratio
    seen = torch.arange(n) < complete
    chosen = torch.zeros(B, T, n, dtype=torch.bool)
    if min(top_blocks, n) > 0:
        top = scores.masked_fill(~seen, float("-inf")).topk(min(top_blocks, n), dim=-1).indices
        chosen = chosen.scatter(-1, top, True) & seen
    k_pos = torch.arange(t_all)
    keep = ((k_pos >= complete * ratio) & (k_pos <= q_pos)).expand(B, T, t_all)
    if n:
        keep = keep | (chosen[..., (k_pos // ratio).clamp(max=n - 1)] & (k_pos < n * ratio))
    return keep


@mistake(
    SELECT,
    "top_blocks is a budget, not a count that exists: a context shorter than the budget has "
    "fewer blocks, so keep min(top_blocks, n) of them (topk(k) needs k <= n)",
)
def select_uncapped(scores, t_all, ratio, top_blocks):
    B, T, n = scores.shape
    q_pos = torch.arange(t_all - T, t_all)[:, None]
    complete = (q_pos + 1) // ratio
    seen = torch.arange(n) < complete
    chosen = torch.zeros(B, T, n, dtype=torch.bool)
    if top_blocks > 0:  # the mistake: topk of more blocks than there are
        top = scores.masked_fill(~seen, float("-inf")).topk(top_blocks, dim=-1).indices
        chosen = chosen.scatter(-1, top, True) & seen
    k_pos = torch.arange(t_all)
    keep = ((k_pos >= complete * ratio) & (k_pos <= q_pos)).expand(B, T, t_all)
    if n:
        keep = keep | (chosen[..., (k_pos // ratio).clamp(max=n - 1)] & (k_pos < n * ratio))
    return keep


# --- read_gate / write_gate ---------------------------------------------------------------------

READ, WRITE = "ch06.read_gate", "ch06.write_gate"


def _read_inputs(B=2, T=3, n=2, H=4, r=3, dtype=torch.float32):
    def inputs(g):
        h_hat = randn(B, T, n, H, g=g, dtype=dtype)
        return h_hat, randn(r, n * H, g=g, dtype=dtype), randn(n * H, r, g=g, dtype=dtype)

    return inputs


def naive_read(h_hat, w_down, w_up):
    B, T, n, H = h_hat.shape
    out = torch.zeros(B, T, H, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            flat = h_hat[b, t].double().flatten()
            low = F.silu(w_down.double() @ flat / n)
            gate = torch.sigmoid(w_up.double() @ low).view(n, H)
            out[b, t] = (gate * h_hat[b, t].double()).sum(0) / n
    return out.to(h_hat.dtype)


case(
    READ,
    "2 streams of 4, rank 3",
    _read_inputs(),
    expected=naive_read,
    atol=1e-5,
    rtol=1e-5,
    variants=("meta",),
)
case(
    READ,
    "3 streams of 2, rank 1",
    _read_inputs(1, 2, 3, 2, 1),
    expected=naive_read,
    atol=1e-5,
    rtol=1e-5,
    seed=1,
)
case(
    READ,
    "bfloat16 in, bfloat16 out",
    _read_inputs(dtype=torch.bfloat16),
    atol=2e-2,
    rtol=2e-2,
    seed=2,
)
case(
    READ,
    "other sizes",
    lambda g: _read_inputs(
        between(g, 1, 2), between(g, 1, 3), between(g, 2, 4), between(g, 1, 5), between(g, 1, 4)
    )(g),
    expected=naive_read,
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)


@mistake(
    READ,
    "the gate's input is not divided by n, the number of streams (it keeps the "
    "gate's input one stream's size)",
)
def read_no_divide(h_hat, w_down, w_up):
    return streams.read_gate(h_hat, w_down * h_hat.shape[-2], w_up)


@mistake(READ, "the streams were summed: x is their MEAN, (1/n) sum_s gate_s * h_hat_s")
def read_sum(h_hat, w_down, w_up):
    return streams.read_gate(h_hat, w_down, w_up) * h_hat.shape[-2]


@mistake(READ, "no sigmoid on the gate: sigmoid(w_up ...) keeps each channel's weight in 0..1")
def read_no_sigmoid(h_hat, w_down, w_up):
    n = h_hat.shape[-2]
    gate = F.linear(F.silu(F.linear(h_hat.flatten(-2), w_down) / n), w_up).view_as(h_hat)
    return (gate * h_hat).mean(dim=-2)


@mistake(READ, "no silu between the two projections: the gate is sigmoid(w_up silu(w_down x/n))")
def read_no_silu(h_hat, w_down, w_up):
    n = h_hat.shape[-2]
    gate = torch.sigmoid(F.linear(F.linear(h_hat.flatten(-2), w_down) / n, w_up))
    return (gate.view_as(h_hat) * h_hat).mean(dim=-2)


@mistake(
    READ,
    "the gate was laid out channel-major: its n*H outputs are stream by stream, "
    "view them as [n, H] (as the streams are flattened)",
)
def read_gate_transposed(h_hat, w_down, w_up):
    n, H = h_hat.shape[-2:]
    gate = torch.sigmoid(F.linear(F.silu(F.linear(h_hat.flatten(-2), w_down) / n), w_up))
    gate = gate.view(*h_hat.shape[:-2], H, n).transpose(-1, -2)
    return (gate * h_hat).mean(dim=-2)


def _write_inputs(B=2, T=3, n=3, H=4, dtype=torch.float32):
    def inputs(g):
        h = randn(B, T, n, H, g=g, dtype=dtype)
        h_hat = randn(B, T, n, H, g=g, dtype=dtype)
        return h, h_hat, randn(B, T, H, g=g, dtype=dtype), randn(n, n * H, g=g, dtype=dtype)

    return inputs


def naive_write(h, h_hat, y, w_inject):
    B, T, n, H = h.shape
    out = h.double().clone()
    for b in range(B):
        for t in range(T):
            weight = 2 * torch.sigmoid(w_inject.double() @ h_hat[b, t].double().flatten() / n)
            for s in range(n):
                out[b, t, s] += weight[s] * y[b, t].double()
    return out.to(h.dtype)


case(
    WRITE,
    "3 streams of 4",
    _write_inputs(),
    expected=naive_write,
    atol=1e-5,
    rtol=1e-5,
    variants=("meta",),
)
case(
    WRITE,
    "2 streams of 6",
    _write_inputs(1, 2, 2, 6),
    expected=naive_write,
    atol=1e-5,
    rtol=1e-5,
    seed=1,
)
case(
    WRITE,
    "bfloat16 in, bfloat16 out",
    _write_inputs(dtype=torch.bfloat16),
    atol=3e-2,
    rtol=2e-2,
    seed=2,
)
case(
    WRITE,
    "other sizes",
    lambda g: _write_inputs(between(g, 1, 2), between(g, 1, 3), between(g, 2, 4), between(g, 1, 5))(
        g
    ),
    expected=naive_write,
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)


@mistake(
    WRITE,
    "the write weight is sigmoid(.), in 0..1: it is 2 sigmoid(.), in 0..2, so a "
    "zero gate (weight 1) is the plain residual",
)
def write_no_two(h, h_hat, y, w_inject):
    return h + (streams.write_gate(h, h_hat, y, w_inject) - h) / 2


@mistake(WRITE, "the gate's input is not divided by n, the number of streams")
def write_no_divide(h, h_hat, y, w_inject):
    return streams.write_gate(h, h_hat, y, w_inject * h.shape[-2])


@mistake(
    WRITE,
    "the output was added with weight 1 to every stream: each stream has its own "
    "weight, 2 sigmoid(w_inject h_hat / n)",
)
def write_unweighted(h, h_hat, y, w_inject):
    return h + y[..., None, :]


@mistake(
    WRITE,
    "the output was added to the normalised streams: add it to the streams h "
    "themselves (h_hat only decides the weights)",
)
def write_to_h_hat(h, h_hat, y, w_inject):
    return streams.write_gate(h_hat, h_hat, y, w_inject)


@mistake(
    WRITE,
    "the weights were computed from the raw streams: they come from the normalised ones, h_hat",
)
def write_weight_from_h(h, h_hat, y, w_inject):
    return streams.write_gate(h, h, y, w_inject)


# --- shift_within_segment -----------------------------------------------------------------------

SHIFT = "ch06.shift_within_segment"
EOS = 3


def naive_shift(tokens, shift, eos):
    out = []
    for row in tokens.tolist():
        out.append(
            [
                eos if eos in row[t - shift + 1 : t] else row[t - shift]
                for t in range(shift, len(row))
            ]
        )
    return torch.tensor(out, dtype=tokens.dtype).view(tokens.shape[0], -1)


SENTENCE = torch.tensor([[7, 8, 3, 9, 10, 11, 3, 12], [3, 5, 6, 3, 3, 8, 9, 10]])
case(SHIFT, "one back, eos inside", lambda g: (SENTENCE, 1, EOS), expected=naive_shift)
case(
    SHIFT,
    "two back: reset after eos",
    lambda g: (SENTENCE, 2, EOS),
    expected=naive_shift,
    variants=("meta",),
)
case(SHIFT, "three back", lambda g: (SENTENCE, 3, EOS), expected=naive_shift)
case(
    SHIFT,
    "other sequences",
    lambda g: (
        torch.randint(0, 6, (between(g, 1, 3), between(g, 5, 12)), generator=g),
        between(g, 1, 4),
        EOS,
    ),
    expected=naive_shift,
    hidden=True,
)


@mistake(
    SHIFT,
    "no reset: the n-gram reached back across an eos into the previous text; "
    "where an eos lies between, the token reads as eos",
)
def shift_no_reset(tokens, shift, eos):
    return tokens[:, : tokens.shape[1] - shift]


@mistake(
    SHIFT,
    "an eos at t itself reset its n-gram: only the tokens strictly BETWEEN t - shift "
    "and t count (the n-gram ending at an eos still sees what came before)",
)
def shift_reset_at_current(tokens, shift, eos):
    out = ngram_embedding.shift_within_segment(tokens, shift, eos)
    return out.masked_fill(tokens[:, shift:] == eos, eos)


@mistake(
    SHIFT,
    "only the token next to t was checked for eos: every token strictly between "
    "t - shift and t must be",
)
def shift_checks_neighbour_only(tokens, shift, eos):
    L = tokens.shape[1]
    back = tokens[:, : L - shift]
    if shift < 2:
        return back
    return back.masked_fill(tokens[:, shift - 1 : L - 1] == eos, eos)


@mistake(
    SHIFT,
    "the reset filled 0: a token across a document boundary reads as eos (the "
    "token every document starts after)",
)
def shift_fill_zero(tokens, shift, eos):
    out = ngram_embedding.shift_within_segment(tokens, shift, eos)
    crossed = (out == eos) & (tokens[:, : tokens.shape[1] - shift] != eos)
    return out.masked_fill(crossed, 0)


# --- ngram_memory -------------------------------------------------------------------------------

MEMORY = "ch06.ngram_memory"


def _primes(start, count):
    found, n = [], max(start, 2)
    while len(found) < count:
        if all(n % p for p in range(2, int(n**0.5) + 1)):
            found.append(n)
        n += 1
    return found


def naive_memory(cfg, bytes_per_value):
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    primes = _primes(cfg.ngram_vocab_size_base, heads * len(cfg.ple_layer_ids))
    width, d = cfg.ple_embed_dim // heads, cfg.make_ngram_vocab_size_divisible_by
    table = 0
    for i in range(len(cfg.ple_layer_ids)):
        rows = sum(primes[i * heads : (i + 1) * heads])
        table += math.ceil(rows / d) * d * width
    return table * bytes_per_value, len(cfg.ple_layer_ids) * heads * width * bytes_per_value


def _ngram_cfg(**fields):
    return config_from_dict(dict(TINY_CONFIGS["qwen4_exp_text"], **fields))


case(
    MEMORY,
    "n-gram tables on layers 1 and 3, bf16",
    lambda g: (_ngram_cfg(ple_layer_ids=[1, 3]), 2),
    expected=naive_memory,
)
case(
    MEMORY,
    "rows padded to a multiple of 64, float32",
    lambda g: (
        _ngram_cfg(
            ple_layer_ids=[2, 1],
            make_ngram_vocab_size_divisible_by=64,
            ngram_vocab_size_base=200,
            heads_per_ngram=3,
            ple_embed_dim=12,
        ),
        4,
    ),
    expected=naive_memory,
)
case(
    MEMORY,
    "other tables",
    lambda g: (
        _ngram_cfg(
            ple_layer_ids=[1, 2, 3][: between(g, 1, 3)],
            ngram_size=between(g, 2, 4),
            heads_per_ngram=1,
            ple_embed_dim=6,
            ngram_vocab_size_base=between(g, 30, 300),
        ),
        between(g, 1, 4),
    ),
    expected=naive_memory,
    hidden=True,
)


def _memory(
    cfg, bytes_per_value, *, pad=True, layers=None, width=None, heads_read=None, same=False
):
    table, read = 0, 0
    count = len(cfg.ple_layer_ids) if layers is None else layers
    for i in range(count):
        sizes = ngram_embedding.head_table_sizes(cfg, 0 if same else i)
        d = cfg.make_ngram_vocab_size_divisible_by
        rows = -(-sum(sizes) // d) * d if pad else sum(sizes)
        w = cfg.ple_embed_dim // len(sizes) if width is None else width
        table += rows * w
        read += (len(sizes) if heads_read is None else heads_read(cfg)) * w
    return table * bytes_per_value, read * bytes_per_value


@mistake(
    MEMORY,
    "the rows were not padded: each table is stored padded up to a multiple of "
    "make_ngram_vocab_size_divisible_by",
)
def memory_no_padding(cfg, bytes_per_value):
    return _memory(cfg, bytes_per_value, pad=False)


@mistake(MEMORY, "one table counted: every layer in ple_layer_ids has a table of its own")
def memory_one_layer(cfg, bytes_per_value):
    return _memory(cfg, bytes_per_value, layers=1)


@mistake(
    MEMORY,
    "each row was counted ple_embed_dim wide: a row is one head's share, "
    "ple_embed_dim / heads (the heads' rows are concatenated into the embedding)",
)
def memory_full_width_rows(cfg, bytes_per_value):
    return _memory(cfg, bytes_per_value, width=cfg.ple_embed_dim)


@mistake(
    MEMORY,
    "a token reads one row per n-gram order: it reads one per hash HEAD, "
    "heads_per_ngram of them per order",
)
def memory_one_row_per_order(cfg, bytes_per_value):
    return _memory(cfg, bytes_per_value, heads_read=lambda c: c.ngram_size - 1)


@mistake(
    MEMORY,
    "every layer got the first layer's primes: the layers take consecutive primes "
    "(head_table_sizes(cfg, i) for the layer's place i)",
)
def memory_same_primes(cfg, bytes_per_value):
    return _memory(cfg, bytes_per_value, same=True)


@mistake(MEMORY, "bytes_per_value was ignored: the answer is in bytes, values times their size")
def memory_values_not_bytes(cfg, bytes_per_value):
    return _memory(cfg, 1)
