"""Typical wrong answers to chapter 1's stateful exercises (the KV cache, the attention module, the
decoder layer, the model's forward, the loader, decoding), whose checks are still written as
functions: each must fail its checks with a message that names the idea it gets wrong (the public
checks, unless the case says hidden). The other exercises' mistakes are catalogued with their
cases (tests/test_wrong_answers.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwen_mini import attention as ref
from qwen_mini import decoder as dec
from qwen_mini.course.checking import run_checks
from qwen_mini.rope import apply_rope

# load_weights without assign=True into a meta model: torch warns, the check fails it
pytestmark = pytest.mark.filterwarnings("ignore:for .*copying from a non-meta:UserWarning")

# --- KV cache ------------------------------------------------------------------------------------


class CacheAdvancesLength(ref.KVCache):
    def update(self, k, v):
        out = super().update(k, v)
        self.length += k.shape[2]
        return out

    def commit(self, n_tokens):
        pass


class CacheConcatenates(ref.KVCache):
    def update(self, k, v):
        self.k = torch.cat([self.k[:, :, : self.length], k], 2)
        self.v = torch.cat([self.v[:, :, : self.length], v], 2)
        return self.k, self.v


class CacheReturnsCopies(ref.KVCache):
    def update(self, k, v):
        k_all, v_all = super().update(k, v)
        return k_all.clone(), v_all.clone()


class CacheGrowsByWhatIsNeeded(ref.KVCache):
    def _grow(self, buf, needed):
        new = buf.new_empty(buf.shape[:2] + (needed,) + buf.shape[3:])
        new[:, :, : self.length] = buf[:, :, : self.length]
        return new


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


# --- the attention module ------------------------------------------------------------------------


def attention_variant(**wrong):
    class Wrong(ref.Attention):
        def forward(self, x, cos, sin, cache=None):
            T = x.shape[1]
            q = ref.split_heads(self.q_proj(x), self.n_heads)
            k = ref.split_heads(self.k_proj(x), self.n_kv_heads)
            v = ref.split_heads(self.v_proj(x), self.n_kv_heads)
            n_rep = self.n_heads // self.n_kv_heads
            if wrong.get("norm_whole"):
                q = ref.split_heads(self.q_norm(self.q_proj(x)), self.n_heads)
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


# --- decoder layer -------------------------------------------------------------------------------


def layer_variant(kind):
    class Wrong(dec.DecoderLayer):
        def __init__(self, mixer_name, mixer, mlp, n1, n2):
            if kind == "fixed_name":
                mixer_name = "self_attn"
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
            if kind == "no_second_residual":
                x = x + m(n1(x), cos, sin, cache)
                return self.mlp(n2(x))
            if kind == "no_cache":
                x = x + m(n1(x), cos, sin, None)
                return x + self.mlp(n2(x))
            return super().forward(x, cos, sin, cache)

    return Wrong


# --- forward pass --------------------------------------------------------------------------------


def forward_variant(kind):
    from qwen_mini.rope import rope_cos_sin
    from qwen_mini.rope_scaling import rotary_cos_sin

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


# --- loading -------------------------------------------------------------------------------------


def load_variant(kind):
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
        model.load_state_dict(state, strict=True, assign=kind != "no_assign")
        if tied and kind not in ("no_retie",):
            model.lm_head.weight = model.model.embed_tokens.weight
        return sources

    return load_weights


# --- generation ----------------------------------------------------------------------------------


def decode_variant(kind):
    def decode(model, prompt_ids, max_new_tokens, choose=dec.greedy, stop=()):
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


# --- the corpus ----------------------------------------------------------------------------------

QK = {}  # a per-head RMSNorm applied to the whole projected vector cannot even run: see below

CASES = [
    # (exercise, wrong answer, words the message must contain, hidden only)
    ("KVCache", CacheAdvancesLength, "must not advance length", False),
    ("KVCache", CacheConcatenates, "torch.cat", False),
    ("KVCache", CacheReturnsCopies, "copies", False),
    ("KVCache", CacheGrowsByWhatIsNeeded, "grow by doubling", False),
    ("KVCache", CacheCountsWrites, "retry after a failed pass", True),
    ("Attention", attention_variant(norm_after_rope=True), "order of QK-Norm and RoPE", False),
    ("Attention", attention_variant(skip_norm=True), "QK-Norm skipped", False),
    ("Attention", attention_variant(tile=True), "grouping of KV heads", False),
    ("Attention", attention_variant(top_left=True), "top-left", False),
    ("Attention", attention_variant(no_mask=True), "no causal mask", False),
    ("Attention", attention_variant(cache_after_repeat=True), "before repeat_kv", False),
    ("Attention", attention_variant(cache_before_rope=True), "cached after RoPE", False),
    ("Attention", attention_variant(ignore_cache=True), "cache.update", False),
    ("Attention", attention_variant(no_o_proj=True), "o_proj", False),
    ("DecoderLayer", layer_variant("post_norm"), "pre-norm", False),
    ("DecoderLayer", layer_variant("no_pre_norm"), "pre-norm", False),
    ("DecoderLayer", layer_variant("parallel"), "after the mixer's residual", False),
    ("DecoderLayer", layer_variant("no_second_residual"), "second residual", False),
    ("DecoderLayer", layer_variant("no_cache"), "this layer's cache", False),
    ("DecoderLayer", layer_variant("fixed_name"), "checkpoint's names", False),
    ("model_forward", forward_variant("positions_from_0"), "positions", False),
    ("model_forward", forward_variant("whole_cache"), "its own state", False),
    ("model_forward", forward_variant("commits"), "must not commit", False),
    ("model_forward", forward_variant("no_final_norm"), "final norm", False),
    ("model_forward", forward_variant("head_on_all"), "head was applied to", False),
    ("model_forward", forward_variant("plain_rope"), "rotary_cos_sin", False),
    ("load_weights", load_variant("no_retie"), "same Parameter", False),
    ("load_weights", load_variant("stored_copy"), "stored copy must not be read", False),
    ("load_weights", load_variant("no_prefix"), "prefix", False),
    ("load_weights", load_variant("no_assign"), "assign=True", False),
    ("load_weights", load_variant("read_twice"), "read twice", False),
    ("decode", decode_variant("no_cache"), "one cache for the whole generation", False),
    ("decode", decode_variant("new_cache_each_step"), "new_cache() was called", False),
    ("decode", decode_variant("ignores_choose"), "choose(logits)", False),
    ("decode", decode_variant("hides_stop"), "yield the stop id", False),
    ("decode", decode_variant("never_stops"), "end the generation", False),
    ("decode", decode_variant("one_short"), "max_new_tokens", False),
]


def _name(case):
    exercise, wrong, _, _ = case
    return f"{exercise}-{getattr(wrong, '__name__', 'x')}"


@pytest.mark.parametrize("case", CASES, ids=[f"{i:02d}-{_name(c)}" for i, c in enumerate(CASES)])
def test_wrong_answer_fails_and_names_the_idea(case):
    exercise, wrong, words, hidden_only = case
    public = run_checks(f"ch01.{exercise}", wrong, hidden=False)
    if hidden_only:
        assert public.status == "passed", public.message  # it is the hidden checks' job
        result = run_checks(f"ch01.{exercise}", wrong, hidden=True)
    else:
        result = public
    assert result.status == "failed", f"{_name(case)} was not caught"
    assert words in result.message, result.message


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 25
    assert {c[0] for c in CASES} == {
        "KVCache", "Attention", "DecoderLayer", "model_forward", "load_weights", "decode",
    }  # fmt: skip


def test_the_package_answers_pass_every_check():
    from qwen_mini.course.checking import exercises

    for exercise in exercises("ch01"):
        result = run_checks(exercise.id, exercise.reference, hidden=True)
        assert result.status == "passed", result.line()


# --- right answers written differently must pass -------------------------------------------------


class AttentionNormBeforeTranspose(ref.Attention):
    """QK-Norm on [B, T, H, D] before the transpose, as transformers writes it."""

    def forward(self, x, cos, sin, cache=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, -1)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, -1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = ref.split_heads(self.v_proj(x), self.n_kv_heads)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        mask = ref.causal_mask(T, k.shape[2])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(ref.merge_heads(out))


class LayerWithKeywords(dec.DecoderLayer):
    def forward(self, x, cos, sin, cache=None):
        x = x + self.mixer(self.input_layernorm(x), cos=cos, sin=sin, cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def load_with_setattr(model, header, get_tensor, prefix="model."):
    return dec.load_weights(model, dict(header), get_tensor, prefix)


def decode_with_forward(model, prompt_ids, max_new_tokens, choose=dec.greedy, stop=()):
    cache, ids = model.new_cache(batch_size=1), torch.tensor([prompt_ids])
    for _ in range(max_new_tokens):
        token = choose(model.forward(ids, cache=cache, last_only=True)[0, -1])
        yield token
        if token in stop:
            break
        ids = torch.tensor([[token]])


@pytest.mark.parametrize(
    "exercise, answer",
    [
        ("Attention", AttentionNormBeforeTranspose),
        ("DecoderLayer", LayerWithKeywords),
        ("load_weights", load_with_setattr),
        ("decode", decode_with_forward),
    ],
)
def test_right_answers_written_differently_pass(exercise, answer):
    result = run_checks(f"ch01.{exercise}", answer, hidden=True)
    assert result.status == "passed", result.line()
