"""Checks for chapter 1 (attention: causal mask, MHA -> MQA -> GQA, KV cache, KV bytes).

Every check tests the object it is given on small seeded inputs. The expected values come from
the package reference, from values worked out by hand, and from independent references such as
`torch.nn.functional.scaled_dot_product_attention`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from qwen_mini import attention as ref
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
from qwen_mini.foundations import apply_rope, rope_cos_sin

register(
    "ch01.causal_mask",
    reference=ref.causal_mask,
    points=1,
    title="Causal mask, with new queries after cached keys",
)
register(
    "ch01.attention_weights",
    reference=ref.attention_weights,
    points=1,
    title="Attention weights: scaled scores, mask, softmax",
)
register(
    "ch01.attention",
    reference=ref.attention,
    points=1,
    title="Scaled dot-product attention written out",
)
register(
    "ch01.split_heads",
    reference=ref.split_heads,
    points=1,
    title="Split the hidden vector into heads",
)
register(
    "ch01.merge_heads",
    reference=ref.merge_heads,
    points=1,
    title="Merge the heads back into one vector",
)
register(
    "ch01.repeat_kv",
    reference=ref.repeat_kv,
    points=1,
    title="Repeat each KV head for the query heads of its group",
)
register("ch01.KVCache", reference=ref.KVCache, points=2, title="KV cache: update")
register(
    "ch01.Attention",
    reference=ref.Attention,
    points=3,
    title="Grouped-query attention module with a KV cache",
)
register(
    "ch01.kv_bytes_per_token",
    reference=ref.kv_bytes_per_token,
    points=1,
    title="KV-cache bytes per token from a config",
)
register(
    "ch01.regroup_kv_heads",
    reference=ref.regroup_kv_heads,
    points=2,
    title="Regroup KV heads: repeat (GQA -> MHA) or mean-pool (GQA -> MQA)",
)


# --- causal_mask --------------------------------------------------------------------------------


@public("ch01.causal_mask")
def _(causal_mask):
    m = causal_mask(3, 3)
    expect_equal("causal_mask(3, 3).dtype", m.dtype, torch.bool)
    expect_equal(
        "causal_mask(3, 3)",
        m.tolist(),
        [[True, False, False], [True, True, False], [True, True, True]],
    )


@public("ch01.causal_mask")
def _(causal_mask):
    # two new queries at positions 3 and 4, after 3 cached keys: both see the cache
    expect_equal(
        "causal_mask(2, 5)",
        causal_mask(2, 5).tolist(),
        [[True, True, True, True, False], [True, True, True, True, True]],
    )
    expect_equal(
        "causal_mask(1, 4) (one decoding step sees everything)",
        causal_mask(1, 4).tolist(),
        [[True, True, True, True]],
    )


@hidden("ch01.causal_mask")
def _(causal_mask):
    for t_new, t_total in [(1, 1), (4, 4), (3, 9), (7, 8)]:
        expected = torch.ones(t_new, t_total, dtype=torch.bool).tril(t_total - t_new)
        expect_equal(
            f"causal_mask({t_new}, {t_total})",
            causal_mask(t_new, t_total, device="cpu").tolist(),
            expected.tolist(),
        )


# --- attention_weights --------------------------------------------------------------------------


@public("ch01.attention_weights")
def _(attention_weights):
    # worked by hand: D = 4, so scores are q.k / 2 = [1, 0]; softmax = [e, 1] / (e + 1)
    q = torch.tensor([[[[2.0, 0.0, 0.0, 0.0]]]])  # [1, 1, 1, 4]
    k = torch.tensor([[[[1.0, 0.0, 0.0, 0.0], [0.0, 5.0, 0.0, 0.0]]]])  # [1, 1, 2, 4]
    e = math.e
    expect_close(
        "attention_weights of a hand-worked example (scale 1/sqrt(4))",
        attention_weights(q, k),
        torch.tensor([[[[e / (e + 1), 1 / (e + 1)]]]]),
        atol=1e-6,
        rtol=1e-6,
    )


@public("ch01.attention_weights")
def _(attention_weights):
    q, k = randn(2, 3, 5, 8, seed=1), randn(2, 3, 5, 8, seed=2)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    w = attention_weights(q, k, mask)
    expect_equal("shape", tuple(w.shape), (2, 3, 5, 5))
    expect_close("each row sums to 1", w.sum(-1), torch.ones(2, 3, 5), atol=1e-5, rtol=0)
    expect_close(
        "weight on masked (future) keys",
        w.masked_select(~mask).abs().max(),
        torch.tensor(0.0),
        atol=0,
        rtol=0,
    )
    # independent reference: torch's attention with v = identity returns the weights themselves
    eye = torch.eye(5).expand(2, 3, 5, 5)
    expect_close(
        "weights vs F.scaled_dot_product_attention(q, k, I)",
        w,
        F.scaled_dot_product_attention(q, k, eye, attn_mask=mask),
        atol=1e-5,
        rtol=1e-5,
    )


@hidden("ch01.attention_weights")
def _(attention_weights):
    q, k = randn(1, 2, 3, 16, seed=3), randn(1, 2, 6, 16, seed=4)
    mask = ref.causal_mask(3, 6)
    expect_close(
        "offset mask",
        attention_weights(q, k, mask),
        ref.attention_weights(q, k, mask),
        atol=1e-6,
        rtol=1e-5,
    )
    expect_close(
        "no mask", attention_weights(q, k), ref.attention_weights(q, k), atol=1e-6, rtol=1e-5
    )
    qb, kb = q.bfloat16() * 8, k.bfloat16() * 8  # large scores: softmax must not overflow
    w = attention_weights(qb, kb, mask)
    expect_equal("dtype follows q", w.dtype, torch.bfloat16)
    expect_close(
        "bfloat16 input", w.float(), ref.attention_weights(qb, kb, mask).float(), atol=1e-2, rtol=0
    )


# --- attention ----------------------------------------------------------------------------------


@public("ch01.attention")
def _(attention):
    q, k, v = (randn(2, 4, 6, 8, seed=s) for s in (5, 6, 7))
    expect_close(
        "attention(q, k, v) vs F.scaled_dot_product_attention",
        attention(q, k, v),
        F.scaled_dot_product_attention(q, k, v),
        atol=1e-5,
        rtol=1e-5,
    )
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    expect_close(
        "causal attention vs F.scaled_dot_product_attention(is_causal=True)",
        attention(q, k, v, mask),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        atol=1e-5,
        rtol=1e-5,
    )


@public("ch01.attention")
def _(attention):
    # one key: the weight is 1 whatever the score, so the output is that key's value
    q, k, v = randn(1, 1, 3, 4, seed=8), randn(1, 1, 1, 4, seed=9), randn(1, 1, 1, 4, seed=10)
    expect_close(
        "a single key returns its value",
        attention(q, k, v),
        v.expand(1, 1, 3, 4),
        atol=1e-6,
        rtol=0,
    )


@hidden("ch01.attention")
def _(attention):
    q, k, v = randn(1, 2, 2, 8, seed=11), randn(1, 2, 7, 8, seed=12), randn(1, 2, 7, 8, seed=13)
    mask = ref.causal_mask(2, 7)
    expect_close(
        "offset mask",
        attention(q, k, v, mask),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        atol=1e-5,
        rtol=1e-5,
    )


# --- split_heads / merge_heads ------------------------------------------------------------------


@public("ch01.split_heads")
def _(split_heads):
    x = torch.arange(2 * 3 * 12, dtype=torch.float32).reshape(2, 3, 12)
    y = split_heads(x, 4)
    expect_equal("split_heads([2, 3, 12], 4).shape", tuple(y.shape), (2, 4, 3, 3))
    # head h owns channels h*D .. h*D + D - 1 of every position
    expect_equal("split_heads(x, 4)[1, 2, 0]", y[1, 2, 0].tolist(), x[1, 0, 6:9].tolist())


@public("ch01.split_heads")
def _(split_heads):
    x = randn(1, 5, 32, seed=14)
    expect_close(
        "split_heads vs reference", split_heads(x, 8), ref.split_heads(x, 8), atol=0, rtol=0
    )


@hidden("ch01.split_heads")
def _(split_heads):
    x = randn(3, 2, 24, seed=15)
    for h in (1, 2, 6, 24):
        expect_close(
            f"split_heads(x, {h})", split_heads(x, h), ref.split_heads(x, h), atol=0, rtol=0
        )


@public("ch01.merge_heads")
def _(merge_heads):
    x = torch.arange(2 * 4 * 3 * 5, dtype=torch.float32).reshape(2, 4, 3, 5)
    y = merge_heads(x)
    expect_equal("merge_heads([2, 4, 3, 5]).shape", tuple(y.shape), (2, 3, 20))
    expect_equal(
        "merge_heads(x)[0, 1, 10:15] is head 2 at position 1",
        y[0, 1, 10:15].tolist(),
        x[0, 2, 1].tolist(),
    )


@public("ch01.merge_heads")
def _(merge_heads):
    x = randn(2, 3, 16, seed=16)
    expect_close(
        "merge_heads(split_heads(x, 4)) == x", merge_heads(ref.split_heads(x, 4)), x, atol=0, rtol=0
    )


@hidden("ch01.merge_heads")
def _(merge_heads):
    # attention outputs come out of a transpose: the input need not be contiguous
    x = randn(2, 4, 3, 10, seed=17)[..., ::2]  # [2, 4, 3, 5], every other number
    expect_close("non-contiguous input", merge_heads(x), ref.merge_heads(x), atol=0, rtol=0)


# --- repeat_kv ----------------------------------------------------------------------------------


@public("ch01.repeat_kv")
def _(repeat_kv):
    k = torch.tensor([0.0, 1.0]).view(1, 2, 1, 1)  # KV head i holds the number i
    expect_equal(
        "repeat_kv(heads [0, 1], 3) (query head h uses KV head h // 3)",
        repeat_kv(k, 3).flatten().tolist(),
        [0.0, 0.0, 0.0, 1.0, 1.0, 1.0],
    )


@public("ch01.repeat_kv")
def _(repeat_kv):
    k = randn(2, 4, 5, 8, seed=18)
    out = repeat_kv(k, 2)
    expect_equal("repeat_kv([2, 4, 5, 8], 2).shape", tuple(out.shape), (2, 8, 5, 8))
    for h in range(8):
        expect_close(
            f"query head {h} sees KV head {h // 2}", out[:, h], k[:, h // 2], atol=0, rtol=0
        )


@hidden("ch01.repeat_kv")
def _(repeat_kv):
    k = randn(1, 3, 4, 6, seed=19)
    expect_close("n_rep = 1 changes nothing", repeat_kv(k, 1), k, atol=0, rtol=0)
    expect_close("repeat_kv vs reference", repeat_kv(k, 4), ref.repeat_kv(k, 4), atol=0, rtol=0)
    # independent: torch's own grouped attention maps query heads to KV heads the same way
    q, v = randn(1, 12, 4, 6, seed=20), randn(1, 3, 4, 6, seed=21)
    expect_close(
        "attention on repeated heads vs F.scaled_dot_product_attention(enable_gqa)",
        F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4)),
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        atol=1e-5,
        rtol=1e-5,
    )


# --- KVCache ------------------------------------------------------------------------------------


def _kv(T, seed, heads=2, dim=4):
    return randn(1, heads, T, dim, seed=seed), randn(1, heads, T, dim, seed=seed + 1000)


@public("ch01.KVCache")
def _(KVCache):
    cache = KVCache(1, 2, 4, dtype=torch.float32)
    k1, v1 = _kv(3, 1)
    k, v = cache.update(k1, v1)
    expect_close("first update returns the new keys", k, k1, atol=0, rtol=0)
    expect_close("first update returns the new values", v, v1, atol=0, rtol=0)
    expect_equal("length after update, before the model commits the pass", cache.length, 0)
    cache.commit(3)  # the model commits the pass once every layer has run
    k2, v2 = _kv(2, 3)
    k, v = cache.update(k2, v2)
    expect_close(
        "second update: cached keys then new ones", k, torch.cat([k1, k2], 2), atol=0, rtol=0
    )
    expect_close(
        "second update: cached values then new ones", v, torch.cat([v1, v2], 2), atol=0, rtol=0
    )


@public("ch01.KVCache")
def _(KVCache):
    cache = KVCache(1, 2, 4, dtype=torch.float32)
    ks, vs = [], []
    for step in range(150):  # past any initial capacity, several times
        k1, v1 = _kv(1, 100 + step)
        ks.append(k1)
        vs.append(v1)
        k, v = cache.update(k1, v1)
        cache.commit(1)
    expect_equal("keys after 150 one-token steps: shape", tuple(k.shape), (1, 2, 150, 4))
    expect_close("keys after 150 one-token steps", k, torch.cat(ks, 2), atol=0, rtol=0)
    expect_close("values after 150 one-token steps", v, torch.cat(vs, 2), atol=0, rtol=0)
    expect_equal(
        "nbytes() after 150 tokens (2 * 2 heads * 150 * 4 * 4 bytes)",
        cache.nbytes(),
        2 * 2 * 150 * 4 * 4,
    )


@hidden("ch01.KVCache")
def _(KVCache):
    # a forward pass that fails after this layer wrote must not corrupt the cache: the length
    # did not advance, so the retry writes the same slots again
    cache = KVCache(1, 2, 4, dtype=torch.float32)
    k1, v1 = _kv(20, 5)
    cache.update(k1, v1)
    cache.commit(20)
    cache.update(*_kv(3, 6))  # the failed attempt: written, never committed
    cache.discard()
    k2, v2 = _kv(3, 7)
    k, v = cache.update(k2, v2)
    expect_close("retry after a failed pass: keys", k, torch.cat([k1, k2], 2), atol=0, rtol=0)
    expect_close("retry after a failed pass: values", v, torch.cat([v1, v2], 2), atol=0, rtol=0)


# --- Attention ----------------------------------------------------------------------------------


def _tiny_cfg(qwen3: bool, n_heads=4, n_kv=2, head_dim=8) -> Config:
    return Config(
        model_type="qwen3" if qwen3 else "qwen2",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=not qwen3,
        o_bias=False,
        qk_norm=qwen3,
    )


def _pair(Attention, cfg, seed):
    torch.manual_seed(seed)
    reference = ref.Attention(cfg, 1)
    with torch.no_grad():  # random norm weights too, so that a skipped QK-Norm shows
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=seeded(seed + p.numel())) * 0.3)
    mine = Attention(cfg, 1)
    mine.load_state_dict(reference.state_dict())
    return mine, reference


def _rope(cfg, start, T):
    return rope_cos_sin(torch.arange(start, start + T), cfg.head_dim, cfg.rope_theta)


@public("ch01.Attention")
def _(Attention):
    cfg = _tiny_cfg(qwen3=True)  # QK-Norm, 4 query heads sharing 2 KV heads, head_dim 8 != 16/4
    mine, reference = _pair(Attention, cfg, 22)
    x = randn(2, 5, 16, seed=23)
    cos, sin = _rope(cfg, 0, 5)
    with torch.no_grad():
        got = mine(x, cos, sin)
        expect_equal("output shape", tuple(got.shape), (2, 5, 16))
        expect_close(
            "Qwen3-style layer (QK-Norm, GQA), no cache",
            got,
            reference(x, cos, sin),
            atol=1e-5,
            rtol=1e-4,
        )


@public("ch01.Attention")
def _(Attention):
    cfg = _tiny_cfg(qwen3=True)
    mine, reference = _pair(Attention, cfg, 24)
    x = randn(1, 7, 16, seed=25)
    with torch.no_grad():
        full = reference(x, *_rope(cfg, 0, 7))
        cache = ref.KVCache(1, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float32)
        outs = []
        for start, end in [(0, 4), (4, 6), (6, 7)]:  # prompt, two tokens, one token
            outs.append(mine(x[:, start:end], *_rope(cfg, start, end - start), cache))
            cache.commit(end - start)
        expect_close(
            "prompt + cached continuation == one full pass",
            torch.cat(outs, 1),
            full,
            atol=1e-5,
            rtol=1e-4,
        )


@hidden("ch01.Attention")
def _(Attention):
    cfg = _tiny_cfg(qwen3=False, n_heads=6, n_kv=2, head_dim=4)  # Qwen2 style: bias, no norm
    mine, reference = _pair(Attention, cfg, 26)
    x = randn(2, 4, 16, seed=27)
    with torch.no_grad():
        expect_close(
            "Qwen2-style layer (QKV bias)",
            mine(x, *_rope(cfg, 0, 4)),
            reference(x, *_rope(cfg, 0, 4)),
            atol=1e-5,
            rtol=1e-4,
        )
    # independent of the package: torch's grouped attention on the same projections
    cfg = _tiny_cfg(qwen3=False, n_heads=4, n_kv=1, head_dim=8)  # MQA
    mine, _ = _pair(Attention, cfg, 28)
    x = randn(1, 6, 16, seed=29)
    cos, sin = _rope(cfg, 0, 6)
    with torch.no_grad():
        q = mine.q_proj(x).view(1, 6, 4, 8).transpose(1, 2)
        k = mine.k_proj(x).view(1, 6, 1, 8).transpose(1, 2)
        v = mine.v_proj(x).view(1, 6, 1, 8).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        expected = mine.o_proj(out.transpose(1, 2).reshape(1, 6, 32))
        expect_close(
            "MQA layer vs F.scaled_dot_product_attention(enable_gqa=True)",
            mine(x, cos, sin),
            expected,
            atol=1e-5,
            rtol=1e-4,
        )


# --- kv_bytes_per_token -------------------------------------------------------------------------


def _shape(layers, kv_heads, head_dim):
    return SimpleNamespace(
        num_hidden_layers=layers, num_key_value_heads=kv_heads, head_dim=head_dim
    )


@public("ch01.kv_bytes_per_token")
def _(kv_bytes_per_token):
    expect_equal(
        "Qwen2-7B in bf16 (28 layers, 4 KV heads, head_dim 128): 56 KiB",
        kv_bytes_per_token(_shape(28, 4, 128), 2),
        56 * 1024,
    )
    expect_equal(
        "Qwen3-8B in bf16 (36 layers, 8 KV heads, head_dim 128): 144 KiB",
        kv_bytes_per_token(_shape(36, 8, 128), 2),
        144 * 1024,
    )


@public("ch01.kv_bytes_per_token")
def _(kv_bytes_per_token):
    expect_equal(
        "Qwen2-7B in float32 (4 bytes a number)",
        kv_bytes_per_token(_shape(28, 4, 128), 4),
        112 * 1024,
    )


@hidden("ch01.kv_bytes_per_token")
def _(kv_bytes_per_token):
    cfg = _tiny_cfg(qwen3=True)
    cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim = 28, 8, 128  # Qwen3-0.6B
    expect_equal(
        "a qwen_mini Config shaped like Qwen3-0.6B", kv_bytes_per_token(cfg, 2), 112 * 1024
    )
    expect_equal(
        "Qwen1.5-7B (MHA, 32 KV heads)", kv_bytes_per_token(_shape(32, 32, 128), 2), 512 * 1024
    )


# --- regroup_kv_heads ---------------------------------------------------------------------------


@public("ch01.regroup_kv_heads")
def _(regroup_kv_heads):
    # 2 KV heads of head_dim 1; each weight row is one head: head 0 = [1, 1], head 1 = [3, 5]
    w = torch.tensor([[1.0, 1.0], [3.0, 5.0]])
    expect_equal(
        "2 -> 4 heads (repeat: heads 0, 0, 1, 1)",
        regroup_kv_heads(w, 1, 4).tolist(),
        [[1.0, 1.0], [1.0, 1.0], [3.0, 5.0], [3.0, 5.0]],
    )
    expect_equal("2 -> 1 head (mean)", regroup_kv_heads(w, 1, 1).tolist(), [[2.0, 3.0]])


@public("ch01.regroup_kv_heads")
def _(regroup_kv_heads):
    w, b = randn(4 * 8, 16, seed=30), randn(4 * 8, seed=31)  # 4 KV heads, head_dim 8
    expect_close(
        "weight 4 -> 8 heads",
        regroup_kv_heads(w, 8, 8),
        ref.regroup_kv_heads(w, 8, 8),
        atol=0,
        rtol=0,
    )
    expect_close(
        "bias 4 -> 8 heads",
        regroup_kv_heads(b, 8, 8),
        ref.regroup_kv_heads(b, 8, 8),
        atol=0,
        rtol=0,
    )
    expect_close(
        "weight 4 -> 2 heads",
        regroup_kv_heads(w, 8, 2),
        ref.regroup_kv_heads(w, 8, 2),
        atol=1e-6,
        rtol=1e-6,
    )
    expect_close(
        "regrouping to the same count changes nothing", regroup_kv_heads(w, 8, 4), w, atol=0, rtol=0
    )


@hidden("ch01.regroup_kv_heads")
def _(regroup_kv_heads):
    # repeating KV heads must not change attention at all: compare projections -> attention
    w = randn(2 * 4, 6, seed=32)
    x = randn(1, 5, 6, seed=33)
    k_gqa = (x @ w.T).view(1, 5, 2, 4).transpose(1, 2)
    k_mha = (x @ regroup_kv_heads(w, 4, 4).T).view(1, 5, 4, 4).transpose(1, 2)
    expect_close(
        "GQA keys repeated == MHA keys from the regrouped weight",
        k_mha,
        ref.repeat_kv(k_gqa, 2),
        atol=1e-6,
        rtol=1e-6,
    )
    expect_close(
        "mean of MHA heads == mean of the GQA heads they copy",
        regroup_kv_heads(regroup_kv_heads(w, 4, 4), 4, 1),
        regroup_kv_heads(w, 4, 1),
        atol=1e-6,
        rtol=1e-6,
    )
