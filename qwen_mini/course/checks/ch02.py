"""Checks for chapter 2 (QKV bias against QK-Norm, attention-logit statistics, precision).

Each exercise is a list of cases, compared with the package reference or with a value worked out by
hand (RMSNorm with unit weight gives every head vector the norm √D, a softmax row of equal logits
is uniform, bfloat16 rounds 513 to 512), and a catalogue of typical mistakes whose ideas the
messages name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from qwen_mini.architectures import ARCHITECTURES
from qwen_mini.attention import Attention, QKVBiasAttention, causal_mask, merge_heads, split_heads
from qwen_mini.config import Config
from qwen_mini.course.checking import between, mistake, named, randn, register
from qwen_mini.course.lab import ch02 as lab
from qwen_mini.course.variants import case
from qwen_mini.rope import apply_rope, rope_cos_sin

register(
    "ch02.QKVBiasAttention",
    reference=QKVBiasAttention,
    points=2,
    title="Qwen2.5's attention: a bias on q, k and v, none on o_proj, no QK-Norm",
)
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


# --- QKVBiasAttention ----------------------------------------------------------------------------


def _config(model_type: str, hidden=16, heads=4, kv_heads=2, head_dim=8, **fields) -> Config:
    return Config(
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
        **fields,
    )


def _biased_inputs(model_type, B, T, dtype=torch.float32, **fields):
    """(config, the row, weights of a Qwen2 layer with nonzero biases, x, cos, sin)."""

    def inputs(g):
        cfg = _config(model_type, **fields)
        layer = QKVBiasAttention(cfg, 0, ARCHITECTURES["qwen2"])
        weights = {
            name: (torch.randn(p.shape, generator=g) * 0.3).to(dtype)
            for name, p in layer.state_dict().items()
        }
        cos, sin = rope_cos_sin(torch.arange(T), cfg.head_dim, cfg.rope_theta)
        x = randn(B, T, cfg.hidden_size, g=g).to(dtype)
        return cfg, ARCHITECTURES[model_type], weights, x, cos.to(dtype), sin.to(dtype)

    return inputs


def _biased_hidden(g):
    kv_heads, groups = between(g, 1, 3), between(g, 1, 3)
    sizes = dict(heads=kv_heads * groups, kv_heads=kv_heads, head_dim=4 * between(g, 1, 4))
    model_type = ("qwen2", "qwen3")[between(g, 0, 1)]
    return _biased_inputs(model_type, between(g, 1, 3), between(g, 1, 8), **sizes)(g)


def _biased_layer(cls, cfg, row, weights, x, cos, sin):
    """The learner's layer built from this row: its parameters, and its output with the given
    weights (when its parameters are the Qwen2 layer's)."""
    layer = cls(cfg, 0, row).to(x.dtype)
    shapes = {name: tuple(p.shape) for name, p in layer.state_dict().items()}
    output = "not computed: the layer's parameters are not a Qwen2 layer's"
    if shapes == {name: tuple(w.shape) for name, w in weights.items()}:
        layer.load_state_dict(weights)
        with torch.no_grad():
            output = layer(x, cos, sin)
    return {"parameters (name: shape)": shapes, "output [B, T, hidden]": output}


BIASED = "ch02.QKVBiasAttention"
case(
    BIASED,
    "built from the Qwen2 row: a bias on q_proj, k_proj, v_proj, none on o_proj",
    _biased_inputs("qwen2", 2, 5),
    _biased_layer,
    atol=1e-5,
    rtol=1e-5,
)
case(
    BIASED,
    "built from the Qwen3 row (QK-Norm, no bias): the layer is still Qwen2's, with its biases "
    "and no QK-Norm",
    _biased_inputs("qwen3", 1, 6),
    _biased_layer,
    atol=1e-5,
    rtol=1e-5,
    seed=1,
)
case(
    BIASED,
    "config.json says attention_bias=true: still no bias on o_proj",
    _biased_inputs("qwen3", 1, 4, attention_bias=True),
    _biased_layer,
    atol=1e-5,
    rtol=1e-5,
    seed=2,
)
case(
    BIASED,
    "a bfloat16 layer on bfloat16 tokens: the output is bfloat16",
    _biased_inputs("qwen2", 2, 6, dtype=torch.bfloat16),
    _biased_layer,
    atol=2e-2,
    rtol=2e-2,
    seed=3,
)
for n in range(2):
    case(BIASED, f"other layers {n + 1}", _biased_hidden, _biased_layer, atol=1e-5, rtol=1e-5,
         hidden=True)  # fmt: skip


def _linear(cfg, heads, bias, out=False):
    inner = heads * cfg.head_dim
    return torch.nn.Linear(*((inner, cfg.hidden_size) if out else (cfg.hidden_size, inner)), bias)


@mistake(BIASED, "o_proj has a bias: Qwen2 puts a bias on q_proj, k_proj and v_proj only")
class BiasOnOutput(Attention):
    def __init__(self, cfg, layer_idx, arch):
        super().__init__(cfg, layer_idx, arch)
        self.q_proj = _linear(cfg, self.n_heads, True)
        self.k_proj = _linear(cfg, self.n_kv_heads, True)
        self.v_proj = _linear(cfg, self.n_kv_heads, True)
        self.o_proj = _linear(cfg, self.n_heads, True, out=True)
        self.q_norm = self.k_norm = None


@mistake(BIASED, "v_proj has no bias: Qwen2 puts a bias on q_proj, k_proj AND v_proj")
class NoBiasOnValue(QKVBiasAttention):
    def __init__(self, cfg, layer_idx, arch):
        super().__init__(cfg, layer_idx, arch)
        self.v_proj = _linear(cfg, self.n_kv_heads, False)


@mistake(
    BIASED,
    "the layer has the row's flags, not Qwen2's: whatever the row says, this layer has a bias on "
    "q_proj, k_proj and v_proj, none on o_proj, and no QK-Norm (q_norm = k_norm = None)",
)
class BiasAsTheRowSays(Attention):
    pass


@mistake(
    BIASED,
    "QK-Norm is kept: a Qwen2 layer has no q_norm or k_norm (set them to None), only the biases",
)
class BiasKeepsQKNorm(Attention):
    def __init__(self, cfg, layer_idx, arch):
        super().__init__(cfg, layer_idx, arch)
        self.q_proj = _linear(cfg, self.n_heads, True)
        self.k_proj = _linear(cfg, self.n_kv_heads, True)
        self.v_proj = _linear(cfg, self.n_kv_heads, True)
        self.o_proj = _linear(cfg, self.n_heads, False, out=True)


@mistake(
    BIASED,
    "the bias is added after RoPE: Qwen2.5 adds it before (it is part of q_proj(x) and k_proj(x), "
    "rotated with them), so chapter 1's forward is already right",
)
class BiasAfterRope(QKVBiasAttention):
    def forward(self, x, cos, sin, cache=None):
        q = F.linear(x, self.q_proj.weight)
        k = F.linear(x, self.k_proj.weight)
        q = apply_rope(split_heads(q, self.n_heads), cos, sin)
        k = apply_rope(split_heads(k, self.n_kv_heads), cos, sin)
        q = q + self.q_proj.bias.view(self.n_heads, 1, -1)
        k = k + self.k_proj.bias.view(self.n_kv_heads, 1, -1)
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        return self.o_proj(merge_heads(self.attend(q, k, v)))


# --- bias_logit_terms ----------------------------------------------------------------------------


def _terms_inputs(T_q, T_k, D):
    return lambda g: (randn(T_q, D, g=g), randn(T_k, D, g=g), randn(D, g=g), randn(D, g=g))


def _terms_hidden(g):
    return _terms_inputs(between(g, 1, 8), between(g, 1, 8), 4 * between(g, 1, 16))(g)


case(
    "ch02.bias_logit_terms",
    "3 queries, 5 keys",
    _terms_inputs(3, 5, 8),
    atol=1e-4,
    rtol=1e-4,
    variants=("bfloat16",),
)
for n in range(3):
    case(
        "ch02.bias_logit_terms",
        f"other sizes {n + 1}",
        _terms_hidden,
        atol=1e-4,
        rtol=1e-4,
        hidden=True,
    )


@mistake(
    "ch02.bias_logit_terms",
    "query_bias and key_bias are swapped: query_bias = W_q x_i·b_k has one value per query (the "
    "same in every column), key_bias = b_q·W_k x_j one value per key",
)
def terms_swapped(qx, kx, b_q, b_k):
    t = lab.bias_logit_terms(qx, kx, b_q, b_k)
    return dict(t, query_bias=t["key_bias"], key_bias=t["query_bias"])


@mistake("ch02.bias_logit_terms", "the terms are divided by √D: return them unscaled")
def terms_scaled(qx, kx, b_q, b_k):
    terms = lab.bias_logit_terms(qx, kx, b_q, b_k)
    return {n: v / math.sqrt(qx.shape[-1]) for n, v in terms.items()}


@mistake(
    "ch02.bias_logit_terms",
    "bias_bias is zero: b_q·b_k is one number, the same for every pair, and the four terms must "
    "add up to (W_q x_i + b_q)·(W_k x_j + b_k)",
)
def terms_no_bias_bias(qx, kx, b_q, b_k):
    return dict(lab.bias_logit_terms(qx, kx, b_q, b_k), bias_bias=torch.zeros(len(qx), len(kx)))


# --- rope_bias_term ------------------------------------------------------------------------------


def _rope_inputs(T, D, theta):
    def inputs(g):
        cos, sin = rope_cos_sin(torch.arange(T), D, theta)
        return randn(D, g=g), randn(D, g=g), cos, sin

    return inputs


def _rope_hidden(g):
    theta = (100.0, 1e4, 1e6)[between(g, 0, 2)]
    return _rope_inputs(between(g, 2, 12), 4 * between(g, 1, 8), theta)(g)


case(
    "ch02.rope_bias_term",
    "6 positions",
    _rope_inputs(6, 8, 1e4),
    atol=1e-4,
    rtol=1e-3,
    variants=("meta",),
)
for n in range(3):
    case(
        "ch02.rope_bias_term",
        f"other sizes {n + 1}",
        _rope_hidden,
        atol=1e-4,
        rtol=1e-3,
        hidden=True,
    )


@mistake(
    "ch02.rope_bias_term",
    "every entry equals b_q·b_k, as without RoPE: rotate b_q to the query's position i and b_k to "
    "the key's position j (apply_rope with each position's cos, sin)",
)
def rope_bias_unrotated(b_q, b_k, cos, sin):
    return (b_q @ b_k).expand(cos.shape[0], cos.shape[0])


@mistake(
    "ch02.rope_bias_term",
    "only b_q is rotated: rotate b_k to the key's position j too; then the diagonal (the same "
    "position) keeps b_q·b_k, and entry (i, j) depends on j - i only",
)
def rope_bias_only_query_rotated(b_q, b_k, cos, sin):
    T = cos.shape[0]
    return apply_rope(b_q.expand(T, -1), cos, sin) @ b_k.expand(T, -1).T


# --- project_qk ----------------------------------------------------------------------------------


def _attn(model_type: str, g, hidden=16, heads=4, kv_heads=2, head_dim=8) -> Attention:
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
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.8 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return attn


def _layer_inputs(model_type, B, T, **sizes):
    def inputs(g):
        attn = _attn(model_type, g, **sizes)
        cos, sin = rope_cos_sin(torch.arange(T), attn.head_dim, 10000.0)
        return attn, randn(B, T, attn.q_proj.in_features, g=g), cos, sin

    return inputs


def _layer_hidden(model_type):
    def inputs(g):
        kv_heads, groups, head_dim = between(g, 1, 3), between(g, 1, 3), 4 * between(g, 1, 4)
        sizes = dict(heads=kv_heads * groups, kv_heads=kv_heads, head_dim=head_dim)
        sizes["hidden"] = 4 * between(g, 2, 8)
        return _layer_inputs(model_type, between(g, 1, 3), between(g, 1, 8), **sizes)(g)

    return inputs


def _qk(project_qk, attn, x, cos, sin):
    with torch.no_grad():
        return named(project_qk(attn, x, cos, sin), "q [B, H, T, D]", "k [B, H_kv, T, D]")


def _unit_norms(attn, x, cos, sin):
    with torch.no_grad():
        attn.q_norm.weight.fill_(1.0)
        attn.k_norm.weight.fill_(1.0)
    return attn, x * 10, cos, sin


def _head_norms(project_qk, attn, x, cos, sin):
    qk = _qk(project_qk, *_unit_norms(attn, x, cos, sin))
    return {f"‖{n[0]}‖ of every head": t.norm(dim=-1) for n, t in qk.items()}


def _root_d(attn, x, cos, sin):  # QK-Norm makes each head's RMS 1, RoPE keeps the norm
    B, T, D = x.shape[0], x.shape[1], attn.head_dim
    return {
        "‖q‖ of every head": torch.full((B, attn.n_heads, T), math.sqrt(D)),
        "‖k‖ of every head": torch.full((B, attn.n_kv_heads, T), math.sqrt(D)),
    }


tol = dict(atol=1e-4, rtol=1e-4)
case(
    "ch02.project_qk",
    "Qwen3 layer: per-head QK-Norm, then RoPE",
    _layer_inputs("qwen3", 2, 5),
    _qk,
    **tol,
    variants=("bfloat16", "meta"),
)
case(
    "ch02.project_qk",
    "Qwen3 layer with unit norm weights: every head vector has norm √D",
    _layer_inputs("qwen3", 1, 4),
    _head_norms,
    _root_d,
    atol=1e-3,
    rtol=1e-3,
    seed=1,
)
case(
    "ch02.project_qk",
    "Qwen2 layer: projections with their bias, no norm, then RoPE",
    _layer_inputs("qwen2", 2, 5),
    _qk,
    seed=3,
    **tol,
)
for n, model_type in enumerate(("qwen3", "qwen3", "qwen2")):
    case(
        "ch02.project_qk",
        f"other {model_type} layers {n + 1}",
        _layer_hidden(model_type),
        _qk,
        hidden=True,
        **tol,
    )


def _rope(attn, q, k, cos, sin):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _heads(attn, q, k):
    return split_heads(q, attn.n_heads), split_heads(k, attn.n_kv_heads)


@mistake("ch02.project_qk", "RoPE comes before QK-Norm here; Qwen3 normalises first, then rotates")
def project_rope_first(attn, x, cos, sin):
    q, k = _rope(attn, *_heads(attn, attn.q_proj(x), attn.k_proj(x)), cos, sin)
    return attn.q_norm(q), attn.k_norm(k)


@mistake(
    "ch02.project_qk",
    "QK-Norm is applied over all heads at once; it normalises each head's head_dim",
)
def project_norm_all_heads(attn, x, cos, sin):
    q, k = attn.q_proj(x), attn.k_proj(x)
    q = split_heads(q * q.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt(), attn.n_heads)
    k = split_heads(k * k.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt(), attn.n_kv_heads)
    return _rope(attn, q * attn.q_norm.weight, k * attn.k_norm.weight, cos, sin)


@mistake("ch02.project_qk", "QK-Norm is missing (q_norm, k_norm come after the projection)")
def project_no_norm(attn, x, cos, sin):
    return _rope(attn, *_heads(attn, attn.q_proj(x), attn.k_proj(x)), cos, sin)


@mistake("ch02.project_qk", "RoPE is missing: rotate q and k after the norm")
def project_no_rope(attn, x, cos, sin):
    q, k = _heads(attn, attn.q_proj(x), attn.k_proj(x))
    return (attn.q_norm(q), attn.k_norm(k)) if attn.q_norm is not None else (q, k)


@mistake("ch02.project_qk", "the projections' bias is missing (q_proj(x) includes it)")
def project_no_bias(attn, x, cos, sin):
    q, k = _heads(attn, F.linear(x, attn.q_proj.weight), F.linear(x, attn.k_proj.weight))
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return _rope(attn, q, k, cos, sin)


# --- logit_stats ---------------------------------------------------------------------------------


def _stats_inputs(B, H, T, D, scale):
    return lambda g: (randn(B, H, T, D, g=g) * scale, randn(B, H, T, D, g=g) * scale)


def _stats_hidden(g):
    scale = (0.3, 1.0, 4.0)[between(g, 0, 2)]
    return _stats_inputs(
        between(g, 1, 3), between(g, 1, 4), between(g, 1, 8), 4 * between(g, 1, 8), scale
    )(g)


def _stats(logit_stats, q, k):
    return named(
        logit_stats(q, k), "max_logit (one value per head)", "entropy (one value per head)"
    )


def _uniform(q, k):  # rows see 1, 2, 3, 4 equal logits 8/√8: entropies ln 1 … ln 4
    H = q.shape[1]
    return {
        "max_logit (one value per head)": torch.full((H,), math.sqrt(8)),
        "entropy (one value per head)": torch.full((H,), sum(math.log(i) for i in range(1, 5)) / 4),
    }


case(
    "ch02.logit_stats",
    "random queries and keys",
    _stats_inputs(2, 3, 5, 8, 2.0),
    _stats,
    atol=1e-4,
    rtol=1e-4,
)
case(
    "ch02.logit_stats",
    "equal queries and keys: a uniform row over i + 1 keys has entropy ln(i + 1)",
    lambda g: (torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8)),
    _stats,
    _uniform,
    atol=1e-5,
    rtol=1e-5,
)
case(
    "ch02.logit_stats",
    "bfloat16 queries and keys: the logits and the entropy in float32, two float32 results",
    lambda g: tuple(t.bfloat16() for t in _stats_inputs(1, 2, 16, 16, 3.0)(g)),
    _stats,
    atol=1e-4,
    rtol=1e-4,
    seed=7,
)
for n in range(3):
    case(
        "ch02.logit_stats",
        f"other sizes {n + 1}",
        _stats_hidden,
        _stats,
        atol=1e-4,
        rtol=1e-4,
        hidden=True,
    )


def _logits(q, k, scale=True, mask=True):
    T = q.shape[-2]
    s = q.float() @ k.float().transpose(-2, -1)
    s = s / math.sqrt(q.shape[-1]) if scale else s
    return s.masked_fill(~causal_mask(T, T), float("-inf")) if mask else s


@mistake("ch02.logit_stats", "max_logit is not divided by √D: attention logits are q·k/√D")
def stats_unscaled(q, k):
    s = _logits(q, k, scale=False)
    p = s.softmax(-1)
    e = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
    return s.amax(dim=(0, 2, 3)), e.mean(dim=(0, 2))


@mistake(
    "ch02.logit_stats",
    "max_logit includes future keys: take the largest logit a query may attend to (the causal "
    "mask)",
)
def stats_max_over_future(q, k):
    _, e = lab.logit_stats(q, k)
    return _logits(q, k, mask=False).amax(dim=(0, 2, 3)), e


@mistake("ch02.logit_stats", "entropy is nan: masked weights are 0, and 0·log 0 counts as 0")
def stats_nan_entropy(q, k):
    m, _ = lab.logit_stats(q, k)
    p = _logits(q, k).softmax(-1)
    return m, -(p * p.log()).sum(-1).mean(dim=(0, 2))  # 0 * log 0 = nan


@mistake("ch02.logit_stats", "entropy is in bits: use the natural logarithm (nats)")
def stats_bits(q, k):
    m, e = lab.logit_stats(q, k)
    return m, e / math.log(2)


@mistake(
    "ch02.logit_stats",
    "one number for all heads: take the max and the mean over batch and queries, but keep one "
    "value per head",
)
def stats_all_heads(q, k):
    m, e = lab.logit_stats(q, k)
    return m.max(), e.mean()


@mistake(
    "ch02.logit_stats",
    "bfloat16 inputs are computed in bfloat16: cast q and k to float32 first (.float()), then "
    "take the logits, the softmax and the entropy, and return float32",
)
def stats_in_input_dtype(q, k):
    T, D = q.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D)  # in q's dtype
    s = s.masked_fill(~causal_mask(T, T), float("-inf"))
    p = s.softmax(-1)
    e = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
    return s.amax(dim=(0, 2, 3)).float(), e.mean(dim=(0, 2)).float()


@mistake(
    "ch02.logit_stats",
    "the results come back in the inputs' dtype: return two float32 tensors",
)
def stats_returned_in_input_dtype(q, k):
    m, e = lab.logit_stats(q, k)
    return m.to(q.dtype), e.to(q.dtype)


# --- distinct_weights ----------------------------------------------------------------------------

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _logits_given(*values, dtype):
    return lambda g: (torch.tensor(values), dtype)


def _counts(n):
    return lambda *_: n


for dtype in (torch.float32, torch.bfloat16):
    case(
        "ch02.distinct_weights",
        f"four different logits give four different weights in {dtype}",
        _logits_given(0.0, 1.0, 2.0, 3.0, dtype=dtype),
        expected=_counts(4),
    )
case(
    "ch02.distinct_weights",
    "equal logits 1, 1, 2 give two different weights (the equal ones count once)",
    _logits_given(1.0, 1.0, 2.0, dtype=torch.float32),
    expected=_counts(2),
)
# bfloat16 keeps 8 significant bits: between 512 and 1024 its numbers are 4 apart, so 513 rounds
# to 512 and 515 to 516; 514, halfway, rounds to 512 (the even neighbour).
for dtype, n in ((torch.float32, 4), (torch.bfloat16, 2)):
    case(
        "ch02.distinct_weights",
        f"large logits 512, 513, 514, 515 in {dtype}: rounded before the softmax sees them",
        _logits_given(512.0, 513.0, 514.0, 515.0, dtype=dtype),
        expected=_counts(n),
    )
case(
    "ch02.distinct_weights",
    "weights that underflow to 0 (exp(-200) in float32) are not counted",
    _logits_given(0.0, -200.0, -300.0, dtype=torch.float32),
    expected=_counts(1),
)


def _per_dtype(distinct_weights, logits):
    return {str(dtype): distinct_weights(logits, dtype) for dtype in DTYPES}


for n in range(4):
    # float32 and float64 softmax can differ in the last float32 bit: a count may differ by 2%
    case(
        "ch02.distinct_weights",
        f"random logits {n + 1}",
        lambda g: (randn(between(g, 20, 200), g=g) * 10 ** between(g, 0, 3),),
        _per_dtype,
        atol=1,
        rtol=0.02,
        hidden=True,
    )


@mistake(
    "ch02.distinct_weights",
    "the logits are not rounded: round the logits to the dtype first; a bfloat16 model holds its "
    "logits in bfloat16 (512, 513, 514, 515 become 512, 512, 512, 516)",
)
def distinct_logits_not_rounded(logits, dtype):
    w = logits.float().softmax(-1).to(dtype)
    return int(torch.unique(w[w > 0]).numel())


@mistake(
    "ch02.distinct_weights", "a weight of exactly 0 was counted: count the nonzero weights only"
)
def distinct_counts_zeros(logits, dtype):
    w = logits.to(dtype).float().softmax(-1).to(dtype)
    return int(torch.unique(w).numel())


@mistake(
    "ch02.distinct_weights",
    "the nonzero weights were counted, not the DIFFERENT ones: equal weights count once "
    "(torch.unique)",
)
def distinct_counts_nonzero(logits, dtype):
    w = logits.to(dtype).float().softmax(-1).to(dtype)
    return int((w > 0).sum())


@mistake("ch02.distinct_weights", "a tensor is returned: return a Python int (int(...))")
def distinct_tensor(logits, dtype):
    w = logits.to(dtype).float().softmax(-1).to(dtype)
    return torch.unique(w[w > 0]).numel() * torch.ones((), dtype=torch.long)


# --- remove_qk_norm ------------------------------------------------------------------------------


def _tiny_lm(qk: bool, layers, g):
    model = lab.tiny_model(lab.tiny_config(hidden=32, layers=layers, heads=2), lab.tiny_arch(qk))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _state_dict(qk: bool, layers: int | None = None):
    return lambda g: (dict(_tiny_lm(qk, layers or between(g, 1, 4), g).state_dict()),)


def _kept(remove_qk_norm, given):
    got = remove_qk_norm(given)
    return {
        "the state dict": got,
        "entries left in the dict you were given (leave it unchanged)": len(given),
    }


# bfloat16: the checkpoints ship in it; what is kept keeps its dtype
case(
    "ch02.remove_qk_norm",
    "a two-layer model with QK-Norm",
    _state_dict(True, 2),
    _kept,
    variants=("bfloat16",),
)
case(
    "ch02.remove_qk_norm",
    "a model without QK-Norm (Qwen2-like): every tensor kept",
    _state_dict(False, 2),
    _kept,
)
for n in range(2):
    case("ch02.remove_qk_norm", f"other models {n + 1}", _state_dict(True), _kept, hidden=True)


@mistake(
    "ch02.remove_qk_norm",
    "the norm weights are set to 1, but a norm with weight 1 still divides each head by its RMS; "
    "removing QK-Norm means no normalisation at all: drop the q_norm and k_norm weights",
)
def remove_by_unit_weight(state_dict):
    return {k: torch.ones_like(w) if "_norm" in k else w for k, w in state_dict.items()}


@mistake(
    "ch02.remove_qk_norm",
    "a later layer's q_norm or k_norm is still there: remove QK-Norm from every layer",
)
def remove_first_layer_only(state_dict):
    return {
        k: w for k, w in state_dict.items() if "layers.0.self_attn." not in k or "_norm" not in k
    }


@mistake(
    "ch02.remove_qk_norm",
    "the layer norms are gone too: keep every tensor that is not a QK-Norm",
)
def remove_every_norm(state_dict):
    return {k: w for k, w in state_dict.items() if "norm" not in k}


@mistake(
    "ch02.remove_qk_norm",
    "the dict you were given has changed: build a new dict and leave the caller's as it is",
)
def remove_in_place(state_dict):
    for k in [k for k in state_dict if k.endswith(("q_norm.weight", "k_norm.weight"))]:
        del state_dict[k]
    return state_dict
