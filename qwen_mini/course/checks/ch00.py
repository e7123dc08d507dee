"""Checks for chapter 0 (safetensors header, RMSNorm, SwiGLU, RoPE, parameter counts, tied head).

Each exercise is a list of cases and a catalogue of typical mistakes whose ideas the messages name.
The expected values come from the package reference, from values worked out by hand, from the
`safetensors` library, and from a model built from the config (its parameter count).
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
from torch import nn

from qwen_mini import mlp, norms, rope, safetensors_file
from qwen_mini.architectures import architecture, config_from_dict
from qwen_mini.config import ASSETS, Config
from qwen_mini.course.checking import (
    between,
    exception_text,
    mistake,
    named,
    randn,
    register,
)
from qwen_mini.course.lab import ch00 as lab
from qwen_mini.course.observing import observe
from qwen_mini.course.variants import bfloat16, case
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


# --- read_safetensors_header --------------------------------------------------------------------

HEADER = "ch00.read_safetensors_header"
LENGTH = "the first 8 bytes are the header length, an unsigned 64-bit little-endian integer"


def _file(data: bytes, size: int | None = None, name: str = "check.safetensors") -> Path:
    path = Path(tempfile.mkdtemp(prefix="qwen_mini_ch00_")) / name
    path.write_bytes(data)
    if size is not None:
        os.truncate(path, size)  # sparse: free to create
    return path


def _with_header(head: dict, data: bytes = b"", pad: bool = False) -> bytes:
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8 if pad else 0)  # safetensors pads to 8-byte alignment
    return struct.pack("<Q", len(text)) + text + data


def _read(read_safetensors_header, path):
    """The learner's header; if their code crashes, explain the layout of the 8-byte prefix."""
    try:
        return read_safetensors_header(path)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:
        first = Path(path).open("rb").read(8)
        little, big = struct.unpack("<Q", first)[0], struct.unpack(">Q", first)[0]
        raise AssertionError(
            f"your code raised {exception_text(e)}. {LENGTH} ({first.hex(' ')}): {little} "
            f"bytes of JSON follow (read big-endian they would claim {big:,} bytes)"
        ) from None


HAND = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
case(
    HEADER,
    "header of a hand-written file (length, JSON, 16 bytes of float32 data)",
    lambda g: (_file(_with_header(HAND, bytes(16))),),
    _read,
    lambda path: HAND,
)
case(
    HEADER,
    "header read from a str path",
    lambda g: (str(_file(_with_header(HAND, bytes(16)))),),
    _read,
    lambda path: HAND,
)


def _saved(g):
    path = Path(tempfile.mkdtemp(prefix="qwen_mini_ch00_")) / "saved.safetensors"
    tensors = {
        "model.norm.weight": torch.ones(4),
        "model.embed_tokens.weight": torch.zeros(3, 4, dtype=torch.bfloat16),
    }
    save_file(tensors, path, metadata={"format": "pt"})
    return (path,)


case(HEADER, "a file saved by safetensors, with __metadata__ (keep every entry)", _saved, _read)

BIG = 64 * 2**20  # bytes of tensor data after the header: reading the header must not load them
BIG_HEAD = {"big": {"dtype": "U8", "shape": [BIG], "data_offsets": [0, BIG]}}


def _big_file(g):
    data = _with_header(BIG_HEAD)
    return (_file(data, len(data) + BIG),)


def _read_measured(read_safetensors_header, path):
    """The header, and whether reading it allocated less than a quarter of the data."""
    try:
        with observe("peak_memory") as seen:  # made where the code runs (when graded: there)
            got = _read(read_safetensors_header, path)
        peak = seen.value
    finally:
        path.unlink()
    return {
        "the header": got,
        "memory allocated below 16 MiB (read only the header)": peak < BIG // 4,
    }


case(
    HEADER,
    "reads only the header, not the 64 MiB of tensor data after it",
    _big_file,
    _read_measured,
)


def _long_header(g):  # longer than 255 bytes (the length needs two bytes), padded, then binary
    n = between(g, 8, 16)
    head = {
        f"model.layers.{i}.mlp.up_proj.weight": {
            "dtype": "BF16",
            "shape": [1],
            "data_offsets": [2 * i, 2 * i + 2],
        }
        for i in range(n)
    }
    return (_file(_with_header(head, b"\xff" * 2 * n, pad=True)),)


def _huge_header(g):  # about 300 kB (a real 0.6B header is about 40 kB): the length is read
    layers, experts = between(g, 20, 24), 128
    head = {
        f"model.layers.{i}.mlp.experts.{e}.down_proj.weight": {
            "dtype": "BF16",
            "shape": [4, 4],
            "data_offsets": [32 * (experts * i + e), 32 * (experts * i + e) + 32],
        }
        for i in range(layers)
        for e in range(experts)
    }
    return (_file(_with_header(head, bytes(32 * layers * experts))),)


TRUST = (
    "a length the file cannot hold was trusted: compare it with the file's size "
    "(os.path.getsize) before reading, and raise a ValueError that names the file"
)


def _refusal(read_safetensors_header, path):
    """What the learner's reader does with a length the file cannot hold."""
    try:
        got = read_safetensors_header(path)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:
        return {
            # json's and the codecs' errors are ValueErrors too, but say nothing of the length
            "raises a ValueError": isinstance(e, ValueError)
            and not isinstance(e, json.JSONDecodeError | UnicodeError),
            # its name: when graded, the learner's code sees the file at another path
            "the message names the file": Path(path).name in str(e),
        }
    raise AssertionError(f"{TRUST}; your code returned {type(got).__name__} instead")


SHARD = "model-00002-of-00004.safetensors"  # which file of a checkpoint is broken?


def _cut_short(g):  # a download that stopped inside the header
    data = _with_header(HAND, bytes(16))
    return (_file(data[: between(g, 20, 40)], name=SHARD),)


def _absurd_length(g):  # 8 bytes that were never a length: reading that many needs exabytes
    return (_file(struct.pack("<Q", 2 ** between(g, 60, 63)) + b"{}" + bytes(16), name=SHARD),)


case(HEADER, "a download that stopped inside the header (refuse it)", _cut_short, _refusal)
case(HEADER, "a length of 2**60 bytes or more (refuse it)", _absurd_length, _refusal, hidden=True)
case(HEADER, "a long, padded header followed by binary data", _long_header, _read, hidden=True)
case(HEADER, "a 300 kB header (read the length from the file)", _huge_header, _read, hidden=True)


@mistake(HEADER, TRUST)
def header_trusts_length(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


@mistake(HEADER, LENGTH, name="header_big_endian")
def header_big_endian(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack(">Q", f.read(8))
        return json.loads(f.read(n))


@mistake(HEADER, LENGTH, name="header_four_byte_length")
def header_four_byte_length(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<I", f.read(4))
        return json.loads(f.read(n))


@mistake(
    HEADER,
    "reading the header allocated memory for the whole file: read only the 8-byte length and the "
    "header, not the whole file (a real checkpoint holds 1.5 GB of tensor data after it)",
)
def header_whole_file(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


@mistake(HEADER, "the header is a str: parse the header bytes as JSON (json.loads) into a dict")
def header_unparsed(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode()


@mistake(HEADER, "__metadata__ is missing: keep every entry of the header, the metadata included")
def header_drops_metadata(path):
    h = safetensors_file.read_safetensors_header(path)
    return {k: v for k, v in h.items() if k != "__metadata__"}


@mistake(HEADER, f"a fixed chunk of 64 KiB was read: {LENGTH}, read that many", public=False)
def header_fixed_chunk(path):
    with open(path, "rb") as f:
        chunk = f.read(65536)  # "headers are small"
    (n,) = struct.unpack("<Q", chunk[:8])
    if n > os.path.getsize(path) - 8:
        raise ValueError(f"{path}: truncated")
    return json.loads(chunk[8 : 8 + n])


@mistake(
    HEADER,
    "the error does not name the file: put the path in the ValueError's message (a checkpoint "
    "has many shards; the learner must know which one to download again)",
)
def header_refusal_unnamed(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > os.path.getsize(path) - 8:
            raise ValueError("the header is longer than the file")
        return json.loads(f.read(n))


# --- RMSNorm ------------------------------------------------------------------------------------

NORM = "ch00.rms_norm"


def _norm(cls, dim, weight=None, eps=None, dtype=torch.float32):
    m = cls(dim) if eps is None else cls(dim, eps)
    if weight is not None:
        with torch.no_grad():
            m.weight.copy_(weight)
    return m.to(dtype)


def _normed(RMSNorm, x, weight=None, eps=None):
    with torch.no_grad():
        return _norm(RMSNorm, x.shape[-1], weight, eps, x.dtype)(x)


def _parameters(RMSNorm):
    m = RMSNorm(8)
    return {
        "parameter names (they must match the checkpoint)": sorted(
            n for n, _ in m.named_parameters()
        ),
        "weight, initialised to ones": m.weight.detach(),
    }


def _bf16(RMSNorm, x, weight):
    return {
        "weight 1: normalise in float32, round once to bfloat16 at the end, cast back to the "
        "input dtype": _normed(RMSNorm, x),
        "the weight multiplies after the cast back to bfloat16": _normed(RMSNorm, x, weight),
    }


case(NORM, "parameters", lambda g: (), _parameters)
case(
    NORM,
    "RMSNorm(2, eps=0)([3, 4]) = [3, 4] / sqrt(12.5) (mean of squares 12.5)",
    lambda g: (torch.tensor([[3.0, 4.0]]), None, 0.0),
    _normed,
    lambda x, w, eps: x / math.sqrt(12.5),
    atol=1e-6,
    rtol=1e-6,
)
case(
    NORM,
    "eps placement: RMSNorm(4, eps=1e-2) on [1e-3] * 4 = 1e-3 / sqrt(1e-6 + 1e-2)",
    lambda g: (torch.full((1, 4), 1e-3), None, 1e-2),
    _normed,
    lambda x, w, eps: x / math.sqrt(1e-6 + 1e-2),
    atol=1e-7,
    rtol=1e-5,
)
case(
    NORM,
    "float32 input, random weight",
    lambda g: (randn(2, 3, 16, g=g), randn(16, g=g)),
    _normed,
    atol=1e-6,
    rtol=1e-5,
    seed=1,
)
case(
    NORM,
    "bfloat16 input: float32 inside, cast back, then times the weight",
    lambda g: ((randn(4, 64, g=g) * 5).bfloat16(), (1 + randn(64, g=g) / 4).bfloat16()),
    _bf16,
    seed=3,
)
case(
    NORM,
    "large values, other widths",
    lambda g: (randn(3, 4 * between(g, 4, 32), g=g) * 1000,),
    _normed,
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)
case(
    NORM,
    "bfloat16, other widths",
    lambda g: ((randn(2, 5, 96, g=g) * 3).bfloat16(), (randn(96, g=g) / 2).bfloat16()),
    _bf16,
    hidden=True,
)
case(
    NORM,
    "default eps (1e-6) on a tiny vector",
    lambda g: (torch.full((2, 8), 1e-4),),
    _normed,
    lambda x: x / math.sqrt(1e-8 + 1e-6),
    atol=1e-7,
    rtol=1e-5,
    hidden=True,
)


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        return self.weight * self.normalise(x.float()).to(dtype)


def _ms(x):
    return x.pow(2).mean(-1, keepdim=True)


@mistake(
    NORM,
    "float32 inside: normalise in float32 and round once at the end (a bfloat16 computation "
    "rounds every step)",
)
class NormNoFloat32(_Norm):
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(_ms(x) + self.eps))


@mistake(NORM, "the output is float32: cast back to the input dtype")
class NormNoCastBack(_Norm):
    def forward(self, x):
        x = x.float()
        return self.weight * (x * torch.rsqrt(_ms(x) + self.eps))


@mistake(
    NORM,
    "the weight multiplies after the cast back, as in the reference (the product in float32, "
    "cast afterwards, rounds differently)",
)
class NormWeightBeforeCast(_Norm):
    def forward(self, x):
        y = x.float()
        return (self.weight * (y * torch.rsqrt(_ms(y) + self.eps))).to(x.dtype)


@mistake(NORM, "eps goes inside the square root, added to the mean of squares")
class NormEpsOutside(_Norm):
    def normalise(self, x):
        return x / (_ms(x).sqrt() + self.eps)


@mistake(NORM, "eps is missing: it is added to the mean of squares (it guards tiny vectors)")
class NormNoEps(_Norm):
    def normalise(self, x):
        return x * torch.rsqrt(_ms(x))


@mistake(NORM, "RMSNorm subtracts no mean (that is LayerNorm)")
class NormLayerNorm(_Norm):
    def normalise(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(_ms(x) + self.eps)


@mistake(NORM, "root MEAN square: divide by sqrt(mean of squares), not by the vector's length")
class NormL2(_Norm):
    def normalise(self, x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.eps)


@mistake(NORM, "divide by the root mean square; do not multiply")
class NormMultiplies(_Norm):
    def normalise(self, x):
        return x * torch.sqrt(_ms(x) + self.eps)


@mistake(NORM, "use self.eps, the eps given to the constructor, not a constant")
class NormFixedEps(_Norm):
    def normalise(self, x):
        return x * torch.rsqrt(_ms(x) + 1e-6)


@mistake(
    NORM,
    "Qwen3's RMSNorm multiplies by the weight w (initialised to ones), not by 1 + w (the "
    "zero-centred norm of Qwen3.5)",
)
class NormZeroCentred(_Norm):
    def forward(self, x):
        y = x.float()
        return (1 + self.weight) * (y * torch.rsqrt(_ms(y) + self.eps)).to(x.dtype)


# --- MLP (SwiGLU) -------------------------------------------------------------------------------

MLP = "ch00.mlp"


def _mlp_shapes(MLP):
    return {
        "parameters (checkpoint names and [out, in] shapes, no biases)": {
            n: tuple(p.shape) for n, p in MLP(8, 16).named_parameters()
        }
    }


def _mlp_inputs(hidden, inter):
    def inputs(g):
        weights = {
            "gate_proj.weight": randn(inter, hidden, g=g) / math.sqrt(hidden),
            "up_proj.weight": randn(inter, hidden, g=g) / math.sqrt(hidden),
            "down_proj.weight": randn(hidden, inter, g=g) / math.sqrt(inter),
        }
        return weights, randn(2, 3, hidden, g=g)

    return inputs


def _mlp_output(MLP, weights, x):
    inter, hidden = weights["gate_proj.weight"].shape
    m = MLP(hidden, inter)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(weights.get(name, torch.zeros_like(p)))
        return m(x)


def _mlp_output_cast(MLP, weights, x):
    """The block made in the input's dtype, as a bfloat16 checkpoint is loaded."""
    inter, hidden = weights["gate_proj.weight"].shape
    m = MLP(hidden, inter)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(weights.get(name, torch.zeros_like(p)))
        return m.to(x.dtype)(x)


def _unit_weights(hidden=1, inter=1):
    return lambda g: (
        {k: torch.ones_like(v) for k, v in _mlp_inputs(hidden, inter)(g)[0].items()},
        torch.tensor([[[2.0], [-1.0]]]),
    )


case(MLP, "parameters", lambda g: (), _mlp_shapes)
case(
    MLP,
    "MLP(8, 16) with given weights",
    _mlp_inputs(8, 16),
    _mlp_output,
    atol=1e-6,
    rtol=1e-5,
    variants=(bfloat16(call=_mlp_output_cast),),
)
case(
    MLP,
    "MLP(1, 1) with unit weights: x^2 * sigmoid(x)",
    _unit_weights(),
    _mlp_output,
    lambda weights, x: x * x * torch.sigmoid(x),
    atol=1e-6,
    rtol=1e-6,
)
case(
    MLP,
    "other widths",
    lambda g: _mlp_inputs(4 * between(g, 1, 6), 4 * between(g, 2, 8))(g),
    _mlp_output,
    atol=1e-6,
    rtol=1e-5,
    hidden=True,
)


class _MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(self.mix(self.gate_proj(x), self.up_proj(x)))


@mistake(MLP, "SiLU goes on gate_proj's output (the gate), not on up_proj's")
class MLPSiluOnUp(_MLP):
    def mix(self, gate, up):
        return gate * F.silu(up)


@mistake(MLP, "the gate is missing its SiLU")
class MLPNoActivation(_MLP):
    def mix(self, gate, up):
        return gate * up


@mistake(MLP, "the activation is SiLU, z * sigmoid(z), not ReLU")
class MLPRelu(_MLP):
    def mix(self, gate, up):
        return F.relu(gate) * up


@mistake(MLP, "the activation is SiLU, z * sigmoid(z), not GELU")
class MLPGelu(_MLP):
    def mix(self, gate, up):
        return F.gelu(gate) * up


@mistake(MLP, "the activation is SiLU, z * sigmoid(z), not the plain sigmoid of the original GLU")
class MLPSigmoid(_MLP):
    def mix(self, gate, up):
        return torch.sigmoid(gate) * up


@mistake(MLP, "SiLU applies to the gate alone, before the product with up_proj's output")
class MLPSiluAfterProduct(_MLP):
    def mix(self, gate, up):
        return F.silu(gate * up)


@mistake(MLP, "no up_proj: the gate multiplies up_proj's output")
class MLPNoUp(_MLP):
    def mix(self, gate, up):
        return F.silu(gate)


@mistake(MLP, "the projections have no biases (the checkpoint holds none)")
class MLPWithBiases(_MLP):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__(hidden_size, intermediate_size, bias=True)

    def mix(self, gate, up):
        return F.silu(gate) * up


# --- RoPE angles --------------------------------------------------------------------------------

ANGLES = "ch00.rope_cos_sin"


def _cos_sin(rope_cos_sin, positions, head_dim, theta, dtype=None):
    got = (
        rope_cos_sin(positions, head_dim, theta)
        if dtype is None
        else rope_cos_sin(positions, head_dim, theta, dtype)
    )
    return named(got, "cos [T, head_dim]", "sin [T, head_dim]")


def _hand_angles(positions, head_dim, theta):  # frequencies 100^0 = 1 and 100^(-2/4) = 0.1
    angles = torch.tensor([[3.0, 0.3, 3.0, 0.3]])
    return {"cos [T, head_dim]": angles.cos(), "sin [T, head_dim]": angles.sin()}


FAR = "angles in float32 at positions in the tens of thousands, bfloat16 cos and sin"
case(
    ANGLES,
    "5 positions, head_dim 8 (both halves of each pair)",
    lambda g: (torch.arange(5), 8, 10000.0),
    _cos_sin,
    atol=1e-6,
    rtol=1e-5,
    variants=("meta",),
)
case(
    ANGLES,
    "hand-worked: position 3, head_dim 4, theta 100: angles [3, 0.3, 3, 0.3]",
    lambda g: (torch.tensor([3]), 4, 100.0),
    _cos_sin,
    _hand_angles,
    atol=1e-6,
    rtol=1e-6,
)
case(
    ANGLES,
    "positions up to 4000, head_dim 16, theta 1e6",
    lambda g: (torch.tensor([0, 1, 7, 100, 4000]), 16, 1e6),
    _cos_sin,
    atol=1e-6,
    rtol=1e-5,
)
case(
    ANGLES,
    FAR,
    lambda g: (torch.tensor([30000, 30001, 40959]), 128, 1e6, torch.bfloat16),
    _cos_sin,
    atol=1e-2,
)
case(
    ANGLES,
    "random positions",
    lambda g: (
        torch.randint(0, 20000, (7,), generator=g),
        (64, 6)[between(g, 0, 1)],
        (1e4, 500.0)[between(g, 0, 1)],
    ),
    _cos_sin,
    atol=1e-4,
    rtol=1e-4,
    hidden=True,
)
case(
    ANGLES,
    f"{FAR} (other positions)",
    lambda g: (torch.randint(17000, 32768, (3,), generator=g), 64, 1e4, torch.bfloat16),
    _cos_sin,
    atol=1e-2,
    hidden=True,
)


def _inv_freq(head_dim, theta, exponent=lambda i, d: -2 * i / d):
    return theta ** exponent(torch.arange(head_dim // 2, dtype=torch.float32), head_dim)


def _halves(angles, dtype):
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@mistake(ANGLES, "the frequency exponent: pair i turns at theta^(-2i/D), not theta^(-i/D)")
def cos_sin_exponent_i_over_d(positions, head_dim, theta, dtype=torch.float32):
    return _halves(
        positions.float()[:, None] * _inv_freq(head_dim, theta, lambda i, d: -i / d), dtype
    )


@mistake(ANGLES, "the frequency falls with i: theta^(-2i/D), a negative exponent")
def cos_sin_positive_exponent(positions, head_dim, theta, dtype=torch.float32):
    return _halves(
        positions.float()[:, None] * _inv_freq(head_dim, theta, lambda i, d: 2 * i / d), dtype
    )


@mistake(
    ANGLES,
    "half-split pairs: the angles of pairs 0..D/2-1 repeat in the second half (dims i and i + D/2 "
    "share an angle), not interleaved [a0, a0, a1, a1, ...]",
)
def cos_sin_interleaved(positions, head_dim, theta, dtype=torch.float32):
    angles = (positions.float()[:, None] * _inv_freq(head_dim, theta)).repeat_interleave(2, -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@mistake(
    ANGLES,
    "compute the angles in float32 and cast only cos and sin (bfloat16 rounds 30,001 to 29,952: "
    "a whole radian is lost after a few positions)",
)
def cos_sin_in_bfloat16(positions, head_dim, theta, dtype=torch.float32):
    angles = positions.to(dtype)[:, None] * _inv_freq(head_dim, theta).to(dtype)
    return _halves(angles, dtype)


@mistake(ANGLES, "the dtype of cos and sin follows the dtype argument")
def cos_sin_ignores_dtype(positions, head_dim, theta, dtype=torch.float32):
    return rope.rope_cos_sin(positions, head_dim, theta)


@mistake(ANGLES, "cos and sin are [T, head_dim]: both halves of each pair, the angles repeated")
def cos_sin_half_width(positions, head_dim, theta, dtype=torch.float32):
    angles = positions.float()[:, None] * _inv_freq(head_dim, theta)
    return angles.cos().to(dtype), angles.sin().to(dtype)


# --- rotate_half --------------------------------------------------------------------------------

ROTATE = "ch00.rotate_half"


def _rotated(rotate_half, x):
    return {"rotate_half(x)": rotate_half(x), "x after the call (not modified in place)": x}


case(
    ROTATE,
    "rotate_half([1, 2, 3, 4]) (pairs (1, 3) and (2, 4))",
    lambda g: (torch.tensor([1.0, 2.0, 3.0, 4.0]),),
    _rotated,
    lambda x: {
        "rotate_half(x)": torch.tensor([-3.0, -4.0, 1.0, 2.0]),
        "x after the call (not modified in place)": x,
    },
)
case(
    ROTATE,
    "a [2, 3, 5, 8] tensor",
    lambda g: (randn(2, 3, 5, 8, g=g),),
    _rotated,
    seed=9,
    variants=("bfloat16",),
)
case(
    ROTATE,
    "other shapes",
    lambda g: (randn(between(g, 2, 5), 2 * between(g, 1, 8), g=g),),
    _rotated,
    hidden=True,
)


@mistake(ROTATE, "one half changes sign: a quarter turn maps (a, b) to (-b, a)")
def rotate_half_no_sign(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x2, x1], dim=-1)


@mistake(
    ROTATE, "the sign is on the wrong half: a quarter turn maps (a, b) to (-b, a), not (b, -a)"
)
def rotate_half_wrong_sign(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x2, -x1], dim=-1)


@mistake(ROTATE, "pairs are (i, i + D/2), the two halves, not neighbours (2i, 2i + 1)")
def rotate_half_interleaved(x):
    return torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)


@mistake(ROTATE, "split the LAST dimension (the head dimension), not the first")
def rotate_half_first_dim(x):
    x1, x2 = x.chunk(2, dim=0)
    return torch.cat([-x2, x1], dim=0)


@mistake(ROTATE, "x was modified in place: return a new tensor and leave the input as it is")
def rotate_half_in_place(x):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].clone(), x[..., d:].clone()
    x[..., :d], x[..., d:] = -x2, x1
    return x


# --- apply_rope ---------------------------------------------------------------------------------

APPLY = "ch00.apply_rope"


def _at(x, positions, theta=10000.0):
    return (x, *rope.rope_cos_sin(torch.as_tensor(positions), x.shape[-1], theta))


case(
    APPLY,
    "[2, 3, 6, 16] at positions 0..5",
    lambda g: _at(randn(2, 3, 6, 16, g=g), range(6)),
    atol=1e-6,
    rtol=1e-5,
    seed=11,
    variants=("bfloat16",),
)
case(
    APPLY,
    "(1, 0) at positions 0, 1, 2 -> (cos p, sin p): a forward (anticlockwise) turn by p",
    lambda g: _at(torch.tensor([1.0, 0.0]).expand(1, 1, 3, 2), [0, 1, 2]),
    expected=lambda x, cos, sin: torch.stack([cos[:, 0], sin[:, 0]], -1).expand(1, 1, 3, 2),
    atol=1e-6,
    rtol=1e-6,
)


def _rope_hidden(g):
    start = between(g, 0, 4000)
    return _at(randn(3, 1, 9, 4 * between(g, 1, 8), g=g), range(start, start + 9), 1e6)


case(APPLY, "other shapes and positions", _rope_hidden, atol=1e-5, rtol=1e-5, hidden=True)


@mistake(
    APPLY,
    "rotate forwards: each pair turns by +angle (a cos - b sin, b cos + a sin); this turns it "
    "backwards",
)
def apply_rope_backwards(x, cos, sin):
    return x * cos - rope.rotate_half(x) * sin


@mistake(
    APPLY, "cos multiplies x itself and sin its quarter-turned partner, not the other way round"
)
def apply_rope_swapped(x, cos, sin):
    return x * sin + rope.rotate_half(x) * cos


@mistake(APPLY, "pairs are (i, i + D/2), not neighbours (2i, 2i + 1)")
def apply_rope_interleaved(x, cos, sin):
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack([even * c - odd * s, odd * c + even * s], -1).flatten(-2)


@mistake(APPLY, "the rotation needs both terms: x alone times cos is not a rotation")
def apply_rope_cos_only(x, cos, sin):
    return x * cos


# --- count_params -------------------------------------------------------------------------------

COUNT = "ch00.count_params"
_CONFIGS = ASSETS / "configs"  # the released config.json files
QWEN3_06B = json.loads((_CONFIGS / "qwen3-0.6b" / "config.json").read_text())
QWEN25_05B = json.loads((_CONFIGS / "qwen2.5-0.5b" / "config.json").read_text())
TINY = dict(
    vocab_size=50,
    hidden_size=12,
    intermediate_size=20,
    num_hidden_layers=3,
    num_attention_heads=3,
    max_position_embeddings=64,
)


def _built(count_params, config):
    c = count_params(dict(config))
    return {"unique": c["unique"], "total (a tied head counted twice)": c["total"]}


def _model_count(config):
    """unique and total of a qwen_mini model built from the (tiny) config."""
    m = CausalLM(config_from_dict(config))
    return {
        "unique": sum(p.numel() for p in m.parameters()),
        "total (a tied head counted twice)": sum(
            p.numel() for _, p in m.named_parameters(remove_duplicate=False)
        ),
    }


ATTENTION_BIAS = dict(
    TINY,
    model_type="qwen3",
    num_key_value_heads=1,
    head_dim=8,
    attention_bias=True,
    tie_word_embeddings=False,
)
case(
    COUNT,
    "Qwen3-0.6B (embed_tokens 155,582,464; total 751,632,384; unique 596,049,920)",
    lambda g: (QWEN3_06B,),
    lambda count_params, config: count_params(dict(config)),
)
case(
    COUNT,
    "Qwen2.5-0.5B (QKV biases, head_dim = 896 / 14)",
    lambda g: (QWEN25_05B,),
    lambda count_params, config: count_params(dict(config)),
)
case(
    COUNT,
    "an untied Qwen3 with attention_bias: true",
    lambda g: (ATTENTION_BIAS,),
    lambda count_params, config: count_params(dict(config)),
)
case(
    COUNT,
    "an untied Qwen3 with attention_bias: true, vs a built model",
    lambda g: (ATTENTION_BIAS,),
    _built,
    _model_count,
)
HIDDEN_CONFIGS = [
    dict(TINY, model_type="qwen3", num_key_value_heads=3, tie_word_embeddings=True),
    dict(TINY, model_type="qwen2", tie_word_embeddings=False),
    dict(
        TINY,
        model_type="qwen3",
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=6,
        num_hidden_layers=5,
        tie_word_embeddings=True,
    ),
]
for n, config in enumerate(HIDDEN_CONFIGS):
    case(
        COUNT,
        f"tiny configs vs a built model {n + 1}",
        lambda g, config=config: (config,),
        _built,
        _model_count,
        hidden=True,
    )


def _counts(config, *, qkv_bias=True, qk_norm=True, o_bias=True, head_dim_key=True, gqa=True,
            norms=2, final=True, tie="right", attention_bias=True):  # fmt: skip
    """The count with one typical mistake made on purpose."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n_q = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_q) if gqa else n_q
    d = (config.get("head_dim") or h // n_q) if head_dim_key else h // n_q
    per_layer = 2 * h * n_q * d + 2 * h * n_kv * d + 3 * h * inter + norms * h
    row = architecture(config["model_type"])
    has_qkv, has_o = row.attention_biases(config_from_dict(config))
    from_flag = not row.qkv_bias  # attention_bias decides (Qwen3), not the row (Qwen2)
    if has_qkv and (attention_bias if from_flag else qkv_bias):
        per_layer += n_q * d + 2 * n_kv * d
    per_layer += h if has_o and o_bias and attention_bias else 0
    per_layer += 2 * d if row.qk_norm and qk_norm else 0
    c = {"embed_tokens": vocab * h, "per_layer": per_layer, "norm": h if final else 0}
    c["layers"] = per_layer * config["num_hidden_layers"]
    c["lm_head"] = vocab * h
    c["total"] = 2 * vocab * h + c["layers"] + c["norm"]
    tied = config.get("tie_word_embeddings", False)
    c["unique"] = {
        "right": c["total"] - (vocab * h if tied else 0),
        "twice": c["total"],
        "always_once": c["total"] - vocab * h,
        "total_once": c["total"] - (vocab * h if tied else 0),
    }[tie]
    if tie == "total_once":
        c["total"] = c["unique"]
    return c


for name, kw, idea in [
    (
        "no_qkv_bias",
        dict(qkv_bias=False),
        "Qwen2 / Qwen2.5 have biases on q_proj, k_proj and v_proj (n_q*d + 2*n_kv*d per layer)",
    ),
    (
        "no_qk_norm",
        dict(qk_norm=False),
        "Qwen3 has QK-Norm: q_norm and k_norm, one RMSNorm weight of head_dim each per layer",
    ),
    (
        "no_o_bias",
        dict(o_bias=False),
        "attention_bias: true puts a bias on o_proj too (hidden_size)",
    ),
    (
        "ignores_attention_bias",
        dict(attention_bias=False),
        "attention_bias: true adds biases on q, k, v and o",
    ),
    (
        "head_dim_from_hidden",
        dict(head_dim_key=False),
        "head_dim comes from the config when it is there (Qwen3-0.6B: 128, not hidden_size / "
        "heads = 64)",
    ),
    (
        "no_gqa",
        dict(gqa=False),
        "k_proj and v_proj have num_key_value_heads heads (grouped-query attention), not "
        "num_attention_heads",
    ),
    (
        "one_norm_per_layer",
        dict(norms=1),
        "each layer has two RMSNorms (input_layernorm, post_attention_layernorm)",
    ),
    ("no_final_norm", dict(final=False), "the final norm (model.norm, hidden_size) counts too"),
    (
        "tied_head_twice",
        dict(tie="twice"),
        "unique counts the tied head once: it is the embedding matrix",
    ),
    (
        "untied_head_once",
        dict(tie="always_once"),
        "an untied head (tie_word_embeddings false) is a matrix of its own: unique counts it",
    ),
    (
        "total_once",
        dict(tie="total_once"),
        "total counts the head even when tied (the checkpoint stores the copy)",
    ),
]:
    mistake(COUNT, idea, name=f"count_{name}")(lambda config, kw=kw: _counts(config, **kw))


@mistake(COUNT, "a config may lack num_key_value_heads: every head has its own k, v", public=False)
def count_requires_kv_heads(config):  # every public config has the key
    if "num_key_value_heads" not in config:
        raise KeyError("num_key_value_heads")
    return _counts(config)


# --- zero-layer model ---------------------------------------------------------------------------

ZERO = "ch00.zero_layer_lm"


def _tied(vocab, hidden, batch, T):
    def inputs(g):
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
        m = CausalLM(cfg)
        with torch.no_grad():
            m.model.embed_tokens.weight.copy_(randn(vocab, hidden, g=g))
            m.model.norm.weight.copy_(1 + randn(hidden, g=g) / 4)
        return m.model.embed_tokens, m.model.norm, torch.randint(0, vocab, (batch, T), generator=g)

    return inputs


def _zero(ZeroLayerLM, emb, norm, ids):
    z = ZeroLayerLM(emb, norm)
    own = [n for n, p in z.named_parameters() if p is not emb.weight and p is not norm.weight]
    with torch.no_grad():
        before = z(ids)
        emb.weight.mul_(2)  # training changes the embedding: the tied head changes with it
        after = z(ids)
    return {
        "parameters of its own (weight tying: the head IS the embedding matrix)": own,
        "logits [B, T, vocab]": before,
        "logits after the embedding is scaled by 2 (4x: the head reads the embedding)": after,
    }


def _self_predicting(g):  # rows of equal length, unit norm weight: each token scores itself highest
    emb = nn.Embedding(30, 16)
    with torch.no_grad():
        emb.weight.copy_(F.normalize(randn(30, 16, g=g), dim=-1))
    return emb, norms.RMSNorm(16), torch.arange(30)[None]


case(
    ZERO,
    "vs a qwen_mini model with num_hidden_layers = 0",
    _tied(40, 16, 2, 4),
    _zero,
    atol=1e-5,
    rtol=1e-5,
)
case(
    ZERO,
    "top-1 prediction of every token is itself",
    _self_predicting,
    lambda Z, emb, norm, ids: Z(emb, norm)(ids).argmax(-1).tolist(),
    lambda emb, norm, ids: ids.tolist(),
    seed=1,
)
case(
    ZERO,
    "other sizes",
    lambda g: _tied(between(g, 20, 60), 8 * between(g, 2, 4), 3, 6)(g),
    _zero,
    atol=1e-5,
    rtol=1e-5,
    hidden=True,
)


class _Zero(nn.Module):
    def __init__(self, embed_tokens, norm):
        super().__init__()
        self.embed_tokens, self.norm = embed_tokens, norm

    def forward(self, ids):
        return F.linear(self.norm(self.embed_tokens(ids)), self.embed_tokens.weight)


@mistake(
    ZERO,
    "weight tying: the head IS the embedding matrix; use embed_tokens.weight as the head's "
    "weight, not a head of its own",
)
class ZeroUntiedHead(_Zero):
    def __init__(self, embed_tokens, norm):
        super().__init__(embed_tokens, norm)
        v, h = embed_tokens.weight.shape
        self.lm_head = nn.Linear(h, v, bias=False)

    def forward(self, ids):
        return self.lm_head(self.norm(self.embed_tokens(ids)))


@mistake(
    ZERO,
    "weight tying: the head must be the embedding matrix itself, not a copy taken at construction",
)
class ZeroCopiedHead(_Zero):
    def __init__(self, embed_tokens, norm):
        super().__init__(embed_tokens, norm)
        self.head = embed_tokens.weight.detach().clone()

    def forward(self, ids):
        return F.linear(self.norm(self.embed_tokens(ids)), self.head)


@mistake(ZERO, "the final norm comes before the head: embedding -> norm -> head")
class ZeroNoNorm(_Zero):
    def forward(self, ids):
        return F.linear(self.embed_tokens(ids), self.embed_tokens.weight)


@mistake(ZERO, "return logits (scores), not probabilities: no softmax")
class ZeroSoftmax(_Zero):
    def forward(self, ids):
        return super().forward(ids).softmax(-1)


@mistake(ZERO, "return logits (scores), not log-probabilities")
class ZeroLogSoftmax(_Zero):
    def forward(self, ids):
        return super().forward(ids).log_softmax(-1)


@mistake(ZERO, "logits of every position: the output shape is [B, T, vocab], not only the last one")
class ZeroLastOnly(_Zero):
    def forward(self, ids):
        return super().forward(ids)[:, -1:]
