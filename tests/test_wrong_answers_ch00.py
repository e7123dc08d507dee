"""Typical wrong answers to chapter 0's exercises: each must fail, with a message naming the idea.

`public=True` marks a mistake the chapter's prose warns about (or a design decision it states):
it must already fail the public checks, the ones a learner runs in the notebook. The others must
fail once the hidden checks (other shapes, seeds and configs) run too, as in grading.
"""

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini import rope, safetensors_file
from qwen_mini.course.checking import reference, run_checks

# --- read_safetensors_header ----------------------------------------------------------------------


def header_big_endian(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack(">Q", f.read(8))
        return json.loads(f.read(n))


def header_whole_file(path):
    raw = Path(path).read_bytes()  # reads the whole checkpoint
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def header_four_byte_length(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<I", f.read(4))
        return json.loads(f.read(n))


def header_unparsed(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode()


def header_drops_metadata(path):
    h = safetensors_file.read_safetensors_header(path)
    return {k: v for k, v in h.items() if k != "__metadata__"}


def header_fixed_chunk(path):
    with open(path, "rb") as f:
        chunk = f.read(65536)  # "headers are small"
    (n,) = struct.unpack("<Q", chunk[:8])
    return json.loads(chunk[8 : 8 + n])


# --- RMSNorm --------------------------------------------------------------------------------------


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


class NormNoFloat32(_Norm):
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class NormNoCastBack(_Norm):
    def forward(self, x):
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class NormWeightBeforeCast(_Norm):
    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return (self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))).to(
            dtype
        )


class NormEpsOutside(_Norm):
    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return self.weight * (x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)).to(dtype)


class NormNoEps(_Norm):
    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))).to(dtype)


class NormLayerNorm(_Norm):
    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x - x.mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


class NormL2(_Norm):
    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.eps)).to(dtype)


class NormFixedEps(_Norm):
    def forward(self, x):  # ignores self.eps
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)


class NormZeroCentred(_Norm):  # Qwen3.5's convention, not Qwen3's
    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (1 + self.weight) * x.to(dtype)


# --- MLP ------------------------------------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


class MLPSiluOnUp(_MLP):
    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * F.silu(self.up_proj(x)))


class MLPNoActivation(_MLP):
    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class MLPRelu(_MLP):
    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


class MLPGelu(_MLP):
    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


class MLPSigmoid(_MLP):
    def forward(self, x):
        return self.down_proj(torch.sigmoid(self.gate_proj(x)) * self.up_proj(x))


class MLPSiluAfterProduct(_MLP):
    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x) * self.up_proj(x)))


class MLPWithBiases(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size)
        self.up_proj = nn.Linear(hidden_size, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# --- RoPE -----------------------------------------------------------------------------------------


def cos_sin_exponent_i_over_d(positions, head_dim, theta, dtype=torch.float32):
    inv_freq = 1.0 / theta ** (torch.arange(head_dim // 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def cos_sin_positive_exponent(positions, head_dim, theta, dtype=torch.float32):
    freq = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * freq
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def cos_sin_interleaved(positions, head_dim, theta, dtype=torch.float32):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = (positions.float()[:, None] * inv_freq).repeat_interleave(2, -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def cos_sin_in_bfloat16(positions, head_dim, theta, dtype=torch.float32):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.to(dtype)[:, None] * inv_freq.to(dtype)  # angles in the requested dtype
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def cos_sin_ignores_dtype(positions, head_dim, theta, dtype=torch.float32):
    return rope.rope_cos_sin(positions, head_dim, theta)


def cos_sin_half_width(positions, head_dim, theta, dtype=torch.float32):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half_no_sign(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x2, x1], dim=-1)


def rotate_half_wrong_sign(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x2, -x1], dim=-1)


def rotate_half_interleaved(x):
    return torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)


def rotate_half_first_dim(x):
    x1, x2 = x.chunk(2, dim=0)
    return torch.cat([-x2, x1], dim=0)


def rotate_half_in_place(x):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].clone(), x[..., d:].clone()
    x[..., :d], x[..., d:] = -x2, x1
    return x


def apply_rope_backwards(x, cos, sin):
    return x * cos - rope.rotate_half(x) * sin


def apply_rope_swapped(x, cos, sin):
    return x * sin + rope.rotate_half(x) * cos


def apply_rope_interleaved(x, cos, sin):
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack([even * c - odd * s, odd * c + even * s], -1).flatten(-2)


def apply_rope_cos_only(x, cos, sin):
    return x * cos


# --- count_params ---------------------------------------------------------------------------------


def _counts(config, *, qkv_bias=True, qk_norm=True, o_bias=True, head_dim_key=True, gqa=True,
            norms=2, final=True, tie="right"):  # fmt: skip
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n_q = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_q) if gqa else n_q
    d = (config.get("head_dim") or h // n_q) if head_dim_key else h // n_q
    per_layer = 2 * h * n_q * d + 2 * h * n_kv * d + 3 * h * inter + norms * h
    if config["model_type"] == "qwen2":
        per_layer += (n_q * d + 2 * n_kv * d) if qkv_bias else 0
    else:
        per_layer += 2 * d if qk_norm else 0
        if config.get("attention_bias", False):
            per_layer += n_q * d + 2 * n_kv * d + (h if o_bias else 0)
    c = {"embed_tokens": vocab * h, "per_layer": per_layer, "norm": h if final else 0}
    c["layers"] = per_layer * config["num_hidden_layers"]
    c["lm_head"] = vocab * h
    c["total"] = 2 * vocab * h + c["layers"] + c["norm"]
    tied = config.get("tie_word_embeddings", False)
    c["unique"] = {
        "right": c["total"] - (vocab * h if tied else 0),
        "twice": c["total"],
        "always_once": c["total"] - vocab * h,
    }[tie]
    return c


WRONG_COUNTS = {
    "no_qkv_bias": dict(qkv_bias=False),
    "no_qk_norm": dict(qk_norm=False),
    "no_o_bias": dict(o_bias=False),
    "head_dim_from_hidden": dict(head_dim_key=False),
    "no_gqa": dict(gqa=False),
    "one_norm_per_layer": dict(norms=1),
    "no_final_norm": dict(final=False),
    "tied_head_twice": dict(tie="twice"),
    "untied_head_once": dict(tie="always_once"),
}


def _count_fn(**kw):
    def count_params(config):
        return _counts(config, **kw)

    return count_params


def count_ignores_attention_bias(config):
    return _counts(dict(config, attention_bias=False))


def count_requires_kv_heads(config):  # every public config has the key; a Qwen2 config may not
    if "num_key_value_heads" not in config:
        raise KeyError("num_key_value_heads")
    return _counts(config)


def count_total_once(config):
    c = _counts(config)
    c["total"] = c["unique"]
    return c


# --- zero-layer model -----------------------------------------------------------------------------


class _Zero(nn.Module):
    def __init__(self, embed_tokens, norm):
        super().__init__()
        self.embed_tokens, self.norm = embed_tokens, norm


class ZeroUntiedHead(_Zero):
    def __init__(self, embed_tokens, norm):
        super().__init__(embed_tokens, norm)
        v, h = embed_tokens.weight.shape
        self.lm_head = nn.Linear(h, v, bias=False)

    def forward(self, ids):
        return self.lm_head(self.norm(self.embed_tokens(ids)))


class ZeroCopiedHead(_Zero):
    def __init__(self, embed_tokens, norm):
        super().__init__(embed_tokens, norm)
        self.head = embed_tokens.weight.detach().clone()  # a copy, not the tied matrix

    def forward(self, ids):
        return F.linear(self.norm(self.embed_tokens(ids)), self.head)


class ZeroNoNorm(_Zero):
    def forward(self, ids):
        return F.linear(self.embed_tokens(ids), self.embed_tokens.weight)


class ZeroSoftmax(_Zero):
    def forward(self, ids):
        return F.linear(self.norm(self.embed_tokens(ids)), self.embed_tokens.weight).softmax(-1)


class ZeroLastOnly(_Zero):
    def forward(self, ids):
        return F.linear(self.norm(self.embed_tokens(ids)), self.embed_tokens.weight)[:, -1:]


# --- the corpus -----------------------------------------------------------------------------------

# (exercise, wrong answer, words the failure message must contain, fails a public check)
CORPUS = [
    ("read_safetensors_header", header_big_endian, "little-endian", True),
    ("read_safetensors_header", header_four_byte_length, "64-bit little-endian", True),
    ("read_safetensors_header", header_whole_file, "read only the 8-byte length", True),
    ("read_safetensors_header", header_unparsed, "json", True),
    ("read_safetensors_header", header_drops_metadata, "__metadata__", True),
    ("read_safetensors_header", header_fixed_chunk, "bytes of JSON follow", False),
    ("rms_norm", NormNoFloat32, "float32 inside", True),
    ("rms_norm", NormNoCastBack, "cast back to the input dtype", True),
    ("rms_norm", NormWeightBeforeCast, "weight multiplies after the cast back", True),
    ("rms_norm", NormEpsOutside, "eps goes inside the square root", True),
    ("rms_norm", NormNoEps, "eps is missing", True),
    ("rms_norm", NormLayerNorm, "subtracts no mean", True),
    ("rms_norm", NormL2, "root mean square", True),
    ("rms_norm", NormFixedEps, "use self.eps", True),
    ("rms_norm", NormZeroCentred, "not by 1 + w", True),
    ("mlp", MLPSiluOnUp, "SiLU goes on gate_proj", True),
    ("mlp", MLPNoActivation, "missing its SiLU", True),
    ("mlp", MLPRelu, "not ReLU", True),
    ("mlp", MLPGelu, "not GELU", True),
    ("mlp", MLPSigmoid, "plain sigmoid", True),
    ("mlp", MLPSiluAfterProduct, "SiLU applies to the gate alone", True),
    ("mlp", MLPWithBiases, "no biases", True),
    ("rope_cos_sin", cos_sin_exponent_i_over_d, "frequency exponent", True),
    ("rope_cos_sin", cos_sin_positive_exponent, "negative exponent", True),
    ("rope_cos_sin", cos_sin_interleaved, "half-split pairs", True),
    ("rope_cos_sin", cos_sin_in_bfloat16, "angles in float32", True),
    ("rope_cos_sin", cos_sin_ignores_dtype, "follows the dtype argument", True),
    ("rope_cos_sin", cos_sin_half_width, "both halves", True),
    ("rotate_half", rotate_half_no_sign, "changes sign", True),
    ("rotate_half", rotate_half_wrong_sign, "sign is on the wrong half", True),
    ("rotate_half", rotate_half_interleaved, "not neighbours", True),
    ("rotate_half", rotate_half_first_dim, "LAST dimension", True),
    ("rotate_half", rotate_half_in_place, "in place", False),
    ("apply_rope", apply_rope_backwards, "backwards", True),
    ("apply_rope", apply_rope_swapped, "cos multiplies x itself", True),
    ("apply_rope", apply_rope_interleaved, "not neighbours", True),
    ("apply_rope", apply_rope_cos_only, "needs both terms", True),
    ("count_params", _count_fn(**WRONG_COUNTS["no_qkv_bias"]), "biases on q_proj", True),
    ("count_params", _count_fn(**WRONG_COUNTS["no_qk_norm"]), "QK-Norm", True),
    ("count_params", _count_fn(**WRONG_COUNTS["no_o_bias"]), "bias on o_proj", True),
    ("count_params", count_ignores_attention_bias, "attention_bias", True),
    ("count_params", _count_fn(**WRONG_COUNTS["head_dim_from_hidden"]), "head_dim", True),
    ("count_params", _count_fn(**WRONG_COUNTS["no_gqa"]), "num_key_value_heads", True),
    ("count_params", _count_fn(**WRONG_COUNTS["one_norm_per_layer"]), "two RMSNorms", True),
    ("count_params", _count_fn(**WRONG_COUNTS["no_final_norm"]), "final norm", True),
    ("count_params", _count_fn(**WRONG_COUNTS["tied_head_twice"]), "tied head once", True),
    ("count_params", _count_fn(**WRONG_COUNTS["untied_head_once"]), "untied head", True),
    ("count_params", count_total_once, "total counts the head", True),
    ("count_params", count_requires_kv_heads, "num_key_value_heads", False),
    ("zero_layer_lm", ZeroUntiedHead, "weight tying", True),
    ("zero_layer_lm", ZeroCopiedHead, "weight tying", True),
    ("zero_layer_lm", ZeroNoNorm, "final norm", True),
    ("zero_layer_lm", ZeroSoftmax, "not probabilities", True),
    ("zero_layer_lm", ZeroLastOnly, "shape", True),
]


@pytest.mark.parametrize("case", CORPUS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CORPUS)])
def test_wrong_answer_fails(case):
    exercise, wrong, words, is_public = case
    result = run_checks(f"ch00.{exercise}", wrong, hidden=not is_public)
    assert result.status == "failed", (exercise, wrong, result)
    assert words.lower() in result.message.lower(), result.message
    if not is_public:  # a mistake the prose does not single out: the hidden checks catch it
        assert run_checks(f"ch00.{exercise}", wrong).ok, "expected to pass the public checks"


def test_corpus_is_large_and_every_reference_passes():
    assert len(CORPUS) >= 40
    for exercise in {c[0] for c in CORPUS}:
        result = run_checks(f"ch00.{exercise}", reference(f"ch00.{exercise}"), hidden=True)
        assert result.ok, result.line()
