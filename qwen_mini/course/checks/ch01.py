"""Checks for chapter 1 (attention: causal mask, MHA -> MQA -> GQA, KV cache, KV bytes).

The pure exercises are lists of cases with a catalogue of typical mistakes whose ideas the messages
name; the stateful ones (the KV cache, the attention module, the decoder layer, the model's forward,
the loader, decoding) are check functions that diagnose stage by stage. The expected values come
from the package reference, from values worked out by hand, and from independent references such
as `torch.nn.functional.scaled_dot_product_attention`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from qwen_mini import attention as ref
from qwen_mini import decoder as dec
from qwen_mini.architectures import ARCHITECTURES
from qwen_mini.checkpoint import meta_model
from qwen_mini.config import Config, RopeScaling
from qwen_mini.course.checking import (
    between,
    case,
    expect_close,
    expect_equal,
    hidden,
    mistake,
    public,
    randn,
    register,
    seeded,
)
from qwen_mini.course.fakes.ch01 import Recorder, SpyCache, Watched
from qwen_mini.course.lab import ch01 as lab
from qwen_mini.course.observing import observe
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


case(MASK, "causal_mask(3, 3)", lambda g: (3, 3), _mask, _allowed([1, 0, 0], [1, 1, 0], [1, 1, 1]))
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
    "bfloat16 q, k: softmax in float32, weights cast back to q.dtype",
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
case(REPEAT, "repeat_kv([2, 4, 5, 8], 2)", lambda g: (randn(2, 4, 5, 8, g=g), 2), seed=18)
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


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@public("ch01.KVCache")
def _(KVCache):
    """length, views, growth by doubling"""
    cache = KVCache(1, 2, 4, dtype=torch.float32)
    k1, v1 = _kv(3, 70)
    k, _ = cache.update(k1, v1)
    if cache.length != 0:
        raise AssertionError(
            f"update must not advance length (it is {cache.length} after update): the model "
            "calls commit() once every layer has run, so a failed pass changes nothing"
        )
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
    if copies:
        raise AssertionError(
            f"update returned copies in {copies} of 200 steps: return slices of the storage "
            "(self.k[:, :, :end]), which cost nothing, not new tensors"
        )
    if moves > 8:
        raise AssertionError(
            f"the storage was reallocated {moves} times in 200 one-token steps: appending with "
            "torch.cat (or growing by the tokens needed) copies the whole cache every step; "
            "write into free slots and grow by doubling (_grow) when they run out"
        )


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


def _pair(Attention, cfg, seed):
    torch.manual_seed(seed)
    reference = ref.Attention(cfg, 1, _row(cfg))
    with torch.no_grad():  # random norm weights too, so that a skipped QK-Norm shows
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=seeded(seed + p.numel())) * 0.3)
    mine = Attention(cfg, 1, _row(cfg))
    mine.load_state_dict(reference.state_dict())
    return mine, reference


def _rope(cfg, start, T):
    return rope_cos_sin(torch.arange(start, start + T), cfg.head_dim, cfg.rope_theta)


def _inputs_of(module, where: list):
    def hook(mod, args):
        where.append(args[0].detach().clone())

    return module.register_forward_pre_hook(hook)


def _attention_stages(Attention, cfg, seed, B=1, cached=0, T=4):
    """Run the learner's layer (after `cached` tokens in a cache, or with no cache) and say
    which stage first differs: QK-Norm, its order with RoPE, the cache, the grouping of KV heads,
    the mask, the output."""
    mine, reference = _pair(Attention, cfg, seed)
    H, H_kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = randn(B, cached + T, cfg.hidden_size, seed=seed + 1)
    cache = None
    with torch.no_grad():
        if cached:
            cache = SpyCache(B, H_kv, D, dtype=torch.float32)
            reference(x[:, :cached], *_rope(cfg, 0, cached), cache)
            cache.commit(cached)
            cache.stored.clear()
        xn = x[:, cached:]
        cos, sin = _rope(cfg, cached, T)
        q = ref.split_heads(reference.q_proj(xn), H)  # [B, H, T, D]
        k = ref.split_heads(reference.k_proj(xn), H_kv)
        v = ref.split_heads(reference.v_proj(xn), H_kv)
        if _row(cfg).qk_norm:
            qn, kn = reference.q_norm(q), reference.k_norm(k)
        else:
            qn, kn = q, k
        qr, kr = apply_rope(qn, cos, sin), apply_rope(kn, cos, sin)
        k_all, v_all = kr, v
        if cached:
            k_all = torch.cat([cache.k[:, :, :cached], kr], 2)
            v_all = torch.cat([cache.v[:, :, :cached], v], 2)

        seen_q, seen_o = [], []
        hooks = [_inputs_of(mine.o_proj, seen_o)]
        if _row(cfg).qk_norm and getattr(mine, "q_norm", None) is not None:
            hooks.append(_inputs_of(mine.q_norm, seen_q))
        crash = None
        try:
            got = mine(xn, cos, sin, cache)
        except NotImplementedError:
            raise
        except Exception as e:  # diagnose from what the stages recorded, then report the crash
            crash = e
        finally:
            for h in hooks:
                h.remove()

        if _row(cfg).qk_norm:
            if not seen_q and crash is not None:
                raise crash
            if not seen_q:
                raise AssertionError("QK-Norm skipped: normalise each query head with self.q_norm")
            s = seen_q[0]
            if tuple(s.shape) == (B, T, H, D):  # normalised before the transpose: as transformers
                s = s.transpose(1, 2)
            if tuple(s.shape) != tuple(q.shape):
                raise AssertionError(
                    f"QK-Norm is per head: q_norm takes the split heads {list(q.shape)} (RMSNorm "
                    f"over each head's head_dim), got {list(s.shape)}"
                )
            if _close(s, apply_rope(q, cos, sin)):
                raise AssertionError(
                    "order of QK-Norm and RoPE: normalise first, then rotate (transformers: "
                    "self.q_norm(self.q_proj(x)...) and only then apply_rotary_pos_emb)"
                )
            if not _close(s, q):
                raise AssertionError("projections: q_norm's input differs from split q_proj(x)")
        if cached:
            if not cache.stored and crash is not None:
                raise crash
            if not cache.stored:
                raise AssertionError(
                    "with a cache, store the new keys and values: k, v = cache.update(k, v)"
                )
            sk, sv = cache.stored[0]
            if sk.shape[1] != H_kv:
                raise AssertionError(
                    f"the cache stores the {H_kv} KV heads before repeat_kv, got {sk.shape[1]} "
                    "heads: repeated heads cost n_rep times the memory and hold nothing new"
                )
            if _close(sk, kn) and not _close(sk, kr):
                raise AssertionError(
                    "keys are cached after RoPE (a token's rotation never changes), yours before"
                )
            if _row(cfg).qk_norm and _close(sk, apply_rope(k, cos, sin)):
                raise AssertionError("the cached keys skipped QK-Norm (self.k_norm)")
            expect_close("keys given to cache.update", sk, kr, atol=1e-5, rtol=1e-4)
            expect_close("values given to cache.update", sv, v, atol=1e-5, rtol=1e-4)
        if crash is not None:
            raise crash
        if not seen_o:
            raise AssertionError("o_proj was not applied to the merged heads")
        n_rep, t_total = H // H_kv, k_all.shape[2]

        def attend(kk, vv, **mask):
            return ref.merge_heads(F.scaled_dot_product_attention(qr, kk, vv, **mask))

        inter = (ref.repeat_kv(k_all, n_rep), ref.repeat_kv(v_all, n_rep))
        tiled = (k_all.repeat(1, n_rep, 1, 1), v_all.repeat(1, n_rep, 1, 1))
        right = {"attn_mask": ref.causal_mask(T, t_total)}
        o = seen_o[0]
        if not _close(o, attend(*inter, **right)):
            if n_rep > 1 and _close(o, attend(*tiled, **right)):
                raise AssertionError(
                    "grouping of KV heads: tiled (0, 1, 0, 1, ...); query head h reads KV head "
                    "h // n_rep (neighbours share), as repeat_kv does"
                )
            if T > 1 and _close(o, attend(*inter)):
                raise AssertionError("mask: no causal mask, so tokens see the future")
            if cached and T > 1 and _close(o, attend(*inter, is_causal=True)):
                raise AssertionError(
                    "mask: is_causal=True is the top-left triangle; queries after a cache need "
                    "the offset mask causal_mask(T, T_total)"
                )
            raise AssertionError(
                "the attention output (o_proj's input) differs from the reference; the "
                "projections, QK-Norm and cache agree, so look at RoPE, repeat_kv or the merge"
            )
        expected = reference.o_proj(attend(*inter, **right))
        expect_close("output of the layer (o_proj of the heads)", got, expected, 1e-5, 1e-4)


@public("ch01.Attention")
def _(Attention):
    """stages, no cache"""
    _attention_stages(Attention, _tiny_cfg(qwen3=True), 130, B=2, cached=0, T=5)


@public("ch01.Attention")
def _(Attention):
    """stages, 3 new tokens after 4 cached"""
    _attention_stages(Attention, _tiny_cfg(qwen3=True), 131, B=1, cached=4, T=3)


@hidden("ch01.Attention")
def _(Attention):
    cfg = _tiny_cfg(qwen3=True, n_heads=6, n_kv=3, head_dim=4)
    _attention_stages(Attention, cfg, 132, B=2, cached=5, T=2)
    _attention_stages(Attention, cfg, 133, B=1, cached=3, T=1)
    _attention_stages(Attention, _tiny_cfg(qwen3=False, n_heads=4, n_kv=1), 134, 1, 2, 4)


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


# --- the model around attention (qwen_mini/decoder.py) ------------------------------------------

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
    reference=dec.load_weights,
    points=2,
    title="Loading: checkpoint key for every parameter, the tied head",
)
register(
    "ch01.decode",
    reference=dec.decode,
    points=2,
    title="Generation loop with the KV cache: prefill once, then one token at a time",
)


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


def _close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def _check_layer(DecoderLayer, mixer_name, B, T, dim, seed):
    mixer, mlp, n1, n2 = _layer_parts(dim, seed)
    layer = DecoderLayer(mixer_name, mixer, mlp, n1, n2)
    x = randn(B, T, dim, seed=seed + 4)
    cos, sin, cache = randn(T, 4, seed=seed + 5), randn(T, 4, seed=seed + 6), object()
    with torch.no_grad():
        out = layer(x, cos, sin, cache)
        if len(mixer.calls) != 1:
            raise AssertionError(f"the mixer ({mixer_name}) ran {len(mixer.calls)} times, not once")
        seen, args = mixer.calls[0]
        if not _close(seen, n1(x)):
            if _close(seen, x):
                raise AssertionError(
                    "pre-norm: the mixer reads input_layernorm(x), the normalised stream; "
                    "you gave it x itself"
                )
            if _close(seen, n2(x)):
                raise AssertionError(
                    "the mixer reads input_layernorm(x); you normalised with "
                    "post_attention_layernorm (that one is for the mlp)"
                )
            raise AssertionError("the mixer's input differs from input_layernorm(x)")
        if len(args) < 3 or args[0] is not cos or args[1] is not sin or args[2] is not cache:
            raise AssertionError(
                "the mixer must get cos, sin and this layer's cache: mixer(norm(x), cos, sin, "
                "cache) — without its cache it cannot see the earlier tokens"
            )
        h = x + mixer.proj(n1(x))  # the stream after the first residual branch
        if len(mlp.calls) != 1:
            raise AssertionError(f"the mlp ran {len(mlp.calls)} times, not once")
        seen = mlp.calls[0][0]
        if not _close(seen, n2(h)):
            if _close(seen, n2(x)):
                raise AssertionError(
                    "the mlp must read the stream after the mixer's residual addition, "
                    "post_attention_layernorm(x + mixer(...)); yours reads the layer's input "
                    "(a parallel block, not Qwen's)"
                )
            if _close(seen, h):
                raise AssertionError("pre-norm: the mlp reads post_attention_layernorm(h), not h")
            if _close(seen, n1(h)):
                raise AssertionError(
                    "the mlp reads post_attention_layernorm(h); you used input_layernorm"
                )
            if _close(seen, n2(mixer.proj(n1(x)))):
                raise AssertionError(
                    "first residual missing: the stream after the mixer is x + mixer(...), "
                    "not mixer(...) alone"
                )
            raise AssertionError("the mlp's input differs from post_attention_layernorm(x + mixer)")
        expected = h + mlp.proj(n2(h))
        if not _close(out, expected):
            if _close(out, mlp.proj(n2(h))):
                raise AssertionError("second residual missing: return h + mlp(norm(h))")
            if _close(out, n2(expected)) or _close(out, n1(expected)):
                raise AssertionError(
                    "post-norm: the stream itself is never normalised in a pre-norm layer; "
                    "only each branch's input is"
                )
        expect_close("decoder layer output", out, expected, atol=1e-5, rtol=1e-4)


@public("ch01.DecoderLayer")
def _(DecoderLayer):
    for name in ("self_attn", "linear_attn"):
        mixer, mlp, n1, n2 = _layer_parts(8, 40)
        layer = DecoderLayer(name, mixer, mlp, n1, n2)
        expect_equal(
            f"parameter names with mixer_name={name!r} (the checkpoint's names)",
            sorted(layer.state_dict()),
            sorted(
                [f"{name}.proj.weight", "mlp.proj.weight"]
                + ["input_layernorm.weight", "post_attention_layernorm.weight"]
            ),
        )
        if layer.mixer is not mixer or getattr(layer, name, None) is not mixer:
            raise AssertionError(f"layer.{name} must be the mixer it was given")
        if layer.input_layernorm is not n1 or layer.post_attention_layernorm is not n2:
            raise AssertionError(
                "input_layernorm and post_attention_layernorm must be the norms given, in that "
                "order (the first normalises the mixer's input, the second the mlp's)"
            )


@public("ch01.DecoderLayer")
def _(DecoderLayer):
    _check_layer(DecoderLayer, "self_attn", 1, 3, 8, 41)


@hidden("ch01.DecoderLayer")
def _(DecoderLayer):
    _check_layer(DecoderLayer, "linear_attn", 2, 5, 12, 51)
    _check_layer(DecoderLayer, "self_attn", 3, 1, 6, 61)


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


def _run_forward(model_forward, model, ids, cache=None, last_only=False):
    calls = _Calls(model)
    try:
        with torch.no_grad():
            out = model_forward(model, ids, cache, last_only)
    except NotImplementedError:
        raise
    except Exception:
        _check_states(calls, cache)  # a whole Cache handed to a layer crashes inside it
        raise
    finally:
        calls.remove()
    return out, calls


def _check_states(calls, cache):
    for i, call in calls.layers:
        if cache is not None and call.get("cache") is not cache.layers[i]:
            raise AssertionError(
                f"layer {i} must get its own state, cache.layers[{i}] (got "
                f"{type(call.get('cache')).__name__})"
            )


def _check_positions(calls, model, start, T):
    cfg = model.config
    if not calls.layers:
        raise AssertionError("no decoder layer was called")
    order = [i for i, _ in calls.layers]
    expect_equal("the layers called, in order (each once)", order, list(range(len(order))))
    expect_equal("number of layers called", len(order), cfg.num_hidden_layers)
    cos, sin = rope_cos_sin(torch.arange(start, start + T), cfg.rotary_dim, cfg.rope_theta)
    got = calls.layers[0][1].get("cos")
    if got is None or tuple(got.shape) != tuple(cos.shape):
        raise AssertionError(
            f"the layers get the RoPE angles of the new tokens: cos of shape {tuple(cos.shape)}"
        )
    if not _close(got, cos):
        for wrong in range(0, start + T + 1):
            w, _ = rope_cos_sin(torch.arange(wrong, wrong + T), cfg.rotary_dim, cfg.rope_theta)
            if _close(got, w):
                raise AssertionError(
                    f"positions: with {start} tokens in the cache the new tokens are positions "
                    f"{start}..{start + T - 1}; your angles are those of positions "
                    f"{wrong}..{wrong + T - 1}"
                )
        raise AssertionError("the layers' cos differs from rope_cos_sin of the new positions")
    expect_close("sin given to the layers", calls.layers[0][1].get("sin"), sin, atol=1e-6, rtol=0)


@public("ch01.model_forward")
def _(model_forward):
    model = _tiny_model(70)
    ids = torch.randint(0, 64, (2, 5), generator=seeded(71))
    out, calls = _run_forward(model_forward, model, ids)
    _check_positions(calls, model, 0, 5)
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
    expect_close("the first layer's input: the embeddings", calls.layers[0][1]["x"], x, 0, 0)
    if len(calls.norm) != 1:
        raise AssertionError("the final norm (model.model.norm) must run once, before the head")
    expect_equal("logits shape", tuple(out.shape), (2, 5, 64))
    with torch.no_grad():
        expected = dec.model_forward(model, ids)
    expect_close("logits", out, expected, atol=1e-5, rtol=1e-4)


@public("ch01.model_forward")
def _(model_forward):
    model = _tiny_model(72)
    ids = torch.randint(0, 64, (1, 7), generator=seeded(73))
    with torch.no_grad():
        full = model(ids)  # one pass over all 7 tokens, no cache
        cache = model.new_cache(1)
        model(ids[:, :4], cache=cache)  # 4 tokens cached (the package's pass commits them)
    out, calls = _run_forward(model_forward, model, ids[:, 4:], cache)
    _check_positions(calls, model, 4, 3)
    _check_states(calls, cache)
    if cache.length != 4:
        raise AssertionError(
            "model_forward must not commit or advance the cache (cache.length went from 4 to "
            f"{cache.length}): the model commits it once the pass has finished"
        )
    expect_close("3 tokens after 4 cached == the full pass's last 3", out, full[:, 4:], 1e-5, 1e-4)
    out, calls = _run_forward(model_forward, model, ids, None, last_only=True)
    expect_equal("logits shape with last_only", tuple(out.shape), (1, 1, 64))
    expect_close("last_only logits == the full pass's last position", out, full[:, -1:], 1e-5, 1e-4)
    expect_equal(
        "positions the head was applied to with last_only (1: only the last one)",
        calls.head[0].shape[1],
        1,
    )


@public("ch01.model_forward", "the angles of a config with RoPE scaling")
def _(model_forward):
    # YaRN (what Qwen3's model card adds to config.json past 32k tokens) changes every angle
    yarn = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=32)
    model = _tiny_model(76, rope_scaling=yarn)
    ids = torch.randint(0, 64, (1, 6), generator=seeded(77))
    out, calls = _run_forward(model_forward, model, ids)
    cos, sin = rotary_cos_sin(model.config, torch.arange(6))
    got = calls.layers[0][1].get("cos") if calls.layers else None
    if got is None or tuple(got.shape) != tuple(cos.shape) or not _close(got, cos):
        raise AssertionError(
            "with rope_scaling in the config (here YaRN, factor 4) the angles differ from plain "
            "RoPE's at every position: take them from rotary_cos_sin(model.config, positions, "
            "dtype), which applies the scaling, not from rope_cos_sin"
        )
    with torch.no_grad():
        expected = dec.model_forward(model, ids)
    expect_close("logits of the YaRN-scaled model", out, expected, atol=1e-5, rtol=1e-4)


@hidden("ch01.model_forward")
def _(model_forward):
    model = _tiny_model(74, qwen3=False, tied=False, n_heads=6, n_kv=1, layers=3)
    ids = torch.randint(0, 64, (3, 6), generator=seeded(75))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(3)
        model(ids[:, :5], cache=cache)
    out, calls = _run_forward(model_forward, model, ids[:, 5:], cache, last_only=True)
    _check_positions(calls, model, 5, 1)
    expect_close("one token after 5 cached, batch 3", out, full[:, -1:], atol=1e-5, rtol=1e-4)


# loading


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


def _load(load_weights, model, stored, prefix="model."):
    reads = []

    def get_tensor(key):
        reads.append(key)
        return stored[key]

    target = meta_model(model.config)
    sources = load_weights(target, _header_of(stored), get_tensor, prefix)
    twice = sorted({k for k in reads if reads.count(k) > 1})
    if twice:
        raise AssertionError(f"read each needed tensor once; read twice: {twice}")
    return target, sources, reads


def _expect_same_weights(target, model):
    for name, t in model.state_dict().items():
        got = target.state_dict().get(name)
        if got is None or got.is_meta:
            raise AssertionError(
                f"parameter {name!r} was not filled (still on the meta device): a model built "
                "on the meta device has no memory to copy into; load_state_dict(..., "
                "assign=True) puts the checkpoint's tensors in place of its parameters"
            )
        expect_close(f"parameter {name}", got, t, atol=0, rtol=0)


@public("ch01.load_weights")
def _(load_weights):
    model = _tiny_model(80, tied=False)
    stored = _checkpoint(model)
    stored["model.rotary_emb.inv_freq"] = torch.zeros(4)  # a tensor the model does not use
    target, sources, reads = _load(load_weights, model, stored)
    expect_equal(
        "returned {parameter: checkpoint key} (here the names agree)",
        sources,
        {k: k for k in model.state_dict()},
    )
    _expect_same_weights(target, model)
    twice = sorted({k for k in reads if reads.count(k) > 1})
    if twice or "model.rotary_emb.inv_freq" in reads:
        raise AssertionError(
            f"read each needed tensor once and nothing else (read twice: {twice}; unneeded: "
            f"{[k for k in reads if k not in sources.values()]})"
        )
    w = target.model.layers[0].self_attn.q_proj.weight
    if w.data_ptr() != stored["model.layers.0.self_attn.q_proj.weight"].data_ptr():
        raise AssertionError(
            "the parameters must be the tensors get_tensor returned, not copies of them "
            "(load_state_dict(..., assign=True)): a copy doubles the memory of a mapped file"
        )


@public("ch01.load_weights")
def _(load_weights):
    model = _tiny_model(81, tied=True)
    stored = _checkpoint(model)
    # a stored copy of the head, as Qwen3-0.6B's file has; made different here so it shows
    stored["lm_head.weight"] = stored["model.embed_tokens.weight"] + 1
    target, sources, reads = _load(load_weights, model, stored)
    if "lm_head.weight" not in reads and "lm_head.weight" not in sources:
        raise AssertionError(
            "the map names a source for every entry of model.state_dict(), the tied head "
            "included: lm_head.weight <- 'model.embed_tokens.weight'"
        )
    if "lm_head.weight" in reads or sources.get("lm_head.weight") != "model.embed_tokens.weight":
        raise AssertionError(
            "tied head: lm_head.weight is filled from model.embed_tokens.weight (it is the "
            "embedding); the stored copy must not be read (your map says lm_head.weight <- "
            f"{sources.get('lm_head.weight')!r})"
        )
    expect_close(
        "tied head == embedding", target.lm_head.weight, model.model.embed_tokens.weight, 0, 0
    )
    if target.lm_head.weight is not target.model.embed_tokens.weight:
        raise AssertionError(
            "tied head: after loading, lm_head.weight must be the same Parameter as "
            "model.embed_tokens.weight (assign=True made two; tie them again)"
        )
    del stored["lm_head.weight"]  # most tied checkpoints store no head at all
    target, _, _ = _load(load_weights, model, stored)
    _expect_same_weights(target, model)


@public("ch01.load_weights")
def _(load_weights):
    model = _tiny_model(82, tied=True)
    prefix = "model.language_model."  # Qwen3.5: the text model inside a multimodal checkpoint
    stored = _checkpoint(model, prefix)
    stored["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    try:
        target, sources, reads = _load(load_weights, model, stored, prefix)
    except KeyError as e:
        raise AssertionError(
            f"prefix: this checkpoint keeps the text model under {prefix!r}, so "
            f"model.norm.weight is stored as {prefix + 'norm.weight'!r} (your code raised "
            f"KeyError: {e})"
        ) from None
    expect_equal(
        f"checkpoint key of model.norm.weight with prefix {prefix!r}",
        sources.get("model.norm.weight"),
        prefix + "norm.weight",
    )
    _expect_same_weights(target, model)
    del stored[prefix + "layers.1.mlp.up_proj.weight"]
    try:
        _load(load_weights, model, stored, prefix)
    except KeyError as e:
        if prefix + "layers.1.mlp.up_proj.weight" not in str(e):
            raise AssertionError(
                f"the KeyError must name the missing tensor; it says {e}"
            ) from None
    else:
        raise AssertionError("a tensor missing from the checkpoint must raise KeyError naming it")


@hidden("ch01.load_weights")
def _(load_weights):
    model = _tiny_model(83, qwen3=False, tied=False, n_heads=6, n_kv=3, layers=3)
    stored = _checkpoint(model)
    target, sources, _ = _load(load_weights, model, stored)
    _expect_same_weights(target, model)
    expect_equal("lm_head of an untied model", sources["lm_head.weight"], "lm_head.weight")


# generation


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


def _check_decode(decode, seed, prompt_len, n, choose=None, stop=None, stop_at=None):
    model = _tiny_model(seed)
    prompt = torch.randint(0, 64, (prompt_len,), generator=seeded(seed + 1)).tolist()
    if stop_at is not None:  # stop at the token greedy decoding reaches at step `stop_at`
        stop = {_reference_tokens(model, prompt, stop_at + 1, dec.greedy)[stop_at]}
    watched = Watched(model)
    kwargs = {}
    if choose is not None:
        kwargs["choose"] = choose
    if stop is not None:
        kwargs["stop"] = stop
    with torch.no_grad():
        got = list(decode(watched, prompt, n, **kwargs))
    expected = _reference_tokens(model, prompt, n, choose or dec.greedy, stop or ())
    if len(watched.caches) != 1:
        raise AssertionError(
            f"one cache for the whole generation: model.new_cache() was called "
            f"{len(watched.caches)} times"
        )
    fed = [c[0].shape[1] for c in watched.calls]
    if fed and fed[0] != prompt_len:
        raise AssertionError(
            f"prefill: the first call feeds the whole prompt ({prompt_len} tokens)"
        )
    if any(t != 1 for t in fed[1:]):
        raise AssertionError(
            f"after the prefill, feed only the token just chosen (1 token a call; yours fed "
            f"{fed}): the cache holds everything before it"
        )
    if any(c[1] is not watched.caches[0] for c in watched.calls):
        raise AssertionError("every call must pass the cache (model(ids, cache=cache, ...))")
    if any(not c[2] for c in watched.calls):
        raise AssertionError("ask for the last position's logits only: last_only=True")
    for step, (ids, _, _) in enumerate(watched.calls[1:]):
        if int(ids[0, 0]) != got[step]:
            raise AssertionError(
                f"step {step + 1} must feed the token chosen at step {step} ({got[step]}), "
                f"not {int(ids[0, 0])}"
            )
    if got != expected:
        if len(got) > len(expected) and stop:
            raise AssertionError("after yielding an id in `stop`, end the generation")
        if stop and got == expected[:-1]:
            raise AssertionError("yield the stop id too, then end (the caller sees why it ended)")
        if choose is not None and got == _reference_tokens(model, prompt, n, dec.greedy):
            raise AssertionError("pick each token with choose(logits), not always the argmax")
        if len(got) != len(expected) and not stop:
            raise AssertionError(f"max_new_tokens={n}: yield {n} ids, not {len(got)}")
    expect_equal(f"tokens ({n} at most, prompt of {prompt_len})", got, expected)


@public("ch01.decode")
def _(decode):
    _check_decode(decode, 90, 5, 6)
    _check_decode(decode, 91, 3, 0)


@public("ch01.decode")
def _(decode):
    _check_decode(decode, 92, 4, 5, choose=_second_best)
    _check_decode(decode, 93, 3, 8, stop_at=2)  # ends after yielding the stop token


@hidden("ch01.decode")
def _(decode):
    _check_decode(decode, 94, 9, 7, choose=_second_best, stop={-1})
    _check_decode(decode, 95, 1, 4)
