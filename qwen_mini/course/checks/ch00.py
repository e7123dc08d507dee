"""Checks for chapter 0 (safetensors header, RMSNorm, SwiGLU, RoPE, parameter counts, tied head).

Every check tests the object it is given on small seeded inputs. The expected values come from
the package reference, from values worked out by hand, from the `safetensors` library, and from
invariants (scale invariance, rotations preserving norms, relative positions).

Every mistake the chapter warns about fails a public check whose message names the idea: the
checks compute the typical wrong answers too (`_diagnose`), and when the learner's output matches
one of them, the message says which idea is wrong instead of only showing a differing number.
tests/test_wrong_answers_ch00.py holds a corpus of such wrong answers, each required to fail.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from qwen_mini import mlp, norms, rope, safetensors_file
from qwen_mini.architectures import config_from_dict
from qwen_mini.config import ASSETS, Config
from qwen_mini.course.checking import (
    expect_close,
    expect_equal,
    hidden,
    public,
    randn,
    register,
)
from qwen_mini.course.lab import ch00 as lab
from qwen_mini.course.observing import observe
from qwen_mini.model import CausalLM

register(
    "ch00.read_safetensors_header",
    reference=safetensors_file.read_safetensors_header,
    points=1,
    title="Read the JSON header of a safetensors file",
)
register("ch00.rms_norm", reference=norms.RMSNorm, points=1, title="RMSNorm, computed in float32")
register("ch00.mlp", reference=mlp.MLP, points=1, title="SwiGLU feed-forward block")
register(
    "ch00.rope_cos_sin",
    reference=rope.rope_cos_sin,
    points=1,
    title="RoPE angles: cos and sin per position",
)
register(
    "ch00.rotate_half",
    reference=rope.rotate_half,
    points=1,
    title="rotate_half: the partner vector that sin multiplies",
)
register(
    "ch00.apply_rope", reference=rope.apply_rope, points=1, title="Apply rotary position embeddings"
)
register(
    "ch00.count_params",
    reference=lab.count_params,
    points=2,
    title="Parameter count of a dense Qwen model from its config",
)
register(
    "ch00.zero_layer_lm",
    reference=lab.ZeroLayerLM,
    points=1,
    title="Zero-layer model: embedding -> final norm -> tied head",
)


def _diagnose(name: str, got, expected, wrong: dict, atol: float, rtol: float) -> None:
    """expect_close, but if `got` matches one of the typical wrong answers in `wrong`
    ({idea: tensor}), the message starts with that idea."""
    try:
        expect_close(name, got, expected, atol=atol, rtol=rtol)
    except AssertionError as failure:
        if isinstance(got, torch.Tensor):
            g = got.detach().double()
            for idea, w in wrong.items():
                w = w.detach().double()
                if g.shape == w.shape and torch.allclose(g, w, atol=max(atol, 1e-6), rtol=rtol):
                    raise AssertionError(f"{idea} — {failure}") from None
        raise


def _write(data: bytes) -> Path:
    path = Path(tempfile.mkdtemp(prefix="qwen_mini_ch00_")) / "check.safetensors"
    path.write_bytes(data)
    return path


# --- read_safetensors_header --------------------------------------------------------------------


def _read(read_safetensors_header, path: Path):
    """Call the learner's function; if it crashes, explain the layout of the 8-byte prefix."""
    try:
        return read_safetensors_header(path)
    except NotImplementedError:
        raise
    except Exception as e:
        first = path.open("rb").read(8)
        little, big = struct.unpack("<Q", first)[0], struct.unpack(">Q", first)[0]
        raise AssertionError(
            f"your code raised {type(e).__name__}: {e}. The first 8 bytes ({first.hex(' ')}) are "
            f"the header length, an unsigned 64-bit little-endian integer: {little} bytes of JSON "
            f"follow (read big-endian they would claim {big:,} bytes)"
        ) from None


@public("ch00.read_safetensors_header")
def _(read_safetensors_header):
    # written by hand: header length 8 bytes little-endian, JSON, then 16 bytes of float32 data
    head = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    text = json.dumps(head).encode()
    path = _write(struct.pack("<Q", len(text)) + text + bytes(16))
    got = _read(read_safetensors_header, path)
    if isinstance(got, (str, bytes, bytearray)):
        raise AssertionError(
            f"expected a dict, got {type(got).__name__}: parse the header bytes as JSON"
        )
    expect_equal("header of a hand-written file", got, head)
    expect_equal("header read from a str path", _read(read_safetensors_header, str(path)), head)


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
    h = _read(read_safetensors_header, path)
    expect_equal(
        "tensor names",
        sorted(k for k in h if k != "__metadata__"),
        ["model.embed_tokens.weight", "model.norm.weight"],
    )
    expect_equal(
        "__metadata__ (keep every entry of the header, the metadata included)",
        h.get("__metadata__"),
        {"format": "pt"},
    )
    expect_equal(
        "model.embed_tokens.weight",
        h["model.embed_tokens.weight"],
        {
            "dtype": "BF16",
            "shape": [3, 4],
            "data_offsets": h["model.embed_tokens.weight"]["data_offsets"],
        },
    )
    reference = safetensors_file.read_safetensors_header(path)
    expect_equal("the whole header vs the reference", h, reference)


_BIG = 64 * 2**20  # bytes of tensor data after the header in the "read only the header" check


@public("ch00.read_safetensors_header", "reads only the header, not the tensor data")
def _(read_safetensors_header):
    # a small header followed by 64 MiB of (sparse, so free to create) tensor data: reading the
    # header must not allocate memory for the data. A real checkpoint's data is 1.5 GB.
    head = {"big": {"dtype": "U8", "shape": [_BIG], "data_offsets": [0, _BIG]}}
    text = json.dumps(head).encode()
    path = Path(tempfile.mkdtemp(prefix="qwen_mini_ch00_")) / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
    os.truncate(path, 8 + len(text) + _BIG)
    try:
        with observe("peak_memory") as seen:  # made where the code runs (when graded: there)
            got = _read(read_safetensors_header, path)
        peak = seen.value
    finally:
        path.unlink()
    if peak > _BIG // 4:
        raise AssertionError(
            f"reading the header allocated {peak / 2**20:.0f} MiB for a file of "
            f"{(_BIG + len(text) + 8) / 2**20:.0f} MiB: read only the 8-byte length and the "
            "header, not the whole file (a real checkpoint holds 1.5 GB of tensor data after it)"
        )
    expect_equal("header of a file with 64 MiB of data", got, head)


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
    got = _read(read_safetensors_header, path)
    expect_equal("long, padded header followed by binary data", got, head)


@hidden("ch00.read_safetensors_header")
def _(read_safetensors_header):
    # a 300 kB header (a real 0.6B header is about 40 kB; sharded MoE checkpoints are larger):
    # the length is read from the file, never assumed
    head = {
        f"model.layers.{i}.mlp.experts.{e}.down_proj.weight": {
            "dtype": "BF16",
            "shape": [4, 4],
            "data_offsets": [32 * (128 * i + e), 32 * (128 * i + e) + 32],
        }
        for i in range(24)
        for e in range(128)
    }
    text = json.dumps(head).encode()
    path = _write(struct.pack("<Q", len(text)) + text + bytes(32 * 24 * 128))
    expect_equal(
        f"header of {len(text):,} bytes (read the length from the file)",
        _read(read_safetensors_header, path),
        head,
    )


# --- RMSNorm ------------------------------------------------------------------------------------


def _norm(cls, dim, weight=None, eps=None):
    m = cls(dim) if eps is None else cls(dim, eps)
    if weight is not None:
        with torch.no_grad():
            m.weight.copy_(weight)
    return m


def _norm_wrong(x: torch.Tensor, eps: float) -> dict:
    """The typical wrong normalisations of x (weight 1), in float64, by the idea they miss."""
    x = x.double()
    ms = x.pow(2).mean(-1, keepdim=True)
    centred = x - x.mean(-1, keepdim=True)
    return {
        "eps goes inside the square root, added to the mean of squares": x / (ms.sqrt() + eps),
        "eps is missing: it is added to the mean of squares (it guards tiny vectors)": x
        / ms.sqrt(),
        "RMSNorm subtracts no mean (that is LayerNorm)": centred
        / (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt(),
        "root MEAN square: divide by sqrt(mean of squares), not by the vector's length": x
        / (x.pow(2).sum(-1, keepdim=True) + eps).sqrt(),
        "divide by the root mean square; do not multiply": x * (ms + eps).sqrt(),
        "Qwen3's RMSNorm multiplies by the weight w (initialised to ones), not by 1 + w "
        "(the zero-centred norm of Qwen3.5)": 2 * x / (ms + eps).sqrt(),
    }


@public("ch00.rms_norm")
def _(RMSNorm):
    m = RMSNorm(8)
    expect_equal(
        "parameter names (they must match the checkpoint)",
        sorted(n for n, _ in m.named_parameters()),
        ["weight"],
    )
    expect_equal("weight shape", tuple(m.weight.shape), (8,))
    expect_close("weight initialised to ones", m.weight, torch.ones(8), atol=0, rtol=0)
    # worked by hand: x = [3, 4]: mean of squares 12.5, so x / sqrt(12.5)
    x = torch.tensor([[3.0, 4.0]])
    _diagnose(
        "RMSNorm(2, eps=0)([3, 4]) = [3, 4] / sqrt(12.5)",
        RMSNorm(2, eps=0.0)(x),
        x / math.sqrt(12.5),
        _norm_wrong(x, 0.0),
        atol=1e-6,
        rtol=1e-6,
    )


@public("ch00.rms_norm", "eps placement: on a tiny vector eps matters")
def _(RMSNorm):
    # mean of squares 1e-6, eps 1e-2: x / sqrt(1e-6 + 1e-2) = 1e-3 / 0.10005
    tiny = torch.full((1, 4), 1e-3)
    _diagnose(
        "RMSNorm(4, eps=1e-2) on [1e-3] * 4",
        RMSNorm(4, eps=1e-2)(tiny),
        tiny / math.sqrt(1e-6 + 1e-2),
        {
            **_norm_wrong(tiny, 1e-2),
            "use self.eps, the eps given to the constructor, not a constant": tiny
            / math.sqrt(1e-6 + 1e-6),
        },
        atol=1e-7,
        rtol=1e-5,
    )


@public("ch00.rms_norm")
def _(RMSNorm):
    x, w = randn(2, 3, 16, seed=1), randn(16, seed=2)
    expect_close(
        "float32 input, random weight, vs reference",
        _norm(RMSNorm, 16, w)(x),
        _norm(norms.RMSNorm, 16, w)(x),
        atol=1e-6,
        rtol=1e-5,
    )


def _bf16_norm_checks(RMSNorm, x: torch.Tensor, w: torch.Tensor) -> None:
    """bfloat16 in: dtype kept; float32 inside (weight 1); weight after the cast back."""
    dim = x.shape[-1]
    got = _norm(RMSNorm, dim, w).bfloat16()(x)
    expect_equal(
        "dtype of the output for bfloat16 input (cast back to the input dtype)",
        got.dtype,
        torch.bfloat16,
    )
    ones = _norm(RMSNorm, dim).bfloat16()(x)
    expect_close(
        "float32 inside: with weight 1 and bfloat16 input, normalise in float32 and round once "
        "to bfloat16 at the end (a bfloat16 computation rounds every step)",
        ones.float(),
        _norm(norms.RMSNorm, dim).bfloat16()(x).float(),
        atol=0,
        rtol=0,
    )
    expect_close(
        "the weight multiplies after the cast back to bfloat16, as in the reference (the "
        "product in float32, cast afterwards, rounds differently)",
        got.float(),
        _norm(norms.RMSNorm, dim, w).bfloat16()(x).float(),
        atol=0,
        rtol=0,
    )


@public("ch00.rms_norm", "bfloat16 input: float32 inside, cast back, then times the weight")
def _(RMSNorm):
    xb, wb = (randn(4, 64, seed=3) * 5).bfloat16(), (1 + randn(64, seed=4) / 4).bfloat16()
    _bf16_norm_checks(RMSNorm, xb, wb)


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
    # large values in bfloat16: squares near 1e6 must not be rounded or overflow
    xb = (randn(2, 128, seed=6) * 1000).bfloat16()
    expect_close(
        "large bfloat16 values",
        RMSNorm(128)(xb).float(),
        norms.RMSNorm(128)(xb).float(),
        atol=0,
        rtol=0,
    )


@hidden("ch00.rms_norm")
def _(RMSNorm):
    # another width, batch shape and seed in bfloat16; default eps is 1e-6
    xb = (randn(2, 5, 96, seed=21) * 3).bfloat16()
    wb = (randn(96, seed=22) / 2).bfloat16()
    _bf16_norm_checks(RMSNorm, xb, wb)
    tiny = torch.full((2, 8), 1e-4)
    expect_close(
        "default eps (1e-6) on a tiny vector",
        RMSNorm(8)(tiny),
        tiny / math.sqrt(1e-8 + 1e-6),
        atol=1e-7,
        rtol=1e-5,
    )


# --- MLP (SwiGLU) -------------------------------------------------------------------------------


def _mlp_wrong(m, x: torch.Tensor) -> dict:
    g, u, down = m.gate_proj(x), m.up_proj(x), m.down_proj
    return {
        "SiLU goes on gate_proj's output (the gate), not on up_proj's": down(g * F.silu(u)),
        "the gate is missing its SiLU": down(g * u),
        "the activation is SiLU, z * sigmoid(z), not ReLU": down(F.relu(g) * u),
        "the activation is SiLU, z * sigmoid(z), not GELU": down(F.gelu(g) * u),
        "the activation is SiLU, z * sigmoid(z), not the plain sigmoid of the original GLU": down(
            torch.sigmoid(g) * u
        ),
        "SiLU applies to the gate alone, before the product with up_proj's output": down(
            F.silu(g * u)
        ),
        "no up_proj: the gate multiplies up_proj's output": down(F.silu(g)),
    }


@public("ch00.mlp")
def _(MLP):
    m = MLP(8, 16)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    expect_equal(
        "parameters (checkpoint names and [out, in] shapes, no biases)",
        shapes,
        {"gate_proj.weight": (16, 8), "up_proj.weight": (16, 8), "down_proj.weight": (8, 16)},
    )


def _mlp_vs_reference(MLP, hidden_size: int, inter: int, seed: int) -> None:
    torch.manual_seed(seed)
    r = mlp.MLP(hidden_size, inter)
    m = MLP(hidden_size, inter)
    m.load_state_dict(r.state_dict())
    x = randn(2, 3, hidden_size, seed=seed + 7)
    with torch.no_grad():
        _diagnose(
            f"MLP({hidden_size}, {inter}) vs reference, same weights",
            m(x),
            r(x),
            _mlp_wrong(r, x),
            atol=1e-6,
            rtol=1e-5,
        )


@public("ch00.mlp")
def _(MLP):
    _mlp_vs_reference(MLP, 8, 16, seed=0)


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
    _mlp_vs_reference(MLP, 12, 20, seed=1)
    torch.manual_seed(1)
    m = MLP(12, 20)
    x = randn(1, 5, 12, seed=8)
    with torch.no_grad():
        m.gate_proj.weight.zero_()
    expect_close(
        "a closed gate (silu(0) = 0) gives zero", m(x), torch.zeros(1, 5, 12), atol=0, rtol=0
    )


# --- RoPE ---------------------------------------------------------------------------------------


def _angles_wrong(positions: torch.Tensor, head_dim: int, theta: float) -> dict:
    """cos of the typical wrong angle tables, by the idea they miss (float64)."""
    p = positions.double()[:, None]
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    right = theta ** (-2 * i / head_dim)
    return {
        "the frequency exponent: pair i turns at theta^(-2i/D), not theta^(-i/D)": torch.cat(
            [p * theta ** (-i / head_dim)] * 2, -1
        ),
        "the frequency falls with i: theta^(-2i/D), a negative exponent": torch.cat(
            [p * theta ** (2 * i / head_dim)] * 2, -1
        ),
        "half-split pairs: the angles of pairs 0..D/2-1 repeat in the second half "
        "(dims i and i + D/2 share an angle), not interleaved [a0, a0, a1, a1, ...]": (
            (p * right).repeat_interleave(2, -1)
        ),
    }


def _cos_wrong(positions, head_dim, theta) -> dict:
    return {k: v.cos() for k, v in _angles_wrong(positions, head_dim, theta).items()}


@public("ch00.rope_cos_sin")
def _(rope_cos_sin):
    cos, sin = rope_cos_sin(torch.arange(5), 8, 10000.0)
    expect_equal(
        "shapes [T, head_dim] (both halves of each pair)",
        (tuple(cos.shape), tuple(sin.shape)),
        ((5, 8), (5, 8)),
    )
    expect_equal("dtype (default float32)", cos.dtype, torch.float32)
    expect_close("position 0: cos = 1", cos[0], torch.ones(8), atol=0, rtol=0)
    expect_close("position 0: sin = 0", sin[0], torch.zeros(8), atol=0, rtol=0)


@public("ch00.rope_cos_sin")
def _(rope_cos_sin):
    # worked by hand: head_dim 4, theta 100: frequencies 100^0 = 1 and 100^(-2/4) = 0.1;
    # at position 3 the angles are [3, 0.3] for both halves
    pos = torch.tensor([3])
    cos, sin = rope_cos_sin(pos, 4, 100.0)
    angles = torch.tensor([[3.0, 0.3, 3.0, 0.3]])
    _diagnose(
        "cos at position 3 (head_dim 4, theta 100)",
        cos,
        angles.cos(),
        _cos_wrong(pos, 4, 100.0),
        atol=1e-6,
        rtol=1e-6,
    )
    expect_close(
        "sin at position 3 (head_dim 4, theta 100)", sin, angles.sin(), atol=1e-6, rtol=1e-6
    )


@public("ch00.rope_cos_sin")
def _(rope_cos_sin):
    pos = torch.tensor([0, 1, 7, 100, 4000])
    (cos, sin), (rcos, rsin) = rope_cos_sin(pos, 16, 1e6), rope.rope_cos_sin(pos, 16, 1e6)
    _diagnose(
        "cos vs reference (head_dim 16, theta 1e6)",
        cos,
        rcos,
        _cos_wrong(pos, 16, 1e6),
        atol=1e-6,
        rtol=1e-5,
    )
    expect_close("sin vs reference (head_dim 16, theta 1e6)", sin, rsin, atol=1e-6, rtol=1e-5)


def _far_positions(rope_cos_sin, pos: torch.Tensor, head_dim: int, theta: float) -> None:
    got = rope_cos_sin(pos, head_dim, theta, torch.bfloat16)
    want = rope.rope_cos_sin(pos, head_dim, theta, torch.bfloat16)
    expect_equal("dtype of cos follows the dtype argument", got[0].dtype, torch.bfloat16)
    expect_equal("dtype of sin follows the dtype argument", got[1].dtype, torch.bfloat16)
    for g, w, what in zip(got, want, ("cos", "sin"), strict=True):
        expect_close(
            f"{what} at positions {pos.tolist()} with bfloat16 output: compute the angles in "
            "float32 and cast only cos and sin (bfloat16 rounds 30,001 to 29,952: a whole "
            "radian is lost after a few positions)",
            g.float(),
            w.float(),
            atol=1e-2,
            rtol=0,
        )


@public("ch00.rope_cos_sin", "angles in float32 at positions in the tens of thousands")
def _(rope_cos_sin):
    _far_positions(rope_cos_sin, torch.tensor([30000, 30001, 40959]), 128, 1e6)


@hidden("ch00.rope_cos_sin")
def _(rope_cos_sin):
    pos = torch.randint(0, 20000, (7,), generator=torch.Generator().manual_seed(31))
    for head_dim, theta in ((64, 10000.0), (6, 500.0)):
        (cos, sin), (rcos, rsin) = (
            rope_cos_sin(pos, head_dim, theta),
            rope.rope_cos_sin(pos, head_dim, theta),
        )
        what = f"(head_dim {head_dim}, theta {theta:g}, random positions)"
        expect_close(f"cos vs reference {what}", cos, rcos, atol=1e-4, rtol=1e-4)
        expect_close(f"sin vs reference {what}", sin, rsin, atol=1e-4, rtol=1e-4)
    _far_positions(rope_cos_sin, torch.tensor([17000, 25000, 32767]), 64, 1e4)


def _rotate_wrong(x: torch.Tensor) -> dict:
    x1, x2 = x.chunk(2, dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return {
        "one half changes sign: a quarter turn maps (a, b) to (-b, a)": torch.cat([x2, x1], -1),
        "the sign is on the wrong half: a quarter turn maps (a, b) to (-b, a), not (b, -a)": (
            torch.cat([x2, -x1], -1)
        ),
        "pairs are (i, i + D/2), the two halves, not neighbours (2i, 2i + 1)": torch.stack(
            [-odd, even], -1
        ).flatten(-2),
    }


@public("ch00.rotate_half")
def _(rotate_half):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    _diagnose(
        "rotate_half([1, 2, 3, 4]) (pairs (1, 3) and (2, 4))",
        rotate_half(x),
        torch.tensor([-3.0, -4.0, 1.0, 2.0]),
        _rotate_wrong(x),
        atol=0,
        rtol=0,
    )


@public("ch00.rotate_half")
def _(rotate_half):
    x = randn(2, 3, 5, 8, seed=9)
    want, wrong = rope.rotate_half(x), _rotate_wrong(x)
    wrong["split the LAST dimension (the head dimension), not the first"] = torch.cat(
        [-x.chunk(2, 0)[1], x.chunk(2, 0)[0]], 0
    )
    _diagnose(
        "rotate_half vs reference on [2, 3, 5, 8]",
        rotate_half(x),
        want,
        wrong,
        atol=0,
        rtol=0,
    )


@hidden("ch00.rotate_half")
def _(rotate_half):
    x = randn(4, 6, seed=10)
    before = x.clone()
    twice = rotate_half(rotate_half(x))
    expect_close("x is not modified in place", x, before, atol=0, rtol=0)
    expect_close("rotating twice negates", twice, -x, atol=0, rtol=0)
    expect_close(
        "x . rotate_half(x) = 0 (a quarter turn)",
        (x * rotate_half(x)).sum(-1),
        torch.zeros(4),
        atol=1e-5,
        rtol=0,
    )


def _rope(apply_rope, x, positions, theta=10000.0):
    cos, sin = rope.rope_cos_sin(torch.as_tensor(positions), x.shape[-1], theta)
    return apply_rope(x, cos, sin)


def _rope_wrong(x, cos, sin) -> dict:
    rh = rope.rotate_half(x)
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., 0::2], sin[..., 0::2]  # an (interleaved) pair's angle
    return {
        "rotate forwards: each pair turns by +angle (a cos - b sin, b cos + a sin); "
        "this turns it backwards": x * cos - rh * sin,
        "cos multiplies x itself and sin its quarter-turned partner, not the other way round": (
            x * sin + rh * cos
        ),
        "the rotation needs both terms: x alone times cos is not a rotation": x * cos,
        "pairs are (i, i + D/2), not neighbours (2i, 2i + 1)": torch.stack(
            [even * c - odd * s, odd * c + even * s], -1
        ).flatten(-2),
    }


@public("ch00.apply_rope")
def _(apply_rope):
    x = randn(2, 3, 6, 16, seed=11)
    cos, sin = rope.rope_cos_sin(torch.arange(6), 16, 10000.0)
    _diagnose(
        "apply_rope vs reference",
        apply_rope(x, cos, sin),
        rope.apply_rope(x, cos, sin),
        _rope_wrong(x, cos, sin),
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
        "(1, 0) at positions 0, 1, 2 -> (cos p, sin p): a forward (anticlockwise) turn by p",
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
    y = randn(3, 1, 9, 12, seed=16)
    cos, sin = rope.rope_cos_sin(torch.arange(40, 49), 12, 1e6)
    expect_close(
        "apply_rope vs reference on [3, 1, 9, 12] at positions 40..48",
        apply_rope(y, cos, sin),
        rope.apply_rope(y, cos, sin),
        atol=1e-5,
        rtol=1e-5,
    )


# --- count_params -------------------------------------------------------------------------------

# the released config.json files (assets/configs)
_CONFIGS = ASSETS / "configs"
_QWEN3_06B = json.loads((_CONFIGS / "qwen3-0.6b" / "config.json").read_text())
_QWEN25_05B = json.loads((_CONFIGS / "qwen2.5-0.5b" / "config.json").read_text())
_KEYS = ["embed_tokens", "layers", "lm_head", "norm", "per_layer", "total", "unique"]


def _count(c: dict, mistake: str = "") -> dict:
    """The parameter count written out again, independently of the reference, with one typical
    `mistake` made on purpose (the names are the ideas the diagnosis reports)."""
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    n_q = c["num_attention_heads"]
    n_kv = n_q if mistake == "gqa" else c.get("num_key_value_heads", n_q)
    d = h // n_q if mistake == "head_dim" else (c.get("head_dim") or h // n_q)
    qwen2 = c["model_type"] == "qwen2"
    bias = not qwen2 and c.get("attention_bias", False)
    per_layer = 2 * h * n_q * d + 2 * h * n_kv * d  # q, o; k, v
    if qwen2 and mistake != "qkv_bias":
        per_layer += n_q * d + 2 * n_kv * d
    if not qwen2 and mistake != "qk_norm":
        per_layer += 2 * d
    if bias and mistake != "attention_bias":
        per_layer += n_q * d + 2 * n_kv * d + (0 if mistake == "o_bias" else h)
    per_layer += (2 if mistake == "mlp" else 3) * h * inter
    per_layer += {"layer_norms": 0, "one_norm": h}.get(mistake, 2 * h)
    final = 0 if mistake == "final_norm" else h
    layers = per_layer * c["num_hidden_layers"]
    total = vocab * h + layers + final + vocab * h
    tied = c.get("tie_word_embeddings", False)
    unique = total - vocab * h if tied else total
    if mistake == "unique_twice":
        unique = total
    if mistake == "total_once":
        total = unique
    if mistake == "untied_once":
        unique = total - vocab * h
    return {
        "embed_tokens": vocab * h,
        "per_layer": per_layer,
        "layers": layers,
        "norm": final,
        "lm_head": vocab * h,
        "total": total,
        "unique": unique,
    }


_COUNT_IDEAS = {
    "qkv_bias": "Qwen2 / Qwen2.5 have biases on q_proj, k_proj and v_proj (n_q*d + 2*n_kv*d "
    "per layer)",
    "qk_norm": "Qwen3 has QK-Norm: q_norm and k_norm, one RMSNorm weight of head_dim each per "
    "layer",
    "attention_bias": "attention_bias: true adds biases on q, k, v and o",
    "o_bias": "attention_bias: true puts a bias on o_proj too (hidden_size)",
    "head_dim": "head_dim comes from the config when it is there (Qwen3-0.6B: 128, not "
    "hidden_size / heads = 64)",
    "gqa": "k_proj and v_proj have num_key_value_heads heads (grouped-query attention), not "
    "num_attention_heads",
    "mlp": "SwiGLU has three matrices (gate, up, down)",
    "layer_norms": "each layer has two RMSNorms (input_layernorm, post_attention_layernorm)",
    "one_norm": "each layer has two RMSNorms (input_layernorm, post_attention_layernorm)",
    "final_norm": "the final norm (model.norm, hidden_size) counts too",
    "unique_twice": "unique counts the tied head once: it is the embedding matrix",
    "total_once": "total counts the head even when tied (the checkpoint stores the copy)",
    "untied_once": "an untied head (tie_word_embeddings false) is a matrix of its own: unique "
    "counts it",
}


def _expect_counts(what: str, got: dict, config: dict, keys=None) -> None:
    """Compare with the independent count; name the idea when a known mistake explains it."""
    want = _count(config)
    keys = keys or _KEYS
    if not isinstance(got, dict):
        raise AssertionError(f"{what}: expected a dict with keys {_KEYS}, got {type(got).__name__}")
    missing = [k for k in keys if k not in got]
    if missing:
        raise AssertionError(f"{what}: missing keys {missing} (expected {_KEYS})")
    for k in keys:
        if got[k] == want[k]:
            continue
        ideas = [
            idea
            for m, idea in _COUNT_IDEAS.items()
            if _count(config, m)[k] != want[k] and _count(config, m)[k] == got[k]
        ]
        hint = f" — {ideas[0]}" if ideas else ""
        shown = f"{got[k]:,}" if isinstance(got[k], int) else repr(got[k])
        raise AssertionError(f"{what}, {k!r}: expected {want[k]:,}, got {shown}{hint}")


@public("ch00.count_params")
def _(count_params):
    c = count_params(dict(_QWEN3_06B))
    expect_equal("keys of the result", sorted(c) if isinstance(c, dict) else c, _KEYS)
    expect_equal("Qwen3-0.6B embed_tokens (151,936 x 1,024)", c["embed_tokens"], 155_582_464)
    _expect_counts("Qwen3-0.6B", c, _QWEN3_06B, ["per_layer", "layers", "norm", "total"])
    expect_equal("Qwen3-0.6B total (tied head counted twice)", c["total"], 751_632_384)
    _expect_counts("Qwen3-0.6B", c, _QWEN3_06B)
    expect_equal("Qwen3-0.6B unique (the tied head counted once)", c["unique"], 596_049_920)


@public("ch00.count_params")
def _(count_params):
    c = count_params(dict(_QWEN25_05B))
    _expect_counts("Qwen2.5-0.5B (QKV biases, head_dim = 896 / 14)", c, _QWEN25_05B)
    expect_equal("Qwen2.5-0.5B unique", c["unique"], 494_032_768)
    expect_equal(
        "Qwen2.5-0.5B: the whole result vs reference", c, lab.count_params(dict(_QWEN25_05B))
    )


def _model_count(d: dict) -> tuple[int, int]:
    """(unique, total) of a real qwen_mini model built from the (tiny) config."""
    m = CausalLM(config_from_dict(d))
    unique = sum(p.numel() for p in m.parameters())
    total = sum(p.numel() for _, p in m.named_parameters(remove_duplicate=False))
    return unique, total


_TINY = dict(
    vocab_size=50,
    hidden_size=12,
    intermediate_size=20,
    num_hidden_layers=3,
    num_attention_heads=3,
    max_position_embeddings=64,
)


def _count_cases(count_params, cases: dict) -> None:
    for what, d in cases.items():
        c = count_params(dict(d))
        _expect_counts(what, c, d)
        unique, total = _model_count(d)
        expect_equal(f"{what}: unique vs the parameters of a built model", c["unique"], unique)
        expect_equal(f"{what}: total (a tied head counted twice)", c["total"], total)


@public("ch00.count_params", "an untied Qwen3 with attention_bias: true")
def _(count_params):
    d = dict(
        _TINY,
        model_type="qwen3",
        num_key_value_heads=1,
        head_dim=8,
        attention_bias=True,
        tie_word_embeddings=False,
    )
    _count_cases(count_params, {"qwen3, untied, attention_bias (biases on q, k, v and o)": d})


@hidden("ch00.count_params")
def _(count_params):
    _count_cases(
        count_params,
        {
            "qwen3, tied, no head_dim key": dict(
                _TINY, model_type="qwen3", num_key_value_heads=3, tie_word_embeddings=True
            ),
            "qwen2, untied, no num_key_value_heads": dict(
                _TINY, model_type="qwen2", tie_word_embeddings=False
            ),
            "qwen3, tied, GQA 4:1, head_dim 6, 5 layers": dict(
                _TINY,
                model_type="qwen3",
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=6,
                num_hidden_layers=5,
                tie_word_embeddings=True,
            ),
        },
    )


# --- zero-layer model ---------------------------------------------------------------------------


def _tiny_tied_model(seed: int, vocab: int = 40, hidden: int = 16) -> CausalLM:
    cfg = Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=0,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    m = CausalLM(cfg)
    with torch.no_grad():
        m.model.norm.weight.copy_(1 + randn(hidden, seed=seed) / 4)
    return m.eval()


def _zero_vs_model(ZeroLayerLM, m: CausalLM, ids: torch.Tensor) -> None:
    emb, norm = m.model.embed_tokens, m.model.norm
    z = ZeroLayerLM(emb, norm)
    own = [
        n
        for n, p in z.named_parameters()
        if p is not emb.weight and p is not norm.weight  # anything but the two shared tensors
    ]
    if own:
        raise AssertionError(
            f"weight tying: the head IS the embedding matrix, but your model has parameters of "
            f"its own: {own}. Use embed_tokens.weight as the head's weight."
        )
    with torch.no_grad():
        got, want = z(ids), m(ids)
        x = emb(ids)
        wrong = {
            "the final norm comes before the head: embedding -> norm -> head": F.linear(
                x, emb.weight
            ),
            "return logits (scores), not probabilities: no softmax": want.softmax(-1),
            "return logits (scores), not log-probabilities": want.log_softmax(-1),
            "the norm goes between the embedding and the head, not after the head": norm(
                F.linear(x, emb.weight)
            )
            if emb.weight.shape[0] == norm.weight.shape[0]
            else want + 1,
        }
    B, T = ids.shape
    expect_equal("output shape [B, T, vocab]", tuple(got.shape), (B, T, emb.weight.shape[0]))
    _diagnose(
        "vs a qwen_mini model with num_hidden_layers = 0",
        got,
        want,
        wrong,
        atol=1e-5,
        rtol=1e-5,
    )


@public("ch00.zero_layer_lm")
def _(ZeroLayerLM):
    m = _tiny_tied_model(0)
    _zero_vs_model(ZeroLayerLM, m, torch.tensor([[1, 5, 9, 39], [0, 2, 2, 7]]))


@public("ch00.zero_layer_lm", "weight tying: the head reads the embedding itself, not a copy")
def _(ZeroLayerLM):
    emb = torch.nn.Embedding(12, 6)
    with torch.no_grad():
        emb.weight.copy_(randn(12, 6, seed=2))
    z = ZeroLayerLM(emb, torch.nn.Identity())
    ids = torch.tensor([[3, 0, 11]])
    with torch.no_grad():
        before = z(ids)
        emb.weight.mul_(2)  # training changes the embedding: the tied head changes with it
        expect_close(
            "weight tying: after scaling the embedding by 2 the logits scale by 4 (the head "
            "must be the embedding matrix itself, not a copy taken at construction)",
            z(ids),
            4 * before,
            atol=1e-4,
            rtol=1e-5,
        )


@public("ch00.zero_layer_lm")
def _(ZeroLayerLM):
    # rows of equal length and a unit norm weight: by Cauchy-Schwarz each token scores itself
    # highest, so the model predicts its input back
    emb = torch.nn.Embedding(30, 16)
    with torch.no_grad():
        emb.weight.copy_(F.normalize(randn(30, 16, seed=1), dim=-1))
    z = ZeroLayerLM(emb, norms.RMSNorm(16))
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
    m = _tiny_tied_model(3, vocab=57, hidden=24)
    ids = torch.randint(0, 57, (3, 6), generator=torch.Generator().manual_seed(5))
    _zero_vs_model(ZeroLayerLM, m, ids)
