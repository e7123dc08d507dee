"""Checks for chapter 1 (attention: causal mask, MHA -> MQA -> GQA, KV cache, KV bytes, the
decoder layer, the model's forward pass, loading, decoding).

Every exercise is a list of cases with a catalogue of typical mistakes whose ideas the messages
name. The stateful ones (the KV cache, the attention module, the decoder layer, the model's
forward, the loader, decoding) are diagnosed stage by stage: a case runs the learner's object
with spies (qwen_mini/course/fakes/ch01.py) and returns what each stage saw, in order (QK-Norm's
input, what was cached, o_proj's input, the output...), so the first stage that differs is the
one reported, and a catalogued mistake that sees the same names its idea. The expected values
come from the package reference, from values worked out by hand, and from independent references
such as `torch.nn.functional.scaled_dot_product_attention`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from qwen_mini import attention as ref
from qwen_mini import decoder as dec
from qwen_mini import decoding, weights
from qwen_mini.architectures import ARCHITECTURES
from qwen_mini.checkpoint import meta_model
from qwen_mini.config import Config, RopeScaling
from qwen_mini.course.checking import (
    between,
    expect_close,
    mistake,
    randn,
    register,
    seeded,
)
from qwen_mini.course.fakes.ch01 import Recorder, SpyCache, Watched
from qwen_mini.course.lab import ch01 as lab
from qwen_mini.course.observing import graded, observe
from qwen_mini.course.variants import backward, bfloat16, case, lazy, meta
from qwen_mini.model import CausalLM
from qwen_mini.norms import RMSNorm
from qwen_mini.rope import apply_rope, rope_cos_sin
from qwen_mini.rope_scaling import rotary_cos_sin

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
    reference=lab.kv_bytes_per_token,
    points=1,
    title="KV-cache bytes per token from a config",
)
register(
    "ch01.regroup_kv_heads",
    reference=lab.regroup_kv_heads,
    points=2,
    title="Regroup KV heads: repeat (GQA -> MHA) or mean-pool (GQA -> MQA)",
)


# --- causal_mask --------------------------------------------------------------------------------

MASK = "ch01.causal_mask"


def _mask(causal_mask, t_new, t_total):
    return causal_mask(t_new, t_total)


def _allowed(*rows):
    return lambda t_new, t_total: torch.tensor(rows, dtype=torch.bool)


case(
    MASK,
    "causal_mask(3, 3)",
    lambda g: (3, 3),
    _mask,
    _allowed([1, 0, 0], [1, 1, 0], [1, 1, 1]),
    # asked for the CPU, with the default device elsewhere: the mask must follow device=
    variants=(meta(call=lambda causal_mask, a, b: causal_mask(a, b, device="cpu")),),
)
# two new queries at positions 3 and 4, after 3 cached keys: both see the cache
case(
    MASK,
    "causal_mask(2, 5): 2 new queries after 3 cached keys",
    lambda g: (2, 5),
    _mask,
    _allowed([1, 1, 1, 1, 0], [1, 1, 1, 1, 1]),
)
case(
    MASK,
    "causal_mask(1, 4) (one decoding step sees everything)",
    lambda g: (1, 4),
    _mask,
    _allowed([1, 1, 1, 1]),
)
for n in range(3):
    case(
        MASK,
        f"other sizes {n + 1}",
        lambda g: (between(g, 1, 8), 0),
        lambda causal_mask, t_new, _: causal_mask(t_new, 2 * t_new, device="cpu"),
        lambda t_new, _: torch.ones(t_new, 2 * t_new, dtype=torch.bool).tril(t_new),
        hidden=True,
    )


@mistake(
    MASK,
    "offset mask: causal_mask(2, 5) is not the top-left triangle (what is_causal=True does); the "
    "2 new queries are positions 3 and 4, after 3 cached keys, and see them all",
)
def mask_top_left(t_new, t_total, device=None):
    return torch.ones(t_new, t_total, dtype=torch.bool, device=device).tril()


@mistake(MASK, "the diagonal: a token may attend to itself (key position <= query)")
def mask_no_diagonal(t_new, t_total, device=None):
    return ref.causal_mask(t_new, t_total, device).tril(t_total - t_new - 1)


@mistake(
    MASK,
    "causal_mask must be bool (True = attend): masked_fill and F.scaled_dot_product_attention read "
    "a float mask as numbers to add, not as allowed/not",
)
def mask_as_floats(t_new, t_total, device=None):
    return ref.causal_mask(t_new, t_total, device).float()


# --- attention_weights --------------------------------------------------------------------------

WEIGHTS = "ch01.attention_weights"


def _qk(*shape, scale=1.0, dtype=torch.float32, masked=True):
    def inputs(g):
        q, k = (randn(*shape, g=g) * scale).to(dtype), (randn(*shape, g=g) * scale).to(dtype)
        T = shape[-2]
        return q, k, torch.ones(T, T, dtype=torch.bool).tril() if masked else None

    return inputs


def _sdpa_weights(q, k, mask):  # torch's attention with v = identity returns the weights
    T_k = k.shape[-2]
    eye = torch.eye(T_k).expand(*q.shape[:-2], T_k, T_k)
    return F.scaled_dot_product_attention(q, k, eye, attn_mask=mask)


def _hand_qk(g):  # D = 4, so the scores are q.k / 2 = [1, 0]: softmax = [e, 1] / (e + 1)
    q = torch.tensor([[[[2.0, 0.0, 0.0, 0.0]]]])  # [1, 1, 1, 4]
    k = torch.tensor([[[[1.0, 0.0, 0.0, 0.0], [0.0, 5.0, 0.0, 0.0]]]])  # [1, 1, 2, 4]
    return q, k, None


case(WEIGHTS, "scale, -inf, softmax over the keys", _qk(1, 2, 4, 16), atol=1e-6, rtol=1e-5, seed=60)
case(
    WEIGHTS,
    "a hand-worked example (scale 1/sqrt(4)): [e, 1] / (e + 1)",
    _hand_qk,
    expected=lambda q, k, mask: torch.tensor([[[[math.e / (math.e + 1), 1 / (math.e + 1)]]]]),
    atol=1e-6,
    rtol=1e-6,
)
case(
    WEIGHTS,
    "vs F.scaled_dot_product_attention(q, k, I)",
    _qk(2, 3, 5, 8),
    expected=_sdpa_weights,
    atol=1e-5,
    rtol=1e-5,
    seed=1,
)


def _watched_softmax(attention_weights, q, k, mask):
    with observe("softmax_dtypes") as seen:  # made where the code runs (when graded: there)
        w = attention_weights(q, k, mask)
    return {
        "weights [..., T_q, T_k] (cast back to q.dtype)": w,
        "a softmax computed in another dtype than float32": any(
            d != torch.float32 for d in seen.value
        ),
    }


case(
    WEIGHTS,
    "bfloat16 q, k: scores in q's dtype, softmax in float32, weights cast back to q.dtype",
    _qk(1, 2, 6, 16, scale=3.0, dtype=torch.bfloat16),
    _watched_softmax,
    seed=61,
)
case(
    WEIGHTS,
    "offset mask",
    lambda g: (randn(1, 2, 3, 16, g=g), randn(1, 2, 6, 16, g=g), ref.causal_mask(3, 6)),
    atol=1e-6,
    rtol=1e-5,
    hidden=True,
)
case(WEIGHTS, "no mask", _qk(1, 2, 5, 16, masked=False), atol=1e-6, rtol=1e-5, hidden=True)
case(
    WEIGHTS,
    "large bfloat16 scores",
    _qk(1, 2, 6, 16, scale=8.0, dtype=torch.bfloat16),
    atol=1e-2,
    hidden=True,
)


def _scores(q, k, mask, scale, fill=float("-inf")):
    s = (q @ k.transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, fill)


@mistake(WEIGHTS, "scale the scores by 1/sqrt(D) before the softmax")
def weights_unscaled(q, k, mask=None):
    return _scores(q, k, mask, 1.0).softmax(-1, dtype=torch.float32).to(q.dtype)


@mistake(WEIGHTS, "the scale is 1/sqrt(D), not 1/D")
def weights_over_d(q, k, mask=None):
    return _scores(q, k, mask, 1 / q.shape[-1]).softmax(-1, dtype=torch.float32).to(q.dtype)


@mistake(WEIGHTS, "softmax over the keys (the last dimension): each row sums to 1")
def weights_wrong_dim(q, k, mask=None):
    return _scores(q, k, mask, q.shape[-1] ** -0.5).softmax(-2, dtype=torch.float32).to(q.dtype)


@mistake(
    WEIGHTS,
    "masked keys must get weight exactly 0: fill their scores with -inf (a score of 0 still gets "
    "exp(0) = 1 before normalising)",
)
def weights_zero_fill(q, k, mask=None):
    s = _scores(q, k, mask, q.shape[-1] ** -0.5, fill=0.0)
    return s.softmax(-1, dtype=torch.float32).to(q.dtype)


@mistake(
    WEIGHTS,
    "softmax in float32: ask for softmax(..., dtype=torch.float32) (or .float() the scores) and "
    "cast the weights back to q.dtype",
)
def weights_low_precision(q, k, mask=None):
    return _scores(q, k, mask, q.shape[-1] ** -0.5).softmax(-1)  # in the input's dtype


@mistake(
    WEIGHTS,
    "the scores q @ kᵀ were computed in float32: compute them in q's dtype (bfloat16 here), as "
    "the model does; only the softmax runs in float32",
)
def weights_scores_in_float32(q, k, mask=None):
    s = _scores(q.float(), k.float(), mask, q.shape[-1] ** -0.5)
    return s.softmax(-1, dtype=torch.float32).to(q.dtype)


@mistake(WEIGHTS, "the weights are float32: cast them back to q.dtype after the softmax")
def weights_not_cast_back(q, k, mask=None):
    return _scores(q, k, mask, q.shape[-1] ** -0.5).softmax(-1, dtype=torch.float32)


# --- attention ----------------------------------------------------------------------------------

ATTENTION = "ch01.attention"


def _qkv(B, H, T_q, T_k, D, mask=None):
    def inputs(g):
        q, k, v = randn(B, H, T_q, D, g=g), randn(B, H, T_k, D, g=g), randn(B, H, T_k, D, g=g)
        return (q, k, v) if mask is None else (q, k, v, mask)

    return inputs


def _sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


CAUSAL = torch.ones(6, 6, dtype=torch.bool).tril()
case(
    ATTENTION,
    "causal attention (the mask is used)",
    _qkv(1, 2, 6, 6, 8, CAUSAL),
    expected=_sdpa,
    atol=1e-5,
    rtol=1e-5,
    seed=62,
    variants=("bfloat16", "meta"),
)
case(
    ATTENTION,
    "vs F.scaled_dot_product_attention",
    _qkv(2, 4, 6, 6, 8),
    expected=_sdpa,
    atol=1e-5,
    rtol=1e-5,
    seed=5,
)
case(
    ATTENTION,
    "a single key returns its value (its weight is 1 whatever the score)",
    _qkv(1, 1, 3, 1, 4),
    expected=lambda q, k, v: v.expand(1, 1, 3, 4),
    atol=1e-6,
    seed=8,
)
case(
    ATTENTION,
    "offset mask",
    _qkv(1, 2, 2, 7, 8, ref.causal_mask(2, 7)),
    expected=_sdpa,
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)


@mistake(ATTENTION, "the mask was ignored: pass it on to attention_weights")
def attention_ignores_mask(q, k, v, mask=None):
    return ref.attention_weights(q, k) @ v


# --- split_heads / merge_heads ------------------------------------------------------------------

SPLIT, MERGE = "ch01.split_heads", "ch01.merge_heads"


def _channels(*shape):  # channel c of position t holds a number of its own
    return lambda g: (torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape),)


case(
    SPLIT,
    "split_heads(x [1, 2, 6], 3): heads as a batch dimension",
    lambda g: (*_channels(1, 2, 6)(g), 3),
)
case(SPLIT, "split_heads(x [2, 3, 12], 4)", lambda g: (*_channels(2, 3, 12)(g), 4))
case(SPLIT, "random x [1, 5, 32], 8 heads", lambda g: (randn(1, 5, 32, g=g), 8), seed=14)
case(
    SPLIT,
    "other head counts",
    lambda g: (randn(3, 2, 24, g=g), (1, 2, 6, 24)[between(g, 0, 3)]),
    hidden=True,
)


@mistake(
    SPLIT,
    "a reshape to [B, H, T, D] without a transpose mixes positions into heads: view as "
    "[B, T, H, D] first (head h owns channels h*D .. h*D + D - 1), then transpose",
)
def split_no_transpose(x, n_heads):
    B, T, _ = x.shape
    return x.reshape(B, n_heads, T, -1)


@mistake(SPLIT, "head h owns the *contiguous* channels h*D .. h*D + D - 1, not every H-th one")
def split_strided(x, n_heads):
    B, T, _ = x.shape
    return x.view(B, T, -1, n_heads).transpose(-1, -2).transpose(1, 2)


@mistake(SPLIT, "heads become a batch dimension: [B, n_heads, T, D], transpose T and H")
def split_heads_last(x, n_heads):
    B, T, _ = x.shape
    return x.view(B, T, n_heads, -1)


def _as_attention_returns(*shape):  # [B, H, T, D] out of a transpose: not contiguous
    return lambda g: (randn(shape[0], shape[2], shape[1], shape[3], g=g).transpose(1, 2),)


case(
    MERGE,
    "heads out of a transpose (not contiguous), [1, 3, 2, 2]",
    _as_attention_returns(1, 3, 2, 2),
)
case(MERGE, "merge_heads(x [2, 4, 3, 5])", _channels(2, 4, 3, 5))
case(
    MERGE,
    "other shapes",
    lambda g: (randn(2, between(g, 1, 4), 3, 10, g=g)[..., ::2],),
    hidden=True,
)


@mistake(
    MERGE,
    "after a transpose the tensor is not contiguous and view() refuses it: use reshape (or "
    ".contiguous().view)",
)
def merge_with_view(x):
    B, H, T, D = x.shape
    try:
        return x.transpose(1, 2).view(B, T, H * D)
    except RuntimeError as e:
        raise AssertionError(
            "after a transpose the tensor is not contiguous and view() refuses it: use reshape "
            f"(or .contiguous().view) ({e})"
        ) from None


@mistake(
    MERGE,
    "merge_heads must undo split_heads: transpose back to [B, T, H, D] before reshaping to "
    "[B, T, H*D]",
)
def merge_no_transpose(x):
    B, H, T, D = x.shape
    return x.reshape(B, T, H * D)


# --- repeat_kv ----------------------------------------------------------------------------------

REPEAT = "ch01.repeat_kv"


def _numbered_heads(n):  # KV head i holds the number i
    return lambda g: (torch.arange(float(n)).view(1, n, 1, 1), 2)


case(REPEAT, "repeat_kv(heads [0, 1, 2], 2): query head h uses KV head h // 2", _numbered_heads(3))
case(
    REPEAT,
    "repeat_kv([2, 4, 5, 8], 2)",
    lambda g: (randn(2, 4, 5, 8, g=g), 2),
    seed=18,
    variants=("bfloat16",),
)
case(REPEAT, "n_rep = 1 changes nothing", lambda g: (randn(1, 3, 4, 6, g=g), 1), hidden=True)
case(
    REPEAT,
    "attention on repeated heads vs F.scaled_dot_product_attention(enable_gqa)",
    lambda g: (randn(1, 12, 4, 6, g=g), randn(1, 3, 4, 6, g=g), randn(1, 3, 4, 6, g=g)),
    lambda repeat_kv, q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4)),
    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)


@mistake(
    REPEAT,
    "KV heads tiled (0, 1, 2, 0, 1, 2): query head h reads KV head h // n_rep, so neighbours share "
    "one: 0, 0, 1, 1, 2, 2 (the checkpoint was trained that way)",
)
def repeat_tiled(k, n_rep):
    return k.repeat(1, n_rep, 1, 1)


# --- KVCache ------------------------------------------------------------------------------------

CACHE = "ch01.KVCache"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _kv(T, seed, heads=2, dim=4):
    return randn(1, heads, T, dim, seed=seed), randn(1, heads, T, dim, seed=seed + 1000)


def _cache_growth(KVCache):
    """One pass of 3 tokens, then 200 one-token steps: what update and the storage did."""
    cache = KVCache(1, 2, 4, dtype=torch.float32)
    cache.update(*_kv(3, 70))
    length = cache.length
    cache.commit(3)
    moves, copies = 0, 0
    last = _storage(cache.k)
    for step in range(200):
        k, v = cache.update(*_kv(1, 300 + step))
        cache.commit(1)
        if _storage(k) != _storage(cache.k) or _storage(v) != _storage(cache.v):
            copies += 1
        if _storage(cache.k) != last:
            moves, last = moves + 1, _storage(cache.k)
    return {
        "length after update, before the model commits the pass": length,
        "steps of 200 in which update returned tensors that are not views of its storage": copies,
        "at most 8 reallocations of the storage in 200 one-token steps": moves <= 8,
    }


def _two_updates(KVCache, dtype=torch.float32):
    cache = KVCache(1, 2, 4, dtype=dtype)
    first = cache.update(*(t.to(dtype) for t in _kv(3, 1)))
    length = cache.length
    cache.commit(3)  # the model commits the pass once every layer has run
    second = cache.update(*(t.to(dtype) for t in _kv(2, 3)))
    return {
        "first update returns the new (keys, values)": first,
        "length after update, before the model commits the pass": length,
        "second update returns (keys, values): the cached ones, then the new": second,
    }


def _many_steps(KVCache, **where):
    cache = KVCache(1, 2, 4, dtype=torch.float32, **where)
    for step in range(150):  # past any initial capacity, several times
        k, v = cache.update(*_kv(1, 100 + step))
        cache.commit(1)
    return {
        "keys after 150 one-token steps": k,
        "values after 150 one-token steps": v,
        "nbytes() after 150 tokens (2 * 2 heads * 150 * 4 * 4 bytes)": cache.nbytes(),
    }


def _retry(KVCache):
    """A pass that fails after this layer wrote must not corrupt the cache: the length did not
    advance, so the retry writes the same slots again."""
    cache = KVCache(1, 2, 4, dtype=torch.float32)
    cache.update(*_kv(20, 5))
    cache.commit(20)
    cache.update(*_kv(3, 6))  # the failed attempt: written, never committed
    cache.discard()
    k, v = cache.update(*_kv(3, 7))
    return {"retry after a failed pass: keys": k, "retry after a failed pass: values": v}


# bfloat16: a cache made for a bfloat16 model stores (and returns) bfloat16; meta: its storage
# on the device it is given (the model gives its own), not on the default one
case(
    CACHE,
    "two updates with a commit between",
    lambda g: (),
    _two_updates,
    variants=(bfloat16(call=lambda KVCache: _two_updates(KVCache, torch.bfloat16)),),
)
case(CACHE, "length, views, growth by doubling", lambda g: (), _cache_growth)
case(
    CACHE,
    "150 one-token steps",
    lambda g: (),
    _many_steps,
    variants=(meta(call=lambda KVCache: _many_steps(KVCache, device="cpu")),),
)
case(CACHE, "a retry after a failed pass", lambda g: (), _retry, hidden=True)

LENGTH_IDEA = (
    "update must not advance length: the model calls commit() once every layer has run, so a "
    "failed pass changes nothing"
)
REALLOCATED = (
    "the storage was reallocated at almost every step: appending with torch.cat (or growing by "
    "the tokens needed) copies the whole cache every step; write into free slots and grow by "
    "doubling (_grow) when they run out"
)


@mistake(
    CACHE,
    "retry after a failed pass: write at `length` (what was committed), not after what was last "
    "written, so a pass that failed leaves nothing behind",
    public=False,
)
class CacheCountsWrites(ref.KVCache):
    """Keeps its own end-of-data counter: a failed pass shifts every later token."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.end = 0

    def update(self, k, v):
        start, end = self.end, self.end + k.shape[2]
        if end > self.k.shape[2]:
            self.k, self.v = self._grow(self.k, end), self._grow(self.v, end)
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        self.end = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def _grow(self, buf, needed):
        new = buf.new_empty(buf.shape[:2] + (max(needed, 2 * buf.shape[2], 16),) + buf.shape[3:])
        new[:, :, : self.end] = buf[:, :, : self.end]
        return new


@mistake(CACHE, LENGTH_IDEA)
class CacheAdvancesLength(ref.KVCache):
    def update(self, k, v):
        out = super().update(k, v)
        self.length += k.shape[2]
        return out

    def commit(self, n_tokens):
        pass


@mistake(CACHE, REALLOCATED)
class CacheConcatenates(ref.KVCache):
    def update(self, k, v):
        self.k = torch.cat([self.k[:, :, : self.length], k], 2)
        self.v = torch.cat([self.v[:, :, : self.length], v], 2)
        return self.k, self.v


@mistake(
    CACHE,
    "update returned copies: return slices of the storage (self.k[:, :, :end]), which cost "
    "nothing, not new tensors",
)
class CacheReturnsCopies(ref.KVCache):
    def update(self, k, v):
        k_all, v_all = super().update(k, v)
        return k_all.clone(), v_all.clone()


@mistake(CACHE, REALLOCATED)
class CacheGrowsByWhatIsNeeded(ref.KVCache):
    def _grow(self, buf, needed):
        new = buf.new_empty(buf.shape[:2] + (needed,) + buf.shape[3:])
        new[:, :, : self.length] = buf[:, :, : self.length]
        return new


# --- Attention ----------------------------------------------------------------------------------


def _tiny_cfg(qwen3: bool, n_heads=4, n_kv=2, head_dim=8, layers=2, tied=False) -> Config:
    """A tiny Qwen3 (QK-Norm) or Qwen2 (QKV bias) config; its row is ARCHITECTURES[model_type]."""
    return Config(
        model_type="qwen3" if qwen3 else "qwen2",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=128,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )


def _row(cfg: Config):
    return ARCHITECTURES[cfg.model_type]


def _pair(Attention, cfg, seed, on_meta=False):
    torch.manual_seed(seed)
    reference = ref.Attention(cfg, 1, _row(cfg))
    with torch.no_grad():  # random norm weights too, so that a skipped QK-Norm shows
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=seeded(seed + p.numel())) * 0.3)
    mine = Attention(cfg, 1, _row(cfg))
    if on_meta:  # built with the default device set to meta: its weights to the CPU first
        mine.to_empty(device="cpu")
    mine.load_state_dict(reference.state_dict())
    return mine, reference


def _rope(cfg, start, T):
    return rope_cos_sin(torch.arange(start, start + T), cfg.head_dim, cfg.rope_theta)


def _inputs_of(module, where: list):
    def hook(mod, args):
        where.append(args[0].detach().clone())

    return module.register_forward_pre_hook(hook)


def _attention_run(Attention, cfg, seed, B=1, cached=0, T=4, dtype=torch.float32, on_meta=False):
    """The learner's layer run (after `cached` tokens in a cache, or with no cache), and what
    each stage saw: QK-Norm's input (per head, before RoPE), what it cached (the KV heads after
    RoPE, before repeat_kv), o_proj's input (the merged heads), the output. `dtype`: the
    weights, input, cos and sin and cache in it (bfloat16: as the models ship). `on_meta`: its
    forward runs with the default device set to meta (the meta variant; when graded, the
    sandbox sets it around every call of the learner's code)."""
    mine, reference = _pair(Attention, cfg, seed, on_meta)
    mine, reference = mine.to(dtype), reference.to(dtype)
    H_kv, D = cfg.num_key_value_heads, cfg.head_dim
    x = randn(B, cached + T, cfg.hidden_size, seed=seed + 1).to(dtype)

    def _rope(cfg, start, T):  # the model's forward hands cos and sin over in its dtype
        return tuple(t.to(dtype) for t in rope_cos_sin(torch.arange(start, start + T),
                                                       cfg.head_dim, cfg.rope_theta))  # fmt: skip

    cache = None
    with torch.no_grad():
        if cached:
            cache = SpyCache(B, H_kv, D, dtype=dtype)
            reference(x[:, :cached], *_rope(cfg, 0, cached), cache)
            cache.commit(cached)
            cache.stored.clear()
        seen_q, seen_o = [], []
        hooks = [_inputs_of(mine.o_proj, seen_o)]
        if _row(cfg).qk_norm and getattr(mine, "q_norm", None) is not None:
            hooks.append(_inputs_of(mine.q_norm, seen_q))
        crash, got = None, None
        x_new, cos, sin = x[:, cached:], *_rope(cfg, cached, T)
        meta_here = on_meta and not graded()
        try:
            with torch.device("meta") if meta_here else contextlib.nullcontext():
                got = mine(x_new, cos, sin, cache)
        except NotImplementedError:
            raise
        except Exception as e:  # the stages it got through may say why (a cache of 2 heads
            crash = e  # handed 4 cannot store them)
        finally:
            for h in hooks:
                h.remove()
    stages = {}
    if _row(cfg).qk_norm:
        stages["QK-Norm applied to the query heads (self.q_norm)"] = bool(seen_q)
        q = seen_q[0] if seen_q else None
        if q is not None and tuple(q.shape) == (B, T, cfg.num_attention_heads, D):
            q = q.transpose(1, 2)  # normalised before the transpose, as transformers does
        stages["q_norm's input: the split query heads [B, H, T, head_dim], before RoPE"] = q
    if cached:
        stored = cache.stored[0] if cache.stored else None
        stages["cache.update called with the new keys and values"] = stored is not None
        stages["keys given to cache.update: the KV heads after QK-Norm and RoPE"] = (
            stored[0] if stored else None
        )
        stages["values given to cache.update: the KV heads"] = stored[1] if stored else None
    stages["o_proj applied to the merged heads"] = bool(seen_o)
    stages["o_proj's input: the attention output, heads merged"] = seen_o[0] if seen_o else None
    stages["output of the layer (o_proj of the heads)"] = got
    if crash is not None:
        _stages_or_crash(
            stages,
            crash,
            lambda: _attention_run(ref.Attention, cfg, seed, B, cached, T, dtype, on_meta),
        )
    return stages


def _stages_or_crash(stages: dict, crash: Exception, reference_stages) -> None:
    """After the learner's code raised: return (to report) when a stage it got through already
    differs from the reference's, which names the mistake; else raise what it raised."""
    want = reference_stages()
    for key, value in stages.items():
        if value is not None and key in want:
            try:
                expect_close(key, value, want[key], atol=1e-5, rtol=1e-4)
            except AssertionError:
                return
    raise crash


def _attention_case(name, cfg, seed, B, cached, T, hidden=False, bf16=False):
    def call(Attention, dtype=torch.float32):
        return _attention_run(Attention, cfg, seed, B, cached, T, dtype)

    # bfloat16: the layer as the models ship, its weights, input, cos, sin and cache in bfloat16;
    # meta: what its forward makes (a mask for the queries after a cache) on its input's device
    variants = (
        (
            bfloat16(call=lambda A: call(A, torch.bfloat16)),
            meta(call=lambda A: _attention_run(A, cfg, seed, B, cached, T, on_meta=True)),
        )
        if bf16
        else ()
    )
    case(ATTN, name, lambda g: (), call, atol=1e-5, rtol=1e-4, hidden=hidden, variants=variants)


ATTN = "ch01.Attention"
QWEN3, QWEN2 = _tiny_cfg(qwen3=True), _tiny_cfg(qwen3=False, n_heads=6, n_kv=2, head_dim=4)
_attention_case("stages, no cache (QK-Norm, 4 query heads on 2 KV heads)", QWEN3, 130, 2, 0, 5)
_attention_case("stages, 3 new tokens after 4 cached", QWEN3, 131, 1, 4, 3, bf16=True)
_attention_case("Qwen2 style (QKV bias, no QK-Norm), 6 heads on 2", QWEN2, 26, 2, 0, 4)
_attention_case(
    "6 heads on 3, 2 tokens after 5 cached",
    _tiny_cfg(qwen3=True, n_heads=6, n_kv=3, head_dim=4),
    132,
    2,
    5,
    2,
    hidden=True,
)
_attention_case(
    "one token after 3 cached",
    _tiny_cfg(qwen3=True, n_heads=6, n_kv=3, head_dim=4),
    133,
    1,
    3,
    1,
    hidden=True,
)
_attention_case(
    "MQA without QK-Norm, 4 tokens after 2 cached",
    _tiny_cfg(qwen3=False, n_heads=4, n_kv=1),
    134,
    1,
    2,
    4,
    hidden=True,
)


def _continued(Attention):
    cfg = QWEN3
    mine, reference = _pair(Attention, cfg, 24)
    x = randn(1, 7, 16, seed=25)
    with torch.no_grad():
        cache = ref.KVCache(1, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float32)
        outs = []
        for start, end in [(0, 4), (4, 6), (6, 7)]:  # prompt, two tokens, one token
            outs.append(mine(x[:, start:end], *_rope(cfg, start, end - start), cache))
            cache.commit(end - start)
    return torch.cat(outs, 1)


case(
    ATTN,
    "prompt + cached continuation == one full pass",
    lambda g: (),
    _continued,
    lambda: _continued(ref.Attention),
    atol=1e-5,
    rtol=1e-4,
)


def _mqa_by_torch(Attention):
    """The layer's output, and torch's grouped attention on its own projections (independent
    of the package)."""
    cfg = _tiny_cfg(qwen3=False, n_heads=4, n_kv=1, head_dim=8)
    mine, _ = _pair(Attention, cfg, 28)
    x = randn(1, 6, 16, seed=29)
    cos, sin = _rope(cfg, 0, 6)
    with torch.no_grad():
        q = mine.q_proj(x).view(1, 6, 4, 8).transpose(1, 2)
        k = mine.k_proj(x).view(1, 6, 1, 8).transpose(1, 2)
        v = mine.v_proj(x).view(1, 6, 1, 8).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return mine(x, cos, sin), mine.o_proj(out.transpose(1, 2).reshape(1, 6, 32))


case(
    ATTN,
    "MQA layer vs F.scaled_dot_product_attention(enable_gqa=True)",
    lambda g: (),
    lambda Attention: _mqa_by_torch(Attention)[0],
    lambda: _mqa_by_torch(ref.Attention)[1],
    atol=1e-5,
    rtol=1e-4,
    hidden=True,
)


def attention_variant(**wrong):
    """The reference layer with one stage done wrong (what the catalogue below names)."""

    class Wrong(ref.Attention):
        def forward(self, x, cos, sin, cache=None):
            q = ref.split_heads(self.q_proj(x), self.n_heads)
            k = ref.split_heads(self.k_proj(x), self.n_kv_heads)
            v = ref.split_heads(self.v_proj(x), self.n_kv_heads)
            n_rep, T = self.n_heads // self.n_kv_heads, x.shape[1]
            if wrong.get("norm_after_rope"):
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if self.q_norm is not None and not wrong.get("skip_norm"):
                q, k = self.q_norm(q), self.k_norm(k)
            if not wrong.get("norm_after_rope"):
                if wrong.get("cache_before_rope") and cache is not None:
                    k, v = cache.update(k, v)
                    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                    cache = None
                else:
                    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if wrong.get("cache_after_repeat") and cache is not None:
                k, v = ref.repeat_kv(k, n_rep), ref.repeat_kv(v, n_rep)
                k, v = cache.update(k, v)
                n_rep = 1
            elif cache is not None and not wrong.get("ignore_cache"):
                k, v = cache.update(k, v)
            t_total = k.shape[2]
            if wrong.get("tile"):
                k, v = k.repeat(1, n_rep, 1, 1), v.repeat(1, n_rep, 1, 1)
            else:
                k, v = ref.repeat_kv(k, n_rep), ref.repeat_kv(v, n_rep)
            mask, causal = ref.causal_mask(T, t_total), False
            if wrong.get("top_left"):
                mask, causal = None, T > 1
            if wrong.get("no_mask"):
                mask = None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            out = ref.merge_heads(out)
            return out[..., : x.shape[-1]] if wrong.get("no_o_proj") else self.o_proj(out)

    return Wrong


for _wrong, _idea in {
    "norm_after_rope": "order of QK-Norm and RoPE: normalise first, then rotate (transformers: "
    "self.q_norm(self.q_proj(x)...) and only then apply_rotary_pos_emb)",
    "skip_norm": "QK-Norm skipped: normalise each query and key head with self.q_norm and "
    "self.k_norm",
    "tile": "grouping of KV heads: tiled (0, 1, 0, 1, ...); query head h reads KV head "
    "h // n_rep (neighbours share), as repeat_kv does",
    "top_left": "mask: is_causal=True is the top-left triangle; queries after a cache need the "
    "offset mask causal_mask(T, T_total)",
    "no_mask": "mask: no causal mask, so tokens see the future",
    "cache_after_repeat": "the cache stores the KV heads before repeat_kv: repeated heads cost "
    "n_rep times the memory and hold nothing new",
    "cache_before_rope": "keys are cached after RoPE (a token's rotation never changes), yours "
    "before",
    "ignore_cache": "with a cache, store the new keys and values and attend over all of them: "
    "k, v = cache.update(k, v)",
    "no_o_proj": "o_proj was not applied to the merged heads",
}.items():
    mistake(ATTN, _idea, name=f"attention_{_wrong}")(attention_variant(**{_wrong: True}))


# --- kv_bytes_per_token -------------------------------------------------------------------------

BYTES = "ch01.kv_bytes_per_token"


def _shape(layers, kv_heads, head_dim, heads=None):
    return SimpleNamespace(
        num_hidden_layers=layers,
        num_key_value_heads=kv_heads,
        num_attention_heads=heads or kv_heads,
        head_dim=head_dim,
    )


def _bytes(name, shape, dtype_bytes, n, hidden=False):
    case(BYTES, name, lambda g: (shape, dtype_bytes), expected=lambda *_: n, hidden=hidden)


_bytes("Qwen2-7B in float32 (4 bytes a number)", _shape(28, 4, 128, 28), 4, 112 * 1024)
_bytes(
    "Qwen2-7B in bf16 (28 layers, 4 KV heads of 28 query heads, head_dim 128): 56 KiB",
    _shape(28, 4, 128, 28),
    2,
    56 * 1024,
)
_bytes(
    "Qwen3-8B in bf16 (36 layers, 8 KV heads, head_dim 128): 144 KiB",
    _shape(36, 8, 128, 32),
    2,
    144 * 1024,
)
_bytes("Qwen1.5-7B (MHA, 32 KV heads)", _shape(32, 32, 128), 2, 512 * 1024, hidden=True)
case(
    BYTES,
    "a qwen_mini Config shaped like Qwen3-0.6B",
    lambda g: (
        replace(_tiny_cfg(qwen3=True), num_hidden_layers=28, num_key_value_heads=8, head_dim=128),
        2,
    ),
    expected=lambda *_: 112 * 1024,
    hidden=True,
)


@mistake(BYTES, "a key AND a value per KV head: twice what you counted")
def kv_keys_only(cfg, dtype_bytes=2):
    return cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


@mistake(
    BYTES,
    "the cache holds the KV heads (num_key_value_heads, before repeat_kv), not one per query head",
)
def kv_query_heads(cfg, dtype_bytes=2):
    return 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * dtype_bytes


@mistake(BYTES, "every layer keeps its own cache: count all num_hidden_layers")
def kv_one_layer(cfg, dtype_bytes=2):
    return 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


@mistake(BYTES, "bytes, not numbers: multiply by dtype_bytes")
def kv_numbers(cfg, dtype_bytes=2):
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim


@mistake(BYTES, "bytes, not bits: dtype_bytes is already in bytes")
def kv_bits(cfg, dtype_bytes=2):
    return 16 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


# --- regroup_kv_heads ---------------------------------------------------------------------------

REGROUP = "ch01.regroup_kv_heads"
NUMBERED = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # 4 KV heads of head_dim 1: head i holds i
case(
    REGROUP,
    "4 -> 8 heads: each head copied next to itself (0, 0, 1, 1, ...)",
    lambda g: (NUMBERED, 1, 8),
)
case(
    REGROUP,
    "4 -> 2 heads: neighbouring heads (0, 1) and (2, 3) averaged",
    lambda g: (NUMBERED, 1, 2),
)
# 2 KV heads of head_dim 1; each weight row is one head: head 0 = [1, 1], head 1 = [3, 5]
TWO = torch.tensor([[1.0, 1.0], [3.0, 5.0]])
case(
    REGROUP,
    "2 -> 4 heads (repeat: heads 0, 0, 1, 1)",
    lambda g: (TWO, 1, 4),
    expected=lambda *_: torch.tensor([[1.0, 1.0], [1.0, 1.0], [3.0, 5.0], [3.0, 5.0]]),
)
case(
    REGROUP,
    "2 -> 1 head (mean)",
    lambda g: (TWO, 1, 1),
    expected=lambda *_: torch.tensor([[2.0, 3.0]]),
)
for n_kv in (8, 2, 4):
    case(
        REGROUP,
        f"a weight, 4 -> {n_kv} heads",
        lambda g, n_kv=n_kv: (randn(4 * 8, 16, g=g), 8, n_kv),
        atol=1e-6,
        rtol=1e-6,
        seed=30,
        variants=("bfloat16",) if n_kv < 4 else (),  # a mean in float32, cast back
    )
case(REGROUP, "a bias, 4 -> 8 heads", lambda g: (randn(4 * 8, g=g), 8, 8), seed=31)


def _gqa_keys(g):
    return randn(2 * 4, 6, g=g), randn(1, 5, 6, g=g)


case(
    REGROUP,
    "GQA keys repeated == MHA keys from the regrouped weight",
    _gqa_keys,
    lambda regroup, w, x: (x @ regroup(w, 4, 4).T).view(1, 5, 4, 4).transpose(1, 2),
    lambda w, x: ref.repeat_kv((x @ w.T).view(1, 5, 2, 4).transpose(1, 2), 2),
    atol=1e-6,
    rtol=1e-6,
    hidden=True,
)
case(
    REGROUP, "other sizes", lambda g: (randn(2 ** between(g, 0, 3) * 3, 6, g=g), 3, 8), hidden=True
)

NO_REGROUPING = "a ValueError: neither head count divides the other"


def _regroup_invalid(regroup_kv_heads, w, head_dim, n_kv_new):
    try:
        regroup_kv_heads(w, head_dim, n_kv_new)
    except ValueError:
        return {NO_REGROUPING: True}
    return {NO_REGROUPING: False}


case(REGROUP, "4 -> 3 heads: no such regrouping", lambda g: (NUMBERED, 1, 3), _regroup_invalid)
case(
    REGROUP,
    "4 -> 6 heads, a weight: no such regrouping",
    lambda g: (randn(4 * 8, 16, g=g), 8, 6),
    _regroup_invalid,
    hidden=True,
)


@mistake(
    REGROUP,
    "neither count divides the other (4 KV heads into 3 or 6): there is no such regrouping, so "
    "raise a ValueError naming both counts (not whatever reshape says)",
)
def regroup_unchecked(w, head_dim, n_kv_new):
    n_kv = w.shape[0] // head_dim
    heads = w.reshape(n_kv, head_dim, *w.shape[1:])
    if n_kv_new >= n_kv:
        heads = heads.repeat_interleave(n_kv_new // n_kv, dim=0)
    else:
        group = heads.reshape(n_kv_new, n_kv // n_kv_new, head_dim, *w.shape[1:])
        heads = group.float().mean(dim=1).to(w.dtype)
    return heads.reshape(n_kv_new * head_dim, *w.shape[1:])


@mistake(
    REGROUP,
    "heads tiled (0, 1, 2, 3, 0, 1, ...): each head must be copied next to itself (0, 0, 1, 1, "
    "...), so query head h still finds its KV head at h // n_rep",
)
def regroup_tiled(w, head_dim, n_kv_new):
    n_kv = w.shape[0] // head_dim
    if n_kv_new >= n_kv:
        heads = w.reshape(n_kv, head_dim, *w.shape[1:]).repeat(n_kv_new // n_kv, *[1] * (w.dim()))
        return heads.reshape(n_kv_new * head_dim, *w.shape[1:])
    return lab.regroup_kv_heads(w, head_dim, n_kv_new)


@mistake(
    REGROUP,
    "average *neighbouring* heads (0, 1) and (2, 3), the ones that served neighbouring query "
    "heads, not (0, 2) and (1, 3)",
)
def regroup_strided_mean(w, head_dim, n_kv_new):
    n_kv = w.shape[0] // head_dim
    if n_kv_new >= n_kv:
        return lab.regroup_kv_heads(w, head_dim, n_kv_new)
    heads = w.reshape(n_kv // n_kv_new, n_kv_new, head_dim, *w.shape[1:]).mean(0)
    return heads.reshape(n_kv_new * head_dim, *w.shape[1:])


# --- the model around attention (qwen_mini/decoder.py, weights.py, decoding.py) -------------------

register(
    "ch01.DecoderLayer",
    reference=dec.DecoderLayer,
    points=2,
    title="Pre-norm decoder layer: two residual branches, parts under checkpoint names",
)
register(
    "ch01.model_forward",
    reference=dec.model_forward,
    points=2,
    title="The model's forward pass: embedding, positions after the cache, layers, norm, head",
)
register(
    "ch01.load_weights",
    reference=weights.load_weights,
    points=2,
    title="Loading: checkpoint key for every parameter, the tied head",
)
register(
    "ch01.decode",
    reference=decoding.decode,
    points=2,
    title="Generation loop with the KV cache: prefill once, then one token at a time",
)

LAYER = "ch01.DecoderLayer"


def _norm(dim: int, seed: int) -> RMSNorm:
    norm = RMSNorm(dim)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.rand(dim, generator=seeded(seed)))
    return norm


def _layer_parts(dim, seed):
    return (
        Recorder(dim, seed, True),
        Recorder(dim, seed + 1, False),
        _norm(dim, seed + 2),
        _norm(dim, seed + 3),
    )


def _layer_names(DecoderLayer):
    out = {}
    for name in ("self_attn", "linear_attn"):
        mixer, mlp, n1, n2 = _layer_parts(8, 40)
        layer = DecoderLayer(name, mixer, mlp, n1, n2)
        out[f"parameter names with mixer_name={name!r} (the checkpoint's names)"] = sorted(
            layer.state_dict()
        )
        out[f"layer.mixer and layer.{name} are the mixer given"] = (
            layer.mixer is mixer and getattr(layer, name, None) is mixer
        )
        out["input_layernorm, post_attention_layernorm: the norms given, in that order"] = (
            layer.input_layernorm is n1 and layer.post_attention_layernorm is n2
        )
    return out


def _layer_run(DecoderLayer, mixer_name, B, T, dim, seed):
    """What the mixer and the mlp (recorders) were given, and the layer's output."""
    mixer, mlp, n1, n2 = _layer_parts(dim, seed)
    layer = DecoderLayer(mixer_name, mixer, mlp, n1, n2)
    x = randn(B, T, dim, seed=seed + 4)
    cos, sin, cache = randn(T, 4, seed=seed + 5), randn(T, 4, seed=seed + 6), object()
    with torch.no_grad():
        out = layer(x, cos, sin, cache)
    args = mixer.calls[0][1] if len(mixer.calls) == 1 else ()
    return {
        f"times the mixer ({mixer_name}) ran": len(mixer.calls),
        "the mixer's input: input_layernorm(x)": mixer.calls[0][0] if mixer.calls else None,
        "the mixer got cos, sin and this layer's cache": len(args) >= 3
        and args[0] is cos
        and args[1] is sin
        and args[2] is cache,
        "times the mlp ran": len(mlp.calls),
        "the mlp's input: post_attention_layernorm(h), h = x + mixer(input_layernorm(x))": (
            mlp.calls[0][0] if mlp.calls else None
        ),
        "the layer's output: h + mlp(post_attention_layernorm(h))": out,
    }


def _layer_case(name, mixer_name, B, T, dim, seed, hidden=False, variants=()):
    def call(DecoderLayer):
        return _layer_run(DecoderLayer, mixer_name, B, T, dim, seed)

    case(LAYER, name, lambda g: (), call, atol=1e-5, rtol=1e-4, hidden=hidden, variants=variants)


def _trained_layer(DecoderLayer):
    """A layer and its arguments, for a backward pass (the chapter trains through it)."""
    mixer, mlp, n1, n2 = _layer_parts(8, 41)
    layer = DecoderLayer("self_attn", mixer, mlp, n1, n2)
    return layer, (randn(2, 3, 8, seed=45), randn(3, 4, seed=46), randn(3, 4, seed=47), None)


case(LAYER, "the parts under the checkpoint's names", lambda g: (), _layer_names)
_layer_case(
    "what each branch reads, and the two residuals",
    "self_attn",
    1,
    3,
    8,
    41,
    variants=(backward(_trained_layer, what="decoder layer"),),
)
_layer_case("a linear_attn mixer, batch 2", "linear_attn", 2, 5, 12, 51, hidden=True)
_layer_case("one token, batch 3", "self_attn", 3, 1, 6, 61, hidden=True)


def layer_variant(kind):
    """The reference layer with one stage done wrong."""

    class Wrong(dec.DecoderLayer):
        def __init__(self, mixer_name, mixer, mlp, n1, n2):
            if kind == "fixed_name":
                mixer_name = "self_attn"
            if kind == "swapped_norms":
                n1, n2 = n2, n1
            super().__init__(mixer_name, mixer, mlp, n1, n2)

        def forward(self, x, cos, sin, cache=None):
            m, n1, n2 = self.mixer, self.input_layernorm, self.post_attention_layernorm
            if kind == "post_norm":
                x = n1(x + m(x, cos, sin, cache))
                return n2(x + self.mlp(x))
            if kind == "no_pre_norm":
                x = x + m(x, cos, sin, cache)
                return x + self.mlp(n2(x))
            if kind == "parallel":
                return x + m(n1(x), cos, sin, cache) + self.mlp(n2(x))
            if kind == "no_first_residual":
                x = m(n1(x), cos, sin, cache)
                return x + self.mlp(n2(x))
            if kind == "no_second_residual":
                x = x + m(n1(x), cos, sin, cache)
                return self.mlp(n2(x))
            if kind == "no_cache":
                x = x + m(n1(x), cos, sin, None)
                return x + self.mlp(n2(x))
            return super().forward(x, cos, sin, cache)

    return Wrong


PRE_NORM = (
    "pre-norm: each branch reads its own norm of the stream (the mixer input_layernorm(x), the "
    "mlp post_attention_layernorm(h)); the stream itself is never normalised"
)
for _kind, _idea in {
    "fixed_name": "the checkpoint's names: register the mixer under mixer_name (self_attn or "
    "linear_attn), as the checkpoint stores it",
    "swapped_norms": "input_layernorm normalises the mixer's input, post_attention_layernorm "
    "the mlp's: in that order",
    "post_norm": PRE_NORM,
    "no_pre_norm": PRE_NORM,
    "parallel": "the mlp reads the stream after the mixer's residual addition, "
    "post_attention_layernorm(x + mixer(...)), not the layer's input (a parallel block, not "
    "Qwen's)",
    "no_first_residual": "first residual missing: the stream after the mixer is x + mixer(...), "
    "not mixer(...) alone",
    "no_second_residual": "second residual missing: return h + mlp(post_attention_layernorm(h))",
    "no_cache": "the mixer must get cos, sin and this layer's cache: mixer(norm(x), cos, sin, "
    "cache); without its cache it cannot see the earlier tokens",
}.items():
    mistake(LAYER, _idea, name=f"layer_{_kind}")(layer_variant(_kind))


FORWARD = "ch01.model_forward"


def _tiny_model(seed, qwen3=True, tied=True, n_heads=4, n_kv=2, layers=2, rope_scaling=None):
    cfg = _tiny_cfg(qwen3, n_heads=n_heads, n_kv=n_kv, layers=layers, tied=tied)
    cfg = replace(cfg, rope_scaling=rope_scaling)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CausalLM(cfg)
        with torch.no_grad():  # random norm weights too, so that a skipped norm shows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.5 * torch.rand(p.shape, generator=seeded(seed + p.numel())))
    return model.eval()


class _Calls:
    """Records what each decoder layer, the final norm and the head receive."""

    def __init__(self, model):
        self.layers, self.norm, self.head, self.hooks = [], [], [], []
        for i, layer in enumerate(model.model.layers):
            self.hooks.append(layer.register_forward_pre_hook(self._layer(i), with_kwargs=True))
        self.hooks.append(model.model.norm.register_forward_pre_hook(self._into(self.norm)))
        self.hooks.append(model.lm_head.register_forward_pre_hook(self._into(self.head)))

    def _layer(self, i):
        def hook(module, args, kwargs):
            names = ("x", "cos", "sin", "cache")
            call = dict(zip(names, args, strict=False)) | kwargs
            self.layers.append((i, call))

        return hook

    def _into(self, where):
        def hook(module, args):
            where.append(args[0].detach().clone())

        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()


def _forward_run(model_forward, model, ids, cache=None, last_only=False):
    """The logits, and what the layers, the final norm and the head were given. A layer handed
    something other than its own state may crash inside: that is what is reported then."""
    calls = _Calls(model)
    crash = None
    try:
        with torch.no_grad():
            out = model_forward(model, ids, cache, last_only)
    except NotImplementedError:
        raise
    except Exception as e:
        crash, out = e, None
    finally:
        calls.remove()
    own = all(cache is None or c.get("cache") is cache.layers[i] for i, c in calls.layers)
    if crash is not None and own:
        raise crash
    first = calls.layers[0][1] if calls.layers else {}
    return out, {
        "the layers called, in order, each once": [i for i, _ in calls.layers],
        "each layer got its own state, cache.layers[i]": own,
        "the first layer's input: the embeddings of the ids": first.get("x"),
        "cos given to the layers: rotary_cos_sin(config, positions of the new tokens)": first.get(
            "cos"
        ),
        "sin given to the layers": first.get("sin"),
        "times the final norm (model.model.norm) ran": len(calls.norm),
        "positions the head was applied to": [h.shape[1] for h in calls.head],
    }


def _forward_plain(model_forward, seed, B, T, dtype=torch.float32):
    model = _tiny_model(seed).to(dtype)
    ids = torch.randint(0, 64, (B, T), generator=seeded(seed + 1))
    out, stages = _forward_run(model_forward, model, ids)
    return stages | {"logits [B, T, vocab]": out}


def _forward_cached(model_forward, seed, cached, T, last_only, B=1, **model):
    """`T` tokens after `cached` in the package's cache (and the pass's effect on it), then
    the whole sequence with last_only."""
    model = _tiny_model(seed, **model)
    ids = torch.randint(0, 64, (B, cached + T), generator=seeded(seed + 1))
    with torch.no_grad():
        cache = model.new_cache(B)
        model(ids[:, :cached], cache=cache)  # the package's pass commits them
    out, stages = _forward_run(model_forward, model, ids[:, cached:], cache, last_only)
    stages = {f"after {cached} cached: {k}": v for k, v in stages.items()}
    stages[f"cache.length after the pass (still {cached}: the model commits it, not yours)"] = (
        cache.length
    )
    stages[f"logits of {T} tokens after {cached} cached"] = out
    if not last_only:
        whole, more = _forward_run(model_forward, model, ids, None, last_only=True)
        stages["with last_only: positions the head was applied to (1: only the last)"] = more[
            "positions the head was applied to"
        ]
        stages["with last_only: the logits of the last position"] = whole
    return stages


def _forward_yarn(model_forward):
    # YaRN (what Qwen3's model card adds to config.json past 32k tokens) changes every angle
    yarn = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=32)
    model = _tiny_model(76, rope_scaling=yarn)
    ids = torch.randint(0, 64, (1, 6), generator=seeded(77))
    out, stages = _forward_run(model_forward, model, ids)
    return stages | {"logits of the YaRN-scaled model": out}


# a bfloat16 model: the angles in bfloat16 like the embeddings (rotary_cos_sin(..., x.dtype));
# positions made on the ids' device
_FORWARD_VARIANTS = (
    bfloat16(call=lambda f: _forward_plain(f, 70, 2, 5, torch.bfloat16)),
    "meta",
)
for _name, _call, _hidden in [
    ("no cache: layers, positions, final norm, head", lambda f: _forward_plain(f, 70, 2, 5), False),
    (
        "3 tokens after 4 cached, and last_only",
        lambda f: _forward_cached(f, 72, 4, 3, False),
        False,
    ),
    ("the angles of a config with RoPE scaling", _forward_yarn, False),
    (
        "one token after 5 cached, batch 3, untied Qwen2 with 6 heads on 1",
        lambda f: _forward_cached(
            f, 74, 5, 1, True, 3, qwen3=False, tied=False, n_heads=6, n_kv=1, layers=3
        ),
        True,
    ),
]:
    case(
        FORWARD,
        _name,
        lambda g: (),
        _call,
        atol=1e-5,
        rtol=1e-4,
        hidden=_hidden,
        variants=_FORWARD_VARIANTS if _name.startswith("no cache") else (),
    )


def forward_variant(kind):
    """The reference forward pass with one stage done wrong."""

    def model_forward(model, input_ids, cache=None, last_only=False):
        cfg, backbone = model.config, model.model
        start = cache.length if cache is not None and kind != "positions_from_0" else 0
        x = backbone.embed_tokens(input_ids)
        positions = torch.arange(start, start + input_ids.shape[1])
        if kind == "plain_rope":  # ignores the config's RoPE scaling
            cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
        else:
            cos, sin = rotary_cos_sin(cfg, positions, x.dtype)
        for i, layer in enumerate(backbone.layers):
            state = None if cache is None else cache.layers[i]
            if kind == "whole_cache" and cache is not None:
                state = cache
            x = layer(x, cos, sin, state)
        if kind != "no_final_norm":
            x = backbone.norm(x)
        if kind == "commits" and cache is not None:
            cache.commit(input_ids.shape[1])
        if last_only and kind != "head_on_all":
            x = x[:, -1:]
        logits = model.lm_head(x)
        return logits[:, -1:] if last_only and kind == "head_on_all" else logits

    return model_forward


for _kind, _idea in {
    "positions_from_0": "positions: with a cache holding cache.length tokens the new tokens are "
    "positions cache.length, cache.length + 1, ...; yours start at 0",
    "whole_cache": "layer i must get its own state, cache.layers[i], not the whole cache",
    "commits": "model_forward must not commit or advance the cache: the model commits it once "
    "the pass has finished",
    "no_final_norm": "the final norm (model.model.norm) must run once, before the head",
    "head_on_all": "with last_only the head was applied to every position: slice the last one "
    "first (x[:, -1:]), then apply lm_head, the costliest matmul of a step",
    "plain_rope": "with rope_scaling in the config (here YaRN, factor 4) the angles differ from "
    "plain RoPE's at every position: take them from rotary_cos_sin(model.config, positions, "
    "dtype), which applies the scaling, not from rope_cos_sin",
}.items():
    mistake(FORWARD, _idea, name=f"forward_{_kind}")(forward_variant(_kind))


# loading

LOAD = "ch01.load_weights"


def _header_of(state: dict) -> dict:
    return {
        k: {"dtype": "F32", "shape": list(v.shape), "data_offsets": [0, 0]}
        for k, v in state.items()
    }


def _checkpoint(model, prefix="model."):
    """The checkpoint of `model`, by checkpoint name (a tied head is not stored)."""
    tied = model.config.tie_word_embeddings
    out = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        key = prefix + name.removeprefix("model.") if name.startswith("model.") else name
        out[key] = t.detach().clone()
    return out


def _load(load_weights, model, stored, prefix="model.", missing=False):
    """Load `stored` into an empty (meta) model of `model`'s config: (the model, the returned
    map, the keys read in order). `missing`: a tensor is missing from `stored`, so the KeyError
    raised is the answer, returned as text; elsewhere a KeyError is the code's own error, and is
    raised as such (so the message says which key, and where)."""
    reads = []

    def get_tensor(key):
        reads.append(key)
        return stored[key]

    target = meta_model(model.config)
    try:
        sources = load_weights(target, _header_of(stored), get_tensor, prefix)
    except KeyError as e:  # a key the checkpoint does not hold: which one is what matters
        if not missing:
            raise
        return target, f"KeyError: {e}", reads
    return target, sources, reads


def _weights(target, model) -> dict:
    """Each parameter as loaded (the text "not filled" where it is still on the meta device)."""
    got = target.state_dict()
    return {
        name: "not filled (still on the meta device)"
        if got.get(name) is None or got[name].is_meta
        else got[name]
        for name in model.state_dict()
    }


def _load_untied(load_weights, dtype=torch.float32):
    model = _tiny_model(80, tied=False).to(dtype)
    stored = _checkpoint(model)
    stored["model.rotary_emb.inv_freq"] = torch.zeros(4)  # a tensor the model does not use
    target, sources, reads = _load(load_weights, model, stored)
    w = target.model.layers[0].self_attn.q_proj.weight
    return {
        "returned {parameter: checkpoint key} (here the names agree)": sources,
        "each needed tensor read once, nothing else": sorted(reads),
        "every parameter filled with the checkpoint's tensor": _weights(target, model),
        "parameters are the tensors get_tensor returned (assign=True), not copies": (
            w.data_ptr() == stored["model.layers.0.self_attn.q_proj.weight"].data_ptr()
        ),
    }


def _load_tied(load_weights):
    model = _tiny_model(81, tied=True)
    stored = _checkpoint(model)
    # a stored copy of the head, as Qwen3-0.6B's file has; made different here so it shows
    stored["lm_head.weight"] = stored["model.embed_tokens.weight"] + 1
    target, sources, reads = _load(load_weights, model, stored)
    tied = {
        "the source of lm_head.weight (tied: the embedding)": sources.get("lm_head.weight")
        if isinstance(sources, dict)
        else sources,
        "the keys read (each needed tensor once, not the stored copy of the head)": sorted(reads),
        "lm_head.weight after loading": target.lm_head.weight
        if not target.lm_head.weight.is_meta
        else "not filled",
        "lm_head.weight is the same Parameter as model.embed_tokens.weight": (
            target.lm_head.weight is target.model.embed_tokens.weight
        ),
    }
    del stored["lm_head.weight"]  # most tied checkpoints store no head at all
    target, _, _ = _load(load_weights, model, stored)
    return tied | {"a tied checkpoint without a head: the parameters": _weights(target, model)}


def _load_prefixed(load_weights):
    model = _tiny_model(82, tied=True)
    prefix = "model.language_model."  # Qwen3.5: the text model inside a multimodal checkpoint
    stored = _checkpoint(model, prefix)
    stored["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    target, sources, _ = _load(load_weights, model, stored, prefix)
    key = sources.get("model.norm.weight") if isinstance(sources, dict) else sources
    out = {
        f"checkpoint key of model.norm.weight with prefix {prefix!r}": key,
        "the parameters": _weights(target, model),
    }
    missing = prefix + "layers.1.mlp.up_proj.weight"
    del stored[missing]
    _, raised, _ = _load(load_weights, model, stored, prefix, missing=True)
    out["a tensor missing from the checkpoint raises KeyError naming it"] = (
        isinstance(raised, str) and missing in raised
    )
    return out


def _load_qwen2(load_weights):
    model = _tiny_model(83, qwen3=False, tied=False, n_heads=6, n_kv=3, layers=3)
    target, sources, _ = _load(load_weights, model, _checkpoint(model))
    return {
        "lm_head of an untied model": sources.get("lm_head.weight")
        if isinstance(sources, dict)
        else sources,
        "the parameters": _weights(target, model),
    }


case(
    LOAD,
    "an untied model: the map, the reads, the tensors themselves",
    lambda g: (),
    _load_untied,
    # a bfloat16 checkpoint loads as bfloat16 (the empty model is float32: no cast to it)
    variants=(bfloat16(call=lambda load_weights: _load_untied(load_weights, torch.bfloat16)),),
)
case(LOAD, "a tied head, with and without a stored copy", lambda g: (), _load_tied)
case(LOAD, "a checkpoint with a prefix, and a missing tensor", lambda g: (), _load_prefixed)
case(LOAD, "an untied Qwen2 of 3 layers", lambda g: (), _load_qwen2, hidden=True)


def load_variant(kind):
    """The reference loader with one step done wrong."""

    def load_weights(model, header, get_tensor, prefix="model."):
        tied = model.config.tie_word_embeddings
        sources = {}
        for name in model.state_dict():
            key = name
            if kind != "no_prefix" and name.startswith("model."):
                key = prefix + name.removeprefix("model.")
            if tied and name == "lm_head.weight" and kind != "stored_copy":
                key = prefix + "embed_tokens.weight"
            if tied and name == "lm_head.weight" and kind == "stored_copy" and key not in header:
                key = prefix + "embed_tokens.weight"
            if key not in header:
                raise KeyError(key)
            sources[name] = key
        if kind == "read_twice":
            state = {n: get_tensor(k) for n, k in sources.items()}
        else:
            tensors = {k: get_tensor(k) for k in dict.fromkeys(sources.values())}
            state = {n: tensors[k] for n, k in sources.items()}
        with warnings.catch_warnings():  # torch warns about copying into a meta model
            warnings.simplefilter("ignore")
            model.load_state_dict(state, strict=True, assign=kind != "no_assign")
        if tied and kind != "no_retie":
            model.lm_head.weight = model.model.embed_tokens.weight
        return sources

    return load_weights


for _kind, _idea in {
    "no_retie": "tied head: after loading, lm_head.weight must be the same Parameter as "
    "model.embed_tokens.weight (assign=True made two; tie them again)",
    "stored_copy": "tied head: lm_head.weight is filled from model.embed_tokens.weight (it is "
    "the embedding); the stored copy must not be read",
    "no_prefix": "prefix: this checkpoint keeps the text model under 'model.language_model.', so "
    "model.norm.weight is stored as 'model.language_model.norm.weight'",
    "no_assign": "a model built on the meta device has no memory to copy into: "
    "load_state_dict(..., assign=True) puts the checkpoint's tensors in place of its parameters",
    "read_twice": "read each needed tensor once: a tensor read twice (the tied head's source) "
    "is read twice from the file",
}.items():
    mistake(LOAD, _idea, name=f"load_{_kind}")(load_variant(_kind))


# generation

DECODE = "ch01.decode"


def _reference_tokens(model, prompt, n, choose, stop=()):
    """Recompute the whole sequence at every step, no cache: independent of any cache code."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            token = choose(model(torch.tensor([ids]))[0, -1])
            out.append(token)
            if token in stop:
                break
            ids.append(token)
    return out


def _second_best(logits):
    return int(logits.topk(2).indices[1])


def _decode_run(decode, seed, prompt_len, n, choose=None, stop=None, stop_at=None):
    """The tokens, and how the model was called (a Watched model records its calls)."""
    model = _tiny_model(seed)
    prompt = torch.randint(0, 64, (prompt_len,), generator=seeded(seed + 1)).tolist()
    if stop_at is not None:  # stop at the token greedy decoding reaches at step `stop_at`
        stop = {_reference_tokens(model, prompt, stop_at + 1, decoding.greedy)[stop_at]}
    watched = Watched(model)
    kwargs = {"choose": choose} if choose is not None else {}
    if stop is not None:
        kwargs["stop"] = stop
    with torch.no_grad():
        got = list(decode(watched, prompt, n, **kwargs))
    cache = watched.caches[0] if watched.caches else None
    what = f"{n} at most" + (", ending at a stop id" if stop else "")
    return {
        "times model.new_cache() was called (one cache for the whole generation)": len(
            watched.caches
        ),
        "tokens fed at each call (the prompt once, then 1 a call)": [
            c[0].shape[1] for c in watched.calls
        ],
        "every call passes that cache": all(c[1] is cache for c in watched.calls),
        "every call asks for the last position only (last_only=True)": all(
            c[2] for c in watched.calls
        ),
        "each step feeds the token chosen before it": [int(c[0][0, 0]) for c in watched.calls[1:]]
        == got[: len(watched.calls) - 1],
        f"the tokens ({what}; prompt of {prompt_len})": got,
    }


def _decode_case(name, *args, hidden=False, variants=(), **kwargs):
    def call(decode):
        return _decode_run(decode, *args, **kwargs)

    def expected():  # how the package calls the model; the tokens recomputed without a cache
        return _decode_run(decoding.decode, *args, **kwargs) | _decode_tokens(*args, **kwargs)

    case(DECODE, name, lambda g: (), call, expected, hidden=hidden, variants=variants)


def _decode_tokens(seed, prompt_len, n, choose=None, stop=None, stop_at=None):
    model = _tiny_model(seed)
    prompt = torch.randint(0, 64, (prompt_len,), generator=seeded(seed + 1)).tolist()
    if stop_at is not None:
        stop = {_reference_tokens(model, prompt, stop_at + 1, decoding.greedy)[stop_at]}
    what = f"{n} at most" + (", ending at a stop id" if stop else "")
    tokens = _reference_tokens(model, prompt, n, choose or decoding.greedy, stop or ())
    return {f"the tokens ({what}; prompt of {prompt_len})": tokens}


def _first_tokens(decode):
    """A generation of 40 tokens, and the model calls it has made so far."""
    watched = Watched(_tiny_model(90))
    prompt = torch.randint(0, 64, (5,), generator=seeded(91)).tolist()
    return decode(watched, prompt, 40), lambda: len(watched.calls)


_decode_case(
    "greedy, 6 tokens after a prompt of 5",
    90,
    5,
    6,
    variants=(lazy(_first_tokens, take=3, what="generation", name="3 of 40 tokens taken"),),
)
_decode_case("0 tokens asked for", 91, 3, 0)
_decode_case("choose picks the second best", 92, 4, 5, choose=_second_best)
_decode_case("a stop id reached at step 2", 93, 3, 8, stop_at=2)
_decode_case("choose, and a stop id never reached", 94, 9, 7, _second_best, {-1}, hidden=True)
_decode_case("a prompt of 1", 95, 1, 4, hidden=True)


def decode_variant(kind):
    """The reference generation loop with one step done wrong."""

    def decode(model, prompt_ids, max_new_tokens, choose=decoding.greedy, stop=()):
        device = next(model.parameters()).device
        ids = list(prompt_ids)
        cache = model.new_cache(batch_size=1) if kind != "no_cache" else None
        feed = torch.tensor([ids], device=device)
        n = max_new_tokens - 1 if kind == "one_short" else max_new_tokens
        for _ in range(n):
            if kind == "new_cache_each_step":
                cache = model.new_cache(batch_size=1)
                feed = torch.tensor([ids], device=device)
            if kind == "no_cache":
                feed = torch.tensor([ids], device=device)
            logits = model(feed, cache=cache, last_only=True)[0, -1]
            token = int(logits.argmax()) if kind == "ignores_choose" else choose(logits)
            if kind == "hides_stop" and token in stop:
                return
            yield token
            if token in stop and kind != "never_stops":
                return
            ids.append(token)
            feed = torch.tensor([[token]], device=device)

    return decode


for _kind, _idea in {
    "no_cache": "one cache for the whole generation: model.new_cache() once, then feed only the "
    "token just chosen",
    "new_cache_each_step": "one cache for the whole generation: new_cache() was called at every "
    "step, so every step recomputes the whole sequence",
    "ignores_choose": "pick each token with choose(logits), not always the argmax",
    "hides_stop": "yield the stop id too, then end (the caller sees why it ended)",
    "never_stops": "after yielding an id in `stop`, end the generation",
    "one_short": "max_new_tokens: yield that many ids (unless a stop id ends it first)",
}.items():
    mistake(DECODE, _idea, name=f"decode_{_kind}")(decode_variant(_kind))
