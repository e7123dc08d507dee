"""Checks for chapter 2 (QKV bias against QK-Norm, attention-logit statistics, precision).

Every check tests the object it is given on small seeded inputs. Expected values come from
properties worked out by hand (a rotation keeps dot products, RMSNorm with unit weight gives every
head vector the norm √D, a softmax row of equal logits is uniform), from independent computations
(torch's fused attention on the learner's queries and keys, row-by-row loops) and from the package
reference. Where an answer matches a typical mistake, the message names the mistake.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from qwen_mini.architectures import ARCHITECTURES
from qwen_mini.attention import Attention, merge_heads, repeat_kv, split_heads
from qwen_mini.config import Config
from qwen_mini.course.checking import (
    expect_close,
    expect_equal,
    hidden,
    public,
    randn,
    register,
    seeded,
)
from qwen_mini.course.lab import ch02 as lab
from qwen_mini.model import CausalLM
from qwen_mini.rope import apply_rope, rope_cos_sin

register(
    "ch02.bias_logit_terms",
    reference=lab.bias_logit_terms,
    points=1,
    title="The four terms of a biased query-key product",
)
register(
    "ch02.rope_bias_term",
    reference=lab.rope_bias_term,
    points=1,
    title="The bias-bias term after RoPE depends on the distance",
)
register(
    "ch02.project_qk",
    reference=lab.project_qk,
    points=2,
    title="Queries and keys of a layer: bias or per-head QK-Norm, before RoPE",
)
register(
    "ch02.logit_stats",
    reference=lab.logit_stats,
    points=2,
    title="Largest attention logit and attention entropy per head",
)
register(
    "ch02.distinct_weights",
    reference=lab.distinct_weights,
    points=1,
    title="Distinct attention weights in float32 and bfloat16",
)
register(
    "ch02.remove_qk_norm",
    reference=lab.remove_qk_norm,
    points=1,
    title="Remove QK-Norm from a model",
)


# --- bias_logit_terms ----------------------------------------------------------------------------

TERMS = ("content", "query_bias", "key_bias", "bias_bias")


def _terms(fn, T_q, T_k, D, seed):
    qx, kx = randn(T_q, D, seed=seed), randn(T_k, D, seed=seed + 1)
    b_q, b_k = randn(D, seed=seed + 2), randn(D, seed=seed + 3)
    got = fn(qx, kx, b_q, b_k)
    if not isinstance(got, dict) or set(got) != set(TERMS):
        keys = sorted(got) if isinstance(got, dict) else type(got).__name__
        raise AssertionError(f"expected a dict with the keys {list(TERMS)}, got {keys}")
    return qx, kx, b_q, b_k, got


def _check_terms(fn, T_q, T_k, D, seed):
    qx, kx, b_q, b_k, got = _terms(fn, T_q, T_k, D, seed)
    for name in TERMS:
        expect_equal(f"{name} shape", tuple(got[name].shape), (T_q, T_k))
    whole = (qx + b_q) @ (kx + b_k).T  # [T_q, T_k], computed here without any expansion
    total = sum(got[name] for name in TERMS)
    if torch.allclose(total * math.sqrt(D), whole, atol=1e-3, rtol=1e-4):
        raise AssertionError("the terms are divided by √D: return them unscaled")
    expect_close(
        "the four terms add up to (W_q x_i + b_q)·(W_k x_j + b_k)",
        total,
        whole,
        atol=1e-4,
        rtol=1e-4,
    )
    expect_close("content = W_q x_i · W_k x_j", got["content"], qx @ kx.T, atol=1e-4, rtol=1e-4)
    if torch.allclose(got["query_bias"], (kx @ b_q)[None, :].expand(T_q, T_k), atol=1e-4):
        raise AssertionError(
            "query_bias and key_bias are swapped: query_bias = W_q x_i·b_k has one value per "
            "query (the same in every column), key_bias = b_q·W_k x_j one value per key"
        )
    qb = got["query_bias"]
    if not torch.allclose(qb, qb[:, :1].expand_as(qb), atol=1e-5):
        raise AssertionError(
            "query_bias = W_q x_i·b_k does not depend on the key: every column must be equal"
        )
    expect_close("query_bias = W_q x_i·b_k", qb[:, 0], qx @ b_k, atol=1e-4, rtol=1e-4)
    expect_close("key_bias = b_q·W_k x_j", got["key_bias"][0], kx @ b_q, atol=1e-4, rtol=1e-4)
    expect_close(
        "bias_bias = b_q·b_k (one number)",
        got["bias_bias"],
        (b_q @ b_k).expand(T_q, T_k),
        atol=1e-4,
        rtol=1e-4,
    )


@public("ch02.bias_logit_terms")
def _(bias_logit_terms):
    _check_terms(bias_logit_terms, 3, 5, 8, seed=0)


@hidden("ch02.bias_logit_terms")
def _(bias_logit_terms):
    for T_q, T_k, D, seed in [(1, 7, 16, 10), (6, 2, 4, 11), (4, 4, 64, 12)]:
        _check_terms(bias_logit_terms, T_q, T_k, D, seed)


# --- rope_bias_term ------------------------------------------------------------------------------


def _check_rope_bias(fn, T, D, theta, seed):
    b_q, b_k = randn(D, seed=seed), randn(D, seed=seed + 1)
    cos, sin = rope_cos_sin(torch.arange(T), D, theta)
    got = fn(b_q, b_k, cos, sin)
    expect_equal("shape", tuple(got.shape), (T, T))
    if torch.allclose(got, (b_q @ b_k).expand(T, T), atol=1e-4):
        raise AssertionError(
            "every entry equals b_q·b_k, as without RoPE: rotate b_q to the query's position i "
            "and b_k to the key's position j (apply_rope with each position's cos, sin)"
        )
    expect_close(
        "diagonal (same position: a common rotation keeps the dot product b_q·b_k)",
        got.diagonal(),
        (b_q @ b_k).expand(T),
        atol=1e-4,
        rtol=1e-4,
    )
    # R_i b_q · R_j b_k = b_q · R_(j-i) b_k: the same along every diagonal
    expect_close(
        "entry (i, j) depends on j - i only: (i + 1, j + 1) equals (i, j)",
        got[1:, 1:],
        got[:-1, :-1],
        atol=1e-3,
        rtol=1e-3,
    )
    # an independent value: b_q · (b_k rotated by the angle of distance j - i)
    offsets = torch.arange(T)
    cos_d, sin_d = rope_cos_sin(offsets, D, theta)
    row0 = (apply_rope(b_k.expand(T, D), cos_d, sin_d) @ b_q).float()  # (0, j) = b_q·R_j b_k
    expect_close("row 0: b_q · (b_k rotated to position j)", got[0], row0, atol=1e-3, rtol=1e-3)


@public("ch02.rope_bias_term")
def _(rope_bias_term):
    _check_rope_bias(rope_bias_term, 6, 8, 10000.0, seed=0)


@hidden("ch02.rope_bias_term")
def _(rope_bias_term):
    for T, D, theta, seed in [(9, 16, 10000.0, 20), (5, 4, 100.0, 21), (12, 32, 1e6, 22)]:
        _check_rope_bias(rope_bias_term, T, D, theta, seed)


# --- project_qk ----------------------------------------------------------------------------------


def _attn(model_type: str, hidden=16, heads=4, kv_heads=2, head_dim=8, seed=0) -> Attention:
    """A random attention layer; QK-Norm weights far from 1 so that their order shows."""
    cfg = Config(
        model_type=model_type,
        vocab_size=16,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=64,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    attn = Attention(cfg, 0, ARCHITECTURES[model_type])  # qwen2: QKV bias; qwen3: QK-Norm
    g = seeded(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.8 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return attn


def _variants(attn, x, cos, sin) -> dict:
    """What typical mistakes return, to name the mistake when an answer matches one."""
    q_lin, k_lin = attn.q_proj(x), attn.k_proj(x)
    H, H_kv = attn.n_heads, attn.n_kv_heads
    out = {}
    rope = lambda t: apply_rope(t, cos, sin)  # noqa: E731
    if attn.q_proj.bias is not None:
        q0 = split_heads(F.linear(x, attn.q_proj.weight), H)
        k0 = split_heads(F.linear(x, attn.k_proj.weight), H_kv)
        out["the projections' bias is missing (q_proj(x) includes it)"] = (rope(q0), rope(k0))
    if attn.q_norm is not None:
        q, k = split_heads(q_lin, H), split_heads(k_lin, H_kv)

        def all_heads(t, norm, n):  # RMS over every head at once, then the per-head weight
            rms = t.pow(2).mean(-1, keepdim=True).add(norm.eps).rsqrt()
            return split_heads(t * rms, n) * norm.weight

        rope = lambda t: apply_rope(t, cos, sin)  # noqa: E731
        out["QK-Norm is applied over all heads at once; it normalises each head's head_dim"] = (
            rope(all_heads(q_lin, attn.q_norm, H)),
            rope(all_heads(k_lin, attn.k_norm, H_kv)),
        )
        out["RoPE comes before QK-Norm here; Qwen3 normalises first, then rotates"] = (
            attn.q_norm(rope(q)),
            attn.k_norm(rope(k)),
        )
        out["QK-Norm is missing (q_norm, k_norm come after the projection)"] = (rope(q), rope(k))
        out["RoPE is missing: rotate q and k after the norm"] = (attn.q_norm(q), attn.k_norm(k))
    return out


def _check_project(fn, model_type, B, T, seed, **sizes):
    attn = _attn(model_type, seed=seed, **sizes)
    x = randn(B, T, attn.q_proj.in_features, seed=seed + 1)
    cos, sin = rope_cos_sin(torch.arange(T), attn.head_dim, 10000.0)
    with torch.no_grad():
        got = fn(attn, x, cos, sin)
        if not (isinstance(got, tuple | list) and len(got) == 2):
            raise AssertionError("expected a pair (q, k)")
        q, k = got
        expect_equal("q shape [B, H, T, D]", tuple(q.shape), (B, attn.n_heads, T, attn.head_dim))
        expect_equal(
            "k shape [B, H_kv, T, D]", tuple(k.shape), (B, attn.n_kv_heads, T, attn.head_dim)
        )
        want_q, want_k = lab.project_qk(attn, x, cos, sin)
        ok = torch.allclose(q, want_q, atol=1e-4, rtol=1e-4)
        ok = ok and torch.allclose(k, want_k, atol=1e-4, rtol=1e-4)
        if not ok:
            for idea, (vq, vk) in _variants(attn, x, cos, sin).items():
                if torch.allclose(q, vq, atol=1e-4) and torch.allclose(k, vk, atol=1e-4):
                    raise AssertionError(idea)
        # independent: the layer's own forward, recomputed from these q, k with torch's kernel
        v = repeat_kv(split_heads(attn.v_proj(x), attn.n_kv_heads), attn.n_heads // attn.n_kv_heads)
        k_rep = repeat_kv(k, attn.n_heads // attn.n_kv_heads)
        out = attn.o_proj(merge_heads(F.scaled_dot_product_attention(q, k_rep, v, is_causal=True)))
        expect_close(
            f"the {model_type} layer's output computed from your q, k",
            out,
            attn(x, cos, sin),
            atol=1e-4,
            rtol=1e-4,
        )
        expect_close("q", q, want_q, atol=1e-4, rtol=1e-4)
        expect_close("k", k, want_k, atol=1e-4, rtol=1e-4)


@public("ch02.project_qk")
def _(project_qk):
    """Qwen3 layer: per-head QK-Norm, then RoPE"""
    _check_project(project_qk, "qwen3", 2, 5, seed=0)


@public("ch02.project_qk")
def _(project_qk):
    """Qwen3 layer with unit norm weights: every head vector has norm √D"""
    attn = _attn("qwen3", seed=1)
    with torch.no_grad():
        attn.q_norm.weight.fill_(1.0)
        attn.k_norm.weight.fill_(1.0)
        x = randn(1, 4, 16, seed=2) * 10
        cos, sin = rope_cos_sin(torch.arange(4), 8, 10000.0)
        q, k = project_qk(attn, x, cos, sin)
    for name, t in (("q", q), ("k", k)):
        expect_close(
            f"‖{name}‖ of every head (QK-Norm makes each head's RMS 1, RoPE keeps it)",
            t.norm(dim=-1),
            torch.full(t.shape[:-1], math.sqrt(8)),
            atol=1e-3,
            rtol=1e-3,
        )


@public("ch02.project_qk")
def _(project_qk):
    """Qwen2 layer: projections with their bias, no norm, then RoPE"""
    _check_project(project_qk, "qwen2", 2, 5, seed=3)


@hidden("ch02.project_qk")
def _(project_qk):
    _check_project(project_qk, "qwen3", 1, 7, seed=4, hidden=32, heads=8, kv_heads=2, head_dim=16)
    _check_project(project_qk, "qwen3", 3, 3, seed=5, hidden=8, heads=2, kv_heads=2, head_dim=4)
    _check_project(project_qk, "qwen2", 1, 6, seed=6, hidden=24, heads=6, kv_heads=3, head_dim=4)


# --- logit_stats ---------------------------------------------------------------------------------


def _slow_stats(q, k):
    """Row by row in float64, as written on paper: max over visible keys, -Σ p ln p."""
    B, H, T, D = q.shape
    max_logit, entropy = (
        torch.full((H,), -math.inf, dtype=torch.float64),
        torch.zeros(H, dtype=torch.float64),
    )
    for h in range(H):
        for b in range(B):
            for i in range(T):
                row = [
                    float(q[b, h, i].double() @ k[b, h, j].double()) / math.sqrt(D)
                    for j in range(i + 1)
                ]
                top = max(row)
                max_logit[h] = max(max_logit[h], top)
                e = [math.exp(s - top) for s in row]
                p = [v / sum(e) for v in e]
                entropy[h] += -sum(v * math.log(v) for v in p if v > 0) / (B * T)
    return max_logit, entropy


def _check_stats(fn, B, H, T, D, seed, scale=1.0):
    q, k = randn(B, H, T, D, seed=seed) * scale, randn(B, H, T, D, seed=seed + 1) * scale
    got = fn(q, k)
    if not (isinstance(got, tuple | list) and len(got) == 2):
        raise AssertionError("expected a pair (max_logit, entropy)")
    m, e = got
    expect_equal("max_logit shape (one value per head)", tuple(torch.as_tensor(m).shape), (H,))
    expect_equal("entropy shape (one value per head)", tuple(torch.as_tensor(e).shape), (H,))
    want_m, want_e = _slow_stats(q, k)
    if torch.allclose(torch.as_tensor(m).double(), want_m * math.sqrt(D), rtol=1e-4):
        raise AssertionError("max_logit is not divided by √D: attention logits are q·k/√D")
    full = (q @ k.transpose(-2, -1)).amax(dim=(0, 2, 3)) / math.sqrt(D)
    if not torch.allclose(want_m.float(), full, rtol=1e-4) and torch.allclose(
        torch.as_tensor(m).float(), full, rtol=1e-4
    ):
        raise AssertionError(
            "max_logit includes future keys: take the largest logit a query may attend to "
            "(the causal mask)"
        )
    expect_close("max_logit = largest q·k/√D over visible keys", m, want_m, atol=1e-4, rtol=1e-4)
    e = torch.as_tensor(e)
    if torch.isnan(e).any():
        raise AssertionError("entropy is nan: masked weights are 0, and 0·log 0 counts as 0")
    if torch.allclose(e.double(), want_e / math.log(2), atol=1e-4, rtol=1e-4):
        raise AssertionError("entropy is in bits: use the natural logarithm (nats)")
    expect_close(
        "entropy = mean over queries of -Σ p ln p (masked keys excluded)",
        e,
        want_e,
        atol=1e-4,
        rtol=1e-4,
    )


@public("ch02.logit_stats")
def _(logit_stats):
    """random queries and keys, against a row-by-row computation"""
    _check_stats(logit_stats, 2, 3, 5, 8, seed=0, scale=2.0)


@public("ch02.logit_stats")
def _(logit_stats):
    """equal queries and keys: a uniform row over i + 1 keys has entropy ln(i + 1)"""
    q = torch.ones(1, 2, 4, 8)
    got = logit_stats(q, q.clone())
    if not (isinstance(got, tuple | list) and len(got) == 2):
        raise AssertionError("expected a pair (max_logit, entropy)")
    m, e = got
    expect_close("max_logit of q = k = ones(8): 8/√8", m, torch.full((2,), math.sqrt(8)))
    uniform = sum(math.log(i + 1) for i in range(4)) / 4  # rows see 1, 2, 3, 4 keys
    expect_close(
        "entropy of uniform causal rows, mean of ln 1 … ln 4", e, torch.full((2,), uniform)
    )


@hidden("ch02.logit_stats")
def _(logit_stats):
    _check_stats(logit_stats, 1, 4, 7, 16, seed=1, scale=4.0)
    _check_stats(logit_stats, 3, 1, 3, 4, seed=2)
    _check_stats(logit_stats, 1, 2, 6, 32, seed=3, scale=0.3)


# --- distinct_weights ----------------------------------------------------------------------------


@public("ch02.distinct_weights")
def _(distinct_weights):
    """four different logits give four different weights in both dtypes"""
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    expect_equal(
        "distinct_weights([0, 1, 2, 3], float32)", distinct_weights(logits, torch.float32), 4
    )
    expect_equal(
        "distinct_weights([0, 1, 2, 3], bfloat16)", distinct_weights(logits, torch.bfloat16), 4
    )


@public("ch02.distinct_weights")
def _(distinct_weights):
    """large logits are rounded in bfloat16 before the softmax sees them"""
    # bfloat16 keeps 8 significant bits: between 512 and 1024 its numbers are 4 apart, so 513
    # rounds to 512 and 515 to 516; 514, halfway, rounds to 512 (the even neighbour).
    logits = torch.tensor([512.0, 513.0, 514.0, 515.0])
    expect_equal(
        "distinct_weights([512, 513, 514, 515], float32)",
        distinct_weights(logits, torch.float32),
        4,
    )
    got = distinct_weights(logits, torch.bfloat16)
    if got == 4:
        raise AssertionError(
            "4 distinct weights from bfloat16: round the logits to the dtype first; a bfloat16 "
            "model holds its logits in bfloat16 (512, 512, 512, 516 here)"
        )
    expect_equal(
        "distinct_weights([512, 513, 514, 515], bfloat16): logits 512, 512, 512, 516", got, 2
    )


@public("ch02.distinct_weights")
def _(distinct_weights):
    """weights that underflow to 0 are not counted"""
    logits = torch.tensor([0.0, -200.0, -300.0])  # exp(-200) is below float32's smallest number
    got = distinct_weights(logits, torch.float32)
    if got == 2:
        raise AssertionError("a weight of exactly 0 was counted: count the nonzero weights only")
    expect_equal("distinct_weights([0, -200, -300], float32)", got, 1)
    expect_equal("returns a Python int", type(got), int)


@hidden("ch02.distinct_weights")
def _(distinct_weights):
    for seed, scale, n in [(0, 1.0, 50), (1, 30.0, 200), (2, 300.0, 64), (3, 3000.0, 128)]:
        logits = randn(n, seed=seed) * scale
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            w = logits.to(dtype).double().softmax(-1)  # float64 softmax: an independent route
            w = w.to(torch.float32).to(dtype)
            # float32 and float64 softmax can differ in the last float32 bit: allow that
            want = len({float(v) for v in w.tolist() if v > 0})
            got = distinct_weights(logits, dtype)
            if abs(got - want) > max(1, want // 50):
                raise AssertionError(
                    f"distinct_weights(scale {scale}, n {n}, {dtype}): expected about {want}, "
                    f"got {got}"
                )


# --- remove_qk_norm ------------------------------------------------------------------------------


def _tiny_lm(qk: bool, layers=2, seed=0) -> CausalLM:
    cfg = lab.tiny_config(hidden=32, layers=layers, heads=2)
    model = lab.tiny_model(cfg, lab.tiny_arch(qk), seed)
    g = seeded(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.mul_(10)  # std 0.2: enough for the attention to matter
    return model.eval()


def _check_remove(fn, layers, seed):
    model = _tiny_lm(True, layers, seed)
    given = dict(model.state_dict())
    n_given = len(given)
    got = fn(given)
    if not isinstance(got, dict):
        raise AssertionError(f"expected a dict (a new state dict), got {type(got).__name__}")
    expect_equal(
        "entries of the state dict you were given (leave it unchanged)", len(given), n_given
    )
    norms = [k for k in got if k.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))]
    if norms and len(norms) == 2 * layers:
        ones = all(bool((got[k] == 1).all()) for k in norms)
        raise AssertionError(
            (
                "the norm weights are set to 1, but "
                if ones
                else "the norm weights are still there: "
            )
            + "a norm with weight 1 still divides each head by its RMS; removing QK-Norm means no "
            "normalisation at all: drop the q_norm and k_norm weights"
        )
    if norms:
        raise AssertionError(f"{norms[0]} is still there: remove QK-Norm from every layer")
    plain = CausalLM(lab.tiny_config(hidden=32, layers=layers, heads=2), lab.tiny_arch(False))
    plain.eval()
    missing = sorted(set(plain.state_dict()) - set(got))
    if missing:
        raise AssertionError(f"{missing[0]} is missing: keep every tensor that is not a QK-Norm")
    for k in plain.state_dict():
        expect_equal(f"{k} (unchanged)", got[k], given[k])
    plain.load_state_dict(got)
    ids = torch.randint(0, 256, (1, 12), generator=seeded(seed + 1))
    with torch.no_grad():  # independent: the same weights with the norms skipped at run time
        for layer in model.model.layers:
            layer.self_attn.q_norm = layer.self_attn.k_norm = None
        expect_close(
            "logits of a model without QK-Norm loading your dict",
            plain(ids),
            model(ids),
            atol=1e-4,
            rtol=1e-4,
        )


@public("ch02.remove_qk_norm")
def _(remove_qk_norm):
    _check_remove(remove_qk_norm, 2, seed=0)


@public("ch02.remove_qk_norm")
def _(remove_qk_norm):
    """a model without QK-Norm (Qwen2-like): every tensor kept"""
    given = dict(_tiny_lm(False).state_dict())
    got = remove_qk_norm(dict(given))
    expect_equal("keys kept from a model without QK-Norm", sorted(got), sorted(given))


@hidden("ch02.remove_qk_norm")
def _(remove_qk_norm):
    _check_remove(remove_qk_norm, 3, seed=5)
    _check_remove(remove_qk_norm, 1, seed=6)
