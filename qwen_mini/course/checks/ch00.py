"""Checks for chapter 0 (safetensors header, RMSNorm, SwiGLU, RoPE, parameter counts, tied head).

Every check tests the object it is given on small seeded inputs. The expected values come from
the package reference, from values worked out by hand, from the `safetensors` library, and from
invariants (scale invariance, rotations preserving norms, relative positions).
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from qwen_mini import foundations as ref
from qwen_mini.config import ASSETS, Config
from qwen_mini.course.checking import (
    expect_close,
    expect_equal,
    hidden,
    public,
    randn,
    register,
)
from qwen_mini.model import CausalLM

register(
    "ch00.read_safetensors_header",
    reference=ref.read_safetensors_header,
    points=1,
    title="Read the JSON header of a safetensors file",
)
register("ch00.rms_norm", reference=ref.RMSNorm, points=1, title="RMSNorm, computed in float32")
register("ch00.mlp", reference=ref.MLP, points=1, title="SwiGLU feed-forward block")
register(
    "ch00.rope_cos_sin",
    reference=ref.rope_cos_sin,
    points=1,
    title="RoPE angles: cos and sin per position",
)
register(
    "ch00.rotate_half",
    reference=ref.rotate_half,
    points=1,
    title="rotate_half: (x1, x2) -> (-x2, x1)",
)
register(
    "ch00.apply_rope", reference=ref.apply_rope, points=1, title="Apply rotary position embeddings"
)
register(
    "ch00.count_params",
    reference=ref.count_params,
    points=2,
    title="Parameter count of a dense Qwen model from its config",
)
register(
    "ch00.zero_layer_lm",
    reference=ref.ZeroLayerLM,
    points=1,
    title="Zero-layer model: embedding -> final norm -> tied head",
)


def _write(data: bytes) -> Path:
    path = Path(tempfile.mkdtemp(prefix="qwen_mini_ch00_")) / "check.safetensors"
    path.write_bytes(data)
    return path


# --- read_safetensors_header --------------------------------------------------------------------


@public("ch00.read_safetensors_header")
def _(read_safetensors_header):
    # written by hand: header length 8 bytes little-endian, JSON, then 16 bytes of float32 data
    head = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    text = json.dumps(head).encode()
    path = _write(struct.pack("<Q", len(text)) + text + bytes(16))
    expect_equal("header of a hand-written file", read_safetensors_header(path), head)
    expect_equal("header read from a str path", read_safetensors_header(str(path)), head)


@public("ch00.read_safetensors_header")
def _(read_safetensors_header):
    path = Path(tempfile.mkdtemp(prefix="qwen_mini_ch00_")) / "saved.safetensors"
    save_file(
        {
            "model.norm.weight": torch.ones(4),
            "model.embed_tokens.weight": torch.zeros(3, 4, dtype=torch.bfloat16),
        },
        path,
        metadata={"format": "pt"},
    )
    h = read_safetensors_header(path)
    expect_equal(
        "tensor names",
        sorted(k for k in h if k != "__metadata__"),
        ["model.embed_tokens.weight", "model.norm.weight"],
    )
    expect_equal("__metadata__", h.get("__metadata__"), {"format": "pt"})
    expect_equal(
        "model.embed_tokens.weight",
        h["model.embed_tokens.weight"],
        {
            "dtype": "BF16",
            "shape": [3, 4],
            "data_offsets": h["model.embed_tokens.weight"]["data_offsets"],
        },
    )
    expect_equal("the whole header vs the reference", h, ref.read_safetensors_header(path))


@hidden("ch00.read_safetensors_header")
def _(read_safetensors_header):
    # a header longer than 255 bytes (the length needs two bytes, little-endian), padded with
    # spaces as safetensors pads to 8-byte alignment, followed by data that is not JSON
    head = {
        f"model.layers.{i}.mlp.up_proj.weight": {
            "dtype": "BF16",
            "shape": [1],
            "data_offsets": [2 * i, 2 * i + 2],
        }
        for i in range(12)
    }
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    path = _write(struct.pack("<Q", len(text)) + text + b"\xff" * 24)
    expect_equal("long, padded header followed by binary data", read_safetensors_header(path), head)


# --- RMSNorm ------------------------------------------------------------------------------------


def _norm(cls, dim, weight=None, eps=None):
    m = cls(dim) if eps is None else cls(dim, eps)
    if weight is not None:
        with torch.no_grad():
            m.weight.copy_(weight)
    return m


@public("ch00.rms_norm")
def _(RMSNorm):
    m = RMSNorm(8)
    expect_equal(
        "parameter names (they must match the checkpoint)",
        sorted(n for n, _ in m.named_parameters()),
        ["weight"],
    )
    expect_equal("weight shape", tuple(m.weight.shape), (8,))
    # worked by hand: x = [3, 4]: mean of squares 12.5, so x / sqrt(12.5 + eps)
    x = torch.tensor([[3.0, 4.0]])
    expect_close(
        "RMSNorm(2)([3, 4])",
        RMSNorm(2, eps=0.0)(x),
        torch.tensor([[3.0, 4.0]]) / math.sqrt(12.5),
        atol=1e-6,
        rtol=1e-6,
    )


@public("ch00.rms_norm")
def _(RMSNorm):
    x, w = randn(2, 3, 16, seed=1), randn(16, seed=2)
    expect_close(
        "float32 input, random weight",
        _norm(RMSNorm, 16, w)(x),
        _norm(ref.RMSNorm, 16, w)(x),
        atol=1e-6,
        rtol=1e-5,
    )
    # normalise in float32, cast back to bfloat16, then multiply by the weight: bit for bit
    xb, wb = (randn(4, 64, seed=3) * 5).bfloat16(), (1 + randn(64, seed=4) / 4).bfloat16()
    got = _norm(RMSNorm, 64, wb).bfloat16()(xb)
    expect_equal("dtype of the output for bfloat16 input", got.dtype, torch.bfloat16)
    expect_close(
        "bfloat16 input (float32 inside, cast back, then times weight)",
        got.float(),
        _norm(ref.RMSNorm, 64, wb).bfloat16()(xb).float(),
        atol=0,
        rtol=0,
    )


@hidden("ch00.rms_norm")
def _(RMSNorm):
    x = randn(3, 32, seed=5)
    m = RMSNorm(32)
    expect_close(
        "scale invariance: norm(1000 x) == norm(x)", m(1000 * x), m(x), atol=1e-5, rtol=1e-5
    )
    expect_close(
        "root mean square of the output (weight 1)",
        m(x).pow(2).mean(-1).sqrt(),
        torch.ones(3),
        atol=1e-5,
        rtol=0,
    )
    tiny = torch.full((1, 4), 1e-3)
    expect_close(
        "eps is used: RMSNorm(4, eps=1e-2) on a tiny vector",
        RMSNorm(4, eps=1e-2)(tiny),
        tiny / math.sqrt(1e-6 + 1e-2),
        atol=1e-7,
        rtol=1e-5,
    )
    # large values in bfloat16: squares near 1e6 must not be rounded or overflow
    xb = (randn(2, 128, seed=6) * 1000).bfloat16()
    expect_close(
        "large bfloat16 values",
        RMSNorm(128)(xb).float(),
        ref.RMSNorm(128)(xb).float(),
        atol=0,
        rtol=0,
    )


# --- MLP (SwiGLU) -------------------------------------------------------------------------------


@public("ch00.mlp")
def _(MLP):
    m = MLP(8, 16)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    expect_equal(
        "parameters (checkpoint names and [out, in] shapes, no biases)",
        shapes,
        {"gate_proj.weight": (16, 8), "up_proj.weight": (16, 8), "down_proj.weight": (8, 16)},
    )


@public("ch00.mlp")
def _(MLP):
    torch.manual_seed(0)
    r = ref.MLP(8, 16)
    m = MLP(8, 16)
    m.load_state_dict(r.state_dict())
    x = randn(2, 3, 8, seed=7)
    expect_close("MLP vs reference, same weights", m(x), r(x), atol=1e-6, rtol=1e-5)


@public("ch00.mlp")
def _(MLP):
    # worked by hand with all weights 1 and width 1: down(silu(x) * x) = x * sigmoid(x) * x
    m = MLP(1, 1)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(1.0)
    x = torch.tensor([[[2.0], [-1.0]]])
    expect_close(
        "MLP(1, 1) with unit weights: x^2 * sigmoid(x)",
        m(x),
        x * x * torch.sigmoid(x),
        atol=1e-6,
        rtol=1e-6,
    )


@hidden("ch00.mlp")
def _(MLP):
    torch.manual_seed(1)
    r = ref.MLP(12, 20)
    m = MLP(12, 20)
    m.load_state_dict(r.state_dict())
    x = randn(1, 5, 12, seed=8)
    expect_close("gate and up are not swapped", m(x), r(x), atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        m.gate_proj.weight.zero_()
    expect_close(
        "a closed gate (silu(0) = 0) gives zero", m(x), torch.zeros(1, 5, 12), atol=0, rtol=0
    )


# --- RoPE ---------------------------------------------------------------------------------------


@public("ch00.rope_cos_sin")
def _(rope_cos_sin):
    cos, sin = rope_cos_sin(torch.arange(5), 8, 10000.0)
    expect_equal("shapes", (tuple(cos.shape), tuple(sin.shape)), ((5, 8), (5, 8)))
    expect_equal("dtype (default float32)", cos.dtype, torch.float32)
    expect_close("position 0: cos = 1", cos[0], torch.ones(8), atol=0, rtol=0)
    expect_close("position 0: sin = 0", sin[0], torch.zeros(8), atol=0, rtol=0)


@public("ch00.rope_cos_sin")
def _(rope_cos_sin):
    # worked by hand: head_dim 4, theta 100: frequencies 100^0 = 1 and 100^(-2/4) = 0.1;
    # at position 3 the angles are [3, 0.3] for both halves
    cos, sin = rope_cos_sin(torch.tensor([3]), 4, 100.0)
    angles = torch.tensor([[3.0, 0.3, 3.0, 0.3]])
    expect_close(
        "cos at position 3 (head_dim 4, theta 100)", cos, angles.cos(), atol=1e-6, rtol=1e-6
    )
    expect_close(
        "sin at position 3 (head_dim 4, theta 100)", sin, angles.sin(), atol=1e-6, rtol=1e-6
    )


@public("ch00.rope_cos_sin")
def _(rope_cos_sin):
    pos = torch.tensor([0, 1, 7, 100, 4000])
    for got, want, what in zip(
        rope_cos_sin(pos, 16, 1e6), ref.rope_cos_sin(pos, 16, 1e6), ("cos", "sin"), strict=True
    ):
        expect_close(
            f"{what} vs reference (head_dim 16, theta 1e6)", got, want, atol=1e-6, rtol=1e-5
        )


@hidden("ch00.rope_cos_sin")
def _(rope_cos_sin):
    # far positions, bfloat16 requested: the angles themselves must be computed in float32
    pos = torch.tensor([30000, 30001, 40959])
    got = rope_cos_sin(pos, 128, 1e6, torch.bfloat16)
    want = ref.rope_cos_sin(pos, 128, 1e6, torch.bfloat16)
    expect_equal("dtype follows the argument", got[0].dtype, torch.bfloat16)
    expect_close(
        "cos at far positions, bfloat16 output", got[0].float(), want[0].float(), atol=1e-2, rtol=0
    )
    expect_close(
        "sin at far positions, bfloat16 output", got[1].float(), want[1].float(), atol=1e-2, rtol=0
    )


@public("ch00.rotate_half")
def _(rotate_half):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expect_equal("rotate_half([1, 2, 3, 4])", rotate_half(x).tolist(), [-3.0, -4.0, 1.0, 2.0])


@public("ch00.rotate_half")
def _(rotate_half):
    x = randn(2, 3, 5, 8, seed=9)
    expect_close(
        "rotate_half vs reference on [2, 3, 5, 8]",
        rotate_half(x),
        ref.rotate_half(x),
        atol=0,
        rtol=0,
    )


@hidden("ch00.rotate_half")
def _(rotate_half):
    x = randn(4, 6, seed=10)
    expect_close("rotating twice negates", rotate_half(rotate_half(x)), -x, atol=0, rtol=0)
    expect_close(
        "x . rotate_half(x) = 0 (a quarter turn)",
        (x * rotate_half(x)).sum(-1),
        torch.zeros(4),
        atol=1e-5,
        rtol=0,
    )


def _rope(apply_rope, x, positions, theta=10000.0):
    cos, sin = ref.rope_cos_sin(torch.as_tensor(positions), x.shape[-1], theta)
    return apply_rope(x, cos, sin)


@public("ch00.apply_rope")
def _(apply_rope):
    x = randn(2, 3, 6, 16, seed=11)
    cos, sin = ref.rope_cos_sin(torch.arange(6), 16, 10000.0)
    expect_close(
        "apply_rope vs reference",
        apply_rope(x, cos, sin),
        ref.apply_rope(x, cos, sin),
        atol=1e-6,
        rtol=1e-5,
    )


@public("ch00.apply_rope")
def _(apply_rope):
    # worked by hand: head_dim 2 is one pair rotated by the angle p (theta irrelevant)
    x = torch.tensor([1.0, 0.0]).expand(1, 1, 3, 2)
    got = _rope(apply_rope, x, [0, 1, 2])
    p = torch.tensor([0.0, 1.0, 2.0])
    expect_close(
        "(1, 0) at positions 0, 1, 2 -> (cos p, sin p)",
        got[0, 0],
        torch.stack([p.cos(), p.sin()], -1),
        atol=1e-6,
        rtol=1e-6,
    )
    y = randn(1, 2, 4, 8, seed=12)
    expect_close(
        "a rotation keeps the length of every vector",
        _rope(apply_rope, y, range(4)).norm(dim=-1),
        y.norm(dim=-1),
        atol=1e-5,
        rtol=0,
    )


@hidden("ch00.apply_rope")
def _(apply_rope):
    q, k = randn(1, 1, 1, 32, seed=13), randn(1, 1, 1, 32, seed=14)
    x = randn(1, 2, 1, 32, seed=15)
    expect_close(
        "position 0 leaves the vector unchanged", _rope(apply_rope, x, [0]), x, atol=0, rtol=0
    )
    s1 = (_rope(apply_rope, q, [7]) * _rope(apply_rope, k, [3])).sum()
    s2 = (_rope(apply_rope, q, [107]) * _rope(apply_rope, k, [103])).sum()
    expect_close(
        "q.k depends on the distance only: (7, 3) vs (107, 103)", s2, s1, atol=1e-4, rtol=1e-4
    )


# --- count_params -------------------------------------------------------------------------------

# the released config.json files (assets/configs)
_CONFIGS = ASSETS / "configs"
_QWEN3_06B = json.loads((_CONFIGS / "qwen3-0.6b" / "config.json").read_text())
_QWEN25_05B = json.loads((_CONFIGS / "qwen2.5-0.5b" / "config.json").read_text())
_KEYS = ["embed_tokens", "layers", "lm_head", "norm", "per_layer", "total", "unique"]


@public("ch00.count_params")
def _(count_params):
    c = count_params(dict(_QWEN3_06B))
    expect_equal("keys of the result", sorted(c), _KEYS)
    expect_equal("Qwen3-0.6B embed_tokens (151,936 x 1,024)", c["embed_tokens"], 155_582_464)
    expect_equal("Qwen3-0.6B total (tied head counted twice)", c["total"], 751_632_384)
    expect_equal("Qwen3-0.6B unique", c["unique"], 596_049_920)


@public("ch00.count_params")
def _(count_params):
    c = count_params(dict(_QWEN25_05B))
    expect_equal("Qwen2.5-0.5B unique (QKV biases, head_dim = 896 / 14)", c["unique"], 494_032_768)
    expect_equal(
        "Qwen2.5-0.5B: the whole result vs reference", c, ref.count_params(dict(_QWEN25_05B))
    )


def _model_count(d: dict) -> tuple[int, int]:
    """(unique, total) of a real qwen_mini model built from the (tiny) config."""
    m = CausalLM(Config.from_dict(d))
    unique = sum(p.numel() for p in m.parameters())
    total = sum(p.numel() for _, p in m.named_parameters(remove_duplicate=False))
    return unique, total


@hidden("ch00.count_params")
def _(count_params):
    tiny = dict(
        vocab_size=50,
        hidden_size=12,
        intermediate_size=20,
        num_hidden_layers=3,
        num_attention_heads=3,
        max_position_embeddings=64,
    )
    cases = {
        "qwen3, untied, attention_bias (biases on q, k, v and o)": dict(
            tiny,
            model_type="qwen3",
            num_key_value_heads=1,
            head_dim=8,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
        "qwen3, tied, no head_dim key": dict(
            tiny, model_type="qwen3", num_key_value_heads=3, tie_word_embeddings=True
        ),
        "qwen2, untied, no num_key_value_heads": dict(
            tiny, model_type="qwen2", tie_word_embeddings=False
        ),
    }
    for what, d in cases.items():
        c = count_params(dict(d))
        unique, total = _model_count(d)
        expect_equal(f"{what}: unique vs the parameters of a built model", c["unique"], unique)
        expect_equal(f"{what}: total (a tied head counted twice)", c["total"], total)
        expect_equal(f"{what}: the whole result vs reference", c, ref.count_params(dict(d)))


# --- zero-layer model ---------------------------------------------------------------------------


def _tiny_tied_model(seed: int) -> CausalLM:
    cfg = Config.from_dict(
        dict(
            model_type="qwen3",
            vocab_size=40,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=0,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    )
    torch.manual_seed(seed)
    m = CausalLM(cfg)
    with torch.no_grad():
        m.model.norm.weight.copy_(1 + randn(16, seed=seed) / 4)
    return m.eval()


@public("ch00.zero_layer_lm")
def _(ZeroLayerLM):
    m = _tiny_tied_model(0)
    ids = torch.tensor([[1, 5, 9, 39], [0, 2, 2, 7]])
    z = ZeroLayerLM(m.model.embed_tokens, m.model.norm)
    with torch.no_grad():
        got, want = z(ids), m(ids)
    expect_equal("output shape [B, T, vocab]", tuple(got.shape), (2, 4, 40))
    expect_close("vs a qwen_mini model with num_hidden_layers = 0", got, want, atol=1e-5, rtol=1e-5)


@public("ch00.zero_layer_lm")
def _(ZeroLayerLM):
    # rows of equal length and a unit norm weight: by Cauchy-Schwarz each token scores itself
    # highest, so the model predicts its input back
    emb = torch.nn.Embedding(30, 16)
    with torch.no_grad():
        emb.weight.copy_(F.normalize(randn(30, 16, seed=1), dim=-1))
    z = ZeroLayerLM(emb, ref.RMSNorm(16))
    ids = torch.arange(30)[None]
    with torch.no_grad():
        expect_equal(
            "top-1 prediction of every token is itself", z(ids).argmax(-1).tolist(), ids.tolist()
        )


@hidden("ch00.zero_layer_lm")
def _(ZeroLayerLM):
    # with an identity norm the logits are exactly e_i . e_j: the head is the embedding itself
    emb = torch.nn.Embedding(12, 6)
    with torch.no_grad():
        emb.weight.copy_(randn(12, 6, seed=2))
    z = ZeroLayerLM(emb, torch.nn.Identity())
    ids = torch.tensor([[3, 0, 11]])
    with torch.no_grad():
        expect_close(
            "identity norm: logits = E[ids] @ E.T",
            z(ids),
            (emb.weight[ids] @ emb.weight.T),
            atol=1e-5,
            rtol=1e-5,
        )
        emb.weight.mul_(2)  # the head must read the current embedding, not a copy
        expect_close(
            "after scaling the embedding by 2, logits scale by 4",
            z(ids),
            (emb.weight[ids] @ emb.weight.T),
            atol=1e-4,
            rtol=1e-5,
        )
