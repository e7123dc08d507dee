"""Loading a Hugging Face checkpoint folder: `config.json` + safetensors weights.

The weights are never copied on the way in: the model is first built on the "meta" device
(shapes only, no memory), the safetensors files are memory-mapped, and each mapped tensor is
assigned to its parameter as is. A 1.5 GB bf16 file therefore costs about 1.5 GB of memory, and
only for the pages the model actually reads. Before anything is built, every tensor name and
shape is checked against what `config.json` implies, so a mismatch fails with a message that
names the file and the tensor instead of a shape error deep inside a matrix multiply.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .architectures import Architecture, architecture, config_from_file
from .config import MTP_COUNT, Config, text_fields
from .locate import INDEX_FILE, SINGLE_FILE
from .model import CausalLM
from .runtime import convert_for_runtime
from .safetensors_file import read_safetensors_header
from .sampling import check_generation_config
from .validation import ConfigError, as_path, read_json_object
from .weights import checkpoint_key, load_weights

# the safetensors dtypes PyTorch can load; their sizes check that the header and the file agree
TORCH_DTYPES = dict(F64=torch.float64, F32=torch.float32, F16=torch.float16, BF16=torch.bfloat16)
TORCH_DTYPES.update(I64=torch.int64, I32=torch.int32, I16=torch.int16, I8=torch.int8)
TORCH_DTYPES.update(U64=torch.uint64, U32=torch.uint32, U16=torch.uint16, U8=torch.uint8)
TORCH_DTYPES.update(BOOL=torch.bool, F8_E4M3=torch.float8_e4m3fn, F8_E5M2=torch.float8_e5m2)


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message says which file and what to do."""


# ---------------------------------------------------------------------------------------------
# What the config implies: read off the model itself, built on the meta device


@contextmanager
def without_init():
    """Modules fill their weights with random numbers when built; on the meta device there is
    nothing to fill, yet the first fill of a meta tensor costs seconds (torch loads its Python
    reference kernels), and the loaded weights replace it anyway. Every built-in module (Linear,
    Embedding, Conv1d, ...) initialises through `torch.nn.init`, so silencing those functions
    skips it for every module type."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def meta_model(cfg: Config, arch: Architecture | None = None) -> CausalLM:
    """The model `cfg` describes (built from `arch`, by default its row), shapes only: no
    memory, no random init."""
    with torch.device("meta"), without_init():
        return CausalLM(cfg, arch)


def checkpoint_name(key: str, cfg: Config, arch: Architecture | None = None) -> str:
    """The checkpoint's name for a state-dict key, by the row's `checkpoint_prefix`."""
    arch = arch if arch is not None else architecture(cfg.model_type)
    return checkpoint_key(key, arch.checkpoint_prefix)


def expected_shapes(cfg: Config, model: CausalLM | None = None) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape for every tensor a checkpoint with this config must hold.

    Read off the model's own state dict (as nanoGPT's from_pretrained does), so the loader can
    never disagree with the modules; `model` is the meta model of `cfg` if one is at hand (built
    from the blocks to be loaded). A tied head is the embedding, so it needs no tensor.
    """
    model = model if model is not None else meta_model(cfg)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]
    return {checkpoint_name(k, cfg, model.arch): tuple(v.shape) for k, v in state.items()}


def _dim_fields(cfg: Config) -> dict[int, list[str]]:
    """Size -> the config.json fields (or products of them) that give a tensor dimension that
    size: how an error message says which field a wrong shape disagrees with."""
    c = cfg
    sizes = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "head_dim": c.head_dim,
        "num_attention_heads * head_dim": c.num_attention_heads * c.head_dim,
        "num_key_value_heads * head_dim": c.num_key_value_heads * c.head_dim,
        "2 * num_attention_heads * head_dim (query and gate)": 2
        * c.num_attention_heads
        * c.head_dim,
        "num_experts": c.num_experts,
        "moe_intermediate_size": c.moe_intermediate_size,
        "2 * moe_intermediate_size": 2 * c.moe_intermediate_size,
        "shared_expert_intermediate_size": c.shared_expert_intermediate_size,
        "linear_num_value_heads": c.linear_num_value_heads,
        "linear_key_head_dim": c.linear_key_head_dim,
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
        "linear_num_value_heads * linear_value_head_dim": (
            c.linear_num_value_heads * c.linear_value_head_dim
        ),
        "2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * "
        "linear_value_head_dim (q, k, v)": (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + c.linear_num_value_heads * c.linear_value_head_dim
        ),
        "2 * linear_num_key_heads * linear_key_head_dim + 2 * linear_num_value_heads * "
        "linear_value_head_dim (q, k, v, z fused)": (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + 2 * c.linear_num_value_heads * c.linear_value_head_dim
        ),
        "2 * linear_num_value_heads (b, a fused)": 2 * c.linear_num_value_heads,
    }
    fields: dict[int, list[str]] = {}
    for name, size in sizes.items():
        if size:
            fields.setdefault(size, []).append(name)
    return fields


def _mtp_head(cfg: Config, arch: Architecture, config_file: Path, stored: dict) -> Config:
    """`cfg` with the MTP head the weights carry: none where config.json describes one they do
    not (a checkpoint saved by transformers drops it: the model cannot draft with it), and as
    many layers as they hold where config.json does not say (Qwen3-Next's release; vLLM then
    reads 1). A count config.json gives, 0 included, stands."""
    layers = {int(m[1]) for name in stored if (m := re.match(r"mtp\.layers\.(\d+)\.", name))}
    if cfg.mtp_num_hidden_layers and not any(name.startswith("mtp.") for name in stored):
        return replace(cfg, mtp_num_hidden_layers=0)
    said = any(text_fields(_read_json(config_file)).get(k) is not None for k in MTP_COUNT)
    if layers and not said and "mtp." in arch.ignored_prefixes:
        return replace(cfg, mtp_num_hidden_layers=len(layers))  # a gap is named by validation
    return cfg


def _hint(name: str, cfg: Config, arch: Architecture) -> str:
    """Which config.json field (or fact of the architecture row) decides whether `name` should
    exist."""
    if name.startswith("mtp."):
        return (
            f"the multi-token-prediction head has {cfg.mtp_num_hidden_layers} layer(s) "
            f"(config.json's mtp_num_hidden_layers, or where it has none, the mtp.layers.* "
            f"the weights carry)"
        )
    m = re.search(r"layers\.(\d+)\.", name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        return f"config.json says num_hidden_layers = {cfg.num_hidden_layers}"
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        has = "has" if arch.qk_norm else "has no"
        return f"a {cfg.model_type} model {has} QK-Norm (model_type in config.json)"
    if name.endswith("_proj.bias"):
        qkv, o = arch.attention_biases(cfg)
        return (
            f"a {cfg.model_type} model with attention_bias = {cfg.attention_bias} has "
            f"{'' if qkv else 'no '}q/k/v biases and {'an' if o else 'no'} o_proj bias"
        )
    if name == "lm_head.weight":
        return "tie_word_embeddings is false in config.json, so the output head has its own weights"
    if m and ".mlp." in name:
        i = int(m.group(1))
        kind = "a mixture of experts" if cfg.is_sparse_layer(i) else "a dense feed-forward"
        return (
            f"layer {i} has {kind} (num_experts, decoder_sparse_step and mlp_only_layers in "
            f"config.json)"
        )
    if m:
        i = int(m.group(1))
        return f"layer {i} is {cfg.layer_types[i]} (layer_types in config.json)"
    return f"a {cfg.model_type} model with this config.json"


# ---------------------------------------------------------------------------------------------
# Reading safetensors headers (shapes only, no tensor data)


REDO = "Download or convert the file again."


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file, checking that the file is whole.

    The header is read by `read_safetensors_header`; everything the safetensors library would
    refuse beyond that is refused here first, with the file and tensor named; a download that
    stopped early leaves a file shorter than its header promises. Only the header is read,
    never the tensor data.
    """
    size = path.stat().st_size
    try:
        header = read_safetensors_header(path)
    except struct.error:  # fewer than the 8 bytes of the length
        raise CheckpointError(f"{path}: {size} bytes, not a safetensors file. {REDO}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:  # json refuses a byte-order mark
        raise CheckpointError(f"{path}: the header is not valid JSON ({e}). {REDO}") from None
    except ValueError as e:  # a length the file cannot hold
        raise CheckpointError(str(e)) from None
    except RecursionError:
        raise CheckpointError(f"{path}: the header is nested too deeply. {REDO}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a table of tensors. {REDO}")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CheckpointError(
            f"{path}: the header's __metadata__ must map names to strings only. {REDO}"
        )
    entries = {name: _header_entry(path, name, info) for name, info in header.items()}
    _check_layout(path, entries, size - 8 - _header_length(path))
    return {name: (dtype, shape) for name, (dtype, shape, _) in entries.items()}


def _header_length(path: Path) -> int:
    """The header's length (the file's first 8 bytes), to find where the tensor data begins."""
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def _header_entry(path: Path, name: str, info) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, (begin, end)) of one tensor's header entry, each checked."""

    def whole(values) -> bool:
        return isinstance(values, list) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
        )

    broken = f"{path}: tensor {name!r} has a broken header entry"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{broken}: it needs dtype, shape and data_offsets. {REDO}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in TORCH_DTYPES:
        raise CheckpointError(
            f"{broken}: dtype {dtype!r} is not one PyTorch can load (known: "
            f"{', '.join(TORCH_DTYPES)}). {REDO}"
        )
    if not whole(shape):
        raise CheckpointError(f"{broken}: shape {shape!r} is not a list of sizes >= 0. {REDO}")
    if not (whole(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise CheckpointError(
            f"{broken}: data_offsets {offsets!r} must be two byte positions [begin, end] with "
            f"0 <= begin <= end. {REDO}"
        )
    need = math.prod(shape) * TORCH_DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != need:
        raise CheckpointError(
            f"{path}: tensor {name!r} ({dtype}, shape {shape}) should take {need} bytes but "
            f"its header gives {offsets[1] - offsets[0]}: the file is corrupt. {REDO}"
        )
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _check_layout(path: Path, entries: dict, data_bytes: int) -> None:
    """The tensors' byte ranges must tile the data section exactly: in range, no gap, no
    overlap (what safetensors checks before it maps anything)."""
    end, before = 0, None
    for name, (_, _, (lo, hi)) in sorted(entries.items(), key=lambda e: e[1][2]):
        if hi > data_bytes:  # name a tensor that does not fit
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {hi} of the data but the file holds only "
                f"{data_bytes} bytes of data: the file is truncated (an interrupted download?). "
                f"{REDO}"
            )
        if lo != end:
            what = "overlaps" if lo < end else f"leaves a gap of {lo - end} bytes after"
            after = f"tensor {before!r}" if before else "the header"
            raise CheckpointError(
                f"{path}: tensor {name!r} (bytes {lo} to {hi}) {what} {after}: the file is "
                f"corrupt. {REDO}"
            )
        end, before = hi, name
    if end != data_bytes:
        raise CheckpointError(
            f"{path}: the tensors end at byte {end} of the data but the file holds {data_bytes} "
            f"bytes after the header: the file is corrupt. {REDO}"
        )


def parameters_at_least(cfg: Config) -> int:
    """How many parameters the model `cfg` describes, counting only the matrices every such
    model has (so never more than it has), from the config alone: no module is built, so an
    absurd config (100,000 layers, 20,000 experts) is measured in microseconds."""
    c = cfg
    H, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = H * q * (2 if c.attn_output_gate else 1) + 2 * H * kv + q * H  # q (+gate), k, v, o
    k_dims = c.linear_num_key_heads * c.linear_key_head_dim
    v_dims = c.linear_num_value_heads * c.linear_value_head_dim
    linear = H * (2 * k_dims + v_dims) + v_dims * H  # q, k, v in, out
    experts = c.num_experts * (3 * H * c.moe_intermediate_size + H)  # each expert, its router row
    sparse = experts + 3 * H * c.shared_expert_intermediate_size
    total = c.vocab_size * H * (1 if c.tie_word_embeddings else 2)
    for i, kind in enumerate(c.layer_types):
        total += linear if kind == "linear_attention" else attention
        total += sparse if c.is_sparse_layer(i) else 3 * H * c.intermediate_size
    return total


# modules past which even the meta model takes seconds to build (Qwen3-235B-A22B, its experts
# one module each: 94 layers x 130 = 12,220); beyond it sizes are worked out from the config alone
MAX_BUILD = 30_000


def modules_to_build(cfg: Config) -> int:
    """About how many modules the model `cfg` describes: its layers times the modules of one
    feed-forward of the largest kind, built once on meta (a row holding its experts fused, as
    Qwen3.5-397B-A17B's does, has a few per layer, not one per expert)."""
    if cfg.num_hidden_layers * (1 + cfg.num_experts) <= MAX_BUILD:
        return cfg.num_hidden_layers * (1 + cfg.num_experts)  # small enough either way
    if 4 * cfg.num_experts > MAX_BUILD:  # not even one layer of them is worth building
        return cfg.num_hidden_layers * (1 + cfg.num_experts)
    arch = architecture(cfg.model_type)
    layer = next((i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)), 0)
    with torch.device("meta"), without_init():
        mlp = arch.mlp(cfg, layer, arch)
    return cfg.num_hidden_layers * (1 + sum(1 for _ in mlp.modules()))


def memory_needed(cfg: Config, dtype: torch.dtype | None = None, exact: bool = True) -> str:
    """What the weights `cfg` describes amount to, nothing allocated: "18,867 tensors, 30.5 B
    parameters: 61.1 GB in bfloat16", counted on the meta model; with exact=False, or for a
    config too large to build even that, "at least ..." from the config alone."""
    dtype = dtype or checked_dtype(cfg.dtype) or torch.float32
    if exact and modules_to_build(cfg) <= MAX_BUILD:
        shapes = expected_shapes(cfg)
        params, count = sum(math.prod(s) for s in shapes.values()), f"{len(shapes):,} tensors, "
    else:
        params, count = parameters_at_least(cfg), "at least "
    gb = params * torch.empty((), dtype=dtype, device="meta").element_size() / 1e9
    number = f"{params / 1e9:.1f} B" if params >= 1e8 else f"{params:,}"
    return f"{count}{number} parameters: {gb:.{1 if gb >= 1 else 3}f} GB in {str(dtype)[6:]}"


def physical_memory() -> int | None:
    """This machine's memory in bytes, where the system says (Linux, macOS)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_size(cfg: Config, stored: dict, where: Path, config_file: Path, dtype) -> None:
    """Refuse, before building anything, a config that describes far more than the weights files
    hold (a small difference is named tensor by tensor later) or more than this machine's
    memory."""
    held = sum(math.prod(shape) for _, _, shape in stored.values())
    need = parameters_at_least(cfg)
    if need > 2 * held:  # far more: building even the meta model would take long
        raise CheckpointError(
            f"{config_file}: describes {memory_needed(cfg, exact=False)} (num_hidden_layers = "
            f"{cfg.num_hidden_layers}, num_experts = {cfg.num_experts}, hidden_size = "
            f"{cfg.hidden_size}), but {where} holds only {held:,} parameters in all. "
            f"config.json and the weights belong to different models: use the config.json "
            f"that came with these weights."
        )
    dtype = dtype or next(iter({d for _, d, _ in stored.values()}), torch.float32)
    size = need * torch.empty((), dtype=dtype, device="meta").element_size()
    memory = physical_memory()
    if memory is not None and size > memory:
        raise CheckpointError(
            f"{config_file}: the model takes {memory_needed(cfg, dtype, exact=False)}, more "
            f"than this machine's {memory / 1e9:.1f} GB of memory. Use a smaller model."
        )


def _stored_tensors(
    folder: Path, cfg: Config | None = None
) -> tuple[Path, dict[str, tuple[Path, torch.dtype, tuple[int, ...]]]]:
    """(the file to name in messages, tensor name -> (file that holds it, dtype, shape))."""
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if single.is_file():
        return single, {name: (single, TORCH_DTYPES[dtype], shape)
                        for name, (dtype, shape) in read_header(single).items()}  # fmt: skip
    if index.is_file():
        return index, _read_index(index)
    pickles = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
    if pickles:
        raise CheckpointError(
            f"{folder}: holds {', '.join(pickles)} (PyTorch pickle weights) but no {SINGLE_FILE}. "
            f"qwen_mini reads safetensors only, because unpickling a file can run arbitrary "
            f"code. Convert it once, with transformers, where you trust the file: "
            f"AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder)."
        )
    size = f" config.json describes {memory_needed(cfg)} to load." if cfg is not None else ""
    raise CheckpointError(
        f"{folder}: no weights found: expected {SINGLE_FILE} or {INDEX_FILE} next to config.json."
        + size
    )


def _read_index(index: Path) -> dict[str, tuple[Path, torch.dtype, tuple[int, ...]]]:
    """Resolve a sharded checkpoint's index, checking each shard holds what the index says."""
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) and shard and Path(shard).name == shard
        for shard in weight_map.values()
    ):
        raise CheckpointError(
            f'{index}: not a valid index file: it needs "weight_map", an object from each '
            f"tensor name to the name of the shard file (in the same folder) that holds it."
        )
    out, headers = {}, {}
    for name, shard in weight_map.items():
        path = index.parent / shard
        if shard not in headers:
            if not path.is_file():
                raise CheckpointError(
                    f"{index}: maps tensor {name!r} to the shard {shard}, which is not in "
                    f"{index.parent}. Download the missing shard (every file named in the index "
                    f"is needed)."
                )
            headers[shard] = read_header(path)
        if name not in headers[shard]:
            raise CheckpointError(
                f"{index}: maps tensor {name!r} to {path}, but that file does not contain it. "
                f"The index and the shards come from different downloads; fetch them again."
            )
        dtype, shape = headers[shard][name]
        out[name] = (path, TORCH_DTYPES[dtype], shape)
    return out


# ---------------------------------------------------------------------------------------------
# The two layouts of routed experts: one by one (`experts.{e}.gate_proj.weight`, what transformers
# writes, and the Qwen3-MoE and Qwen3-Next releases) or fused (`experts.gate_up_proj` [E, 2I, H]
# and `experts.down_proj` [E, H, I], no `.weight`: the Qwen3.5-MoE releases). A model holds one;
# a checkpoint in the other is read through a conversion: a fused tensor is cut into views of
# itself (no copy); tensors stored one by one are stacked (a copy, made once as they load).

FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
# a tensor the model needs, made from stored ones: (their names, the function of them)
Derived = tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]]


def per_expert_names(fused_name: str, E: int) -> list[str]:
    """The tensors, one by one, that a fused experts tensor holds for E experts, in its order:
    expert e's gate_proj rows then its up_proj rows (gate_up_proj), or its down_proj."""
    prefix, which = FUSED_EXPERTS.match(fused_name).groups()
    parts = ("gate_proj", "up_proj") if which == "gate_up_proj" else ("down_proj",)
    return [f"{prefix}.{e}.{part}.weight" for e in range(E) for part in parts]


def _stack(per_expert: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    """[E * per_expert] matrices -> [E, rows, cols]: each expert's parts one above the other."""
    groups = [tensors[i : i + per_expert] for i in range(0, len(tensors), per_expert)]
    return torch.stack([torch.cat(group) for group in groups])


def _cut(index: tuple[int, slice], tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0][index]  # a view of the fused tensor


def convert_expert_layout(
    stored: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]],
    want: dict[str, tuple[int, ...]],
    config_file: Path,
) -> tuple[dict, dict[str, Derived]]:
    """`stored` as the model `want`s its experts, and how to make each converted tensor. A fused
    tensor of the wrong shape for the config is refused here, by name."""
    stored, derived = dict(stored), {}
    for name in [n for n in want if FUSED_EXPERTS.match(n) and n not in stored]:
        parts = per_expert_names(name, want[name][0])
        shapes = {stored[p][2] for p in parts if p in stored}
        if len(shapes) != 1 or not all(p in stored for p in parts):
            continue  # not there one by one either: validate names what is missing
        path, dtype, (rows, cols) = stored[parts[0]][0], stored[parts[0]][1], shapes.pop()
        k = len(parts) // want[name][0]  # matrices per expert
        stored[name] = (path, dtype, (want[name][0], k * rows, cols))
        derived[name] = (parts, partial(_stack, k))
        for p in parts:
            del stored[p]
    for name in [n for n in stored if FUSED_EXPERTS.match(n) and n not in want]:
        path, dtype, shape = stored[name]
        if len(shape) != 3 or not shape[0]:
            continue  # no [E, rows, cols] tensor: validate names it
        parts = per_expert_names(name, shape[0])
        if parts[0] not in want:
            continue  # experts the model does not have: validate names the tensor
        k, (rows, cols) = len(parts) // shape[0], want[parts[0]]
        prefix = FUSED_EXPERTS.match(name).group(1)
        E = sum(1 for n in want if n.startswith(f"{prefix}.") and n.endswith(".down_proj.weight"))
        if tuple(shape) != (E, k * rows, cols):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(shape)}, but {config_file} implies "
                f"{[E, k * rows, cols]} ({'[E, 2I, H]' if k == 2 else '[E, H, I]'} with E = "
                f"num_experts, I = moe_intermediate_size, H = hidden_size). config.json and the "
                f"weights disagree: use the config.json that came with these weights."
            )
        del stored[name]
        for i, p in enumerate(parts):
            e, j = divmod(i, k)
            stored[p] = (path, dtype, (rows, cols))
            derived[p] = ([name], partial(_cut, (e, slice(j * rows, (j + 1) * rows))))
    return stored, derived


def load_dtype(
    stored: dict, names, where: Path, asked: torch.dtype | None = None
) -> torch.dtype | None:
    """The dtype the weights `names` must be cast to as they load (None: keep them as stored):
    `asked`, the caller's choice, if given.

    Weights are floating point: an integer or boolean tensor where a weight belongs is refused,
    whatever dtype is asked for (casting would make weights of its integers).
    Float8 is a storage format PyTorch does not compute in, and shards saved in several float
    dtypes would fail at the first matrix multiply: both are cast, once, to the dtype that holds
    most of the parameters (bfloat16 for float8), with one notice.
    """
    counts: dict[torch.dtype, int] = {}
    for name in names:
        path, dtype, shape = stored[name]
        if not dtype.is_floating_point:
            raise CheckpointError(
                f"{path}: tensor {name!r} is stored as {dtype}, but it is a weight of "
                f"the model and must be floating point (bfloat16, float16 or float32). The file "
                f"was not written for this model, or was quantized: {REDO}"
            )
        counts[dtype] = counts.get(dtype, 0) + math.prod(shape)
    if asked is not None:
        return asked
    if len(counts) == 1 and next(iter(counts)).itemsize > 1:
        return None
    target = max((d for d in counts if d.itemsize > 1), key=counts.get, default=torch.bfloat16)
    found = ", ".join(f"{n:,} parameters in {str(d).removeprefix('torch.')}"
                      for d, n in counts.items())  # fmt: skip
    warnings.warn(
        f"{where}: the weights are stored as {found}; converting them to "
        f"{str(target).removeprefix('torch.')} as they load (pass dtype= to choose).",
        stacklevel=3,
    )
    return target


# ---------------------------------------------------------------------------------------------
# Validation, then building


def validate(
    cfg: Config,
    found: dict[str, tuple[int, ...]],
    where: str,
    config_file: str = "config.json",
    model: CausalLM | None = None,
) -> None:
    """Check stored tensor shapes `found` against the config; `where` names the weights file.
    `model`: the meta model of `cfg`, if the caller has built it already."""
    model = model if model is not None else meta_model(cfg)
    want, arch = expected_shapes(cfg, model), model.arch
    ignored = arch.ignored_prefixes
    missing = [k for k in want if k not in found]
    if missing:
        raise CheckpointError(
            f"{where}: tensor {missing[0]!r} is missing ({len(missing)} missing in all); "
            f"{config_file} requires it ({_hint(missing[0], cfg, arch)}). The weights are "
            f"incomplete or belong to a different model than {config_file}: use the config.json "
            f"that came with these weights."
        )
    # a tied checkpoint may still store the head (the real Qwen3-0.6B does): accepted, unused
    extra = [
        k
        for k in found
        if k not in want
        and not k.startswith(ignored)
        and not (k == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if extra:
        raise CheckpointError(
            f"{where}: holds tensor {extra[0]!r} ({len(extra)} unexpected in all), which "
            f"{config_file} does not describe ({_hint(extra[0], cfg, arch)}). config.json and the "
            f"weights belong to different models: use the config.json that came with them."
        )
    if "lm_head.weight" in found and cfg.tie_word_embeddings:
        want["lm_head.weight"] = want[checkpoint_name("model.embed_tokens.weight", cfg, arch)]
    fields = _dim_fields(cfg)
    for name, shape in want.items():
        got = tuple(found[name])
        if got == shape:
            continue
        why = "the number of dimensions differs"
        if len(got) == len(shape):
            n = next(n for n, g in zip(shape, got, strict=True) if n != g)
            why = " or ".join(f"{f} = {n}" for f in fields.get(n, [])) or f"a dimension of {n}"
            why += f" in {config_file}"
        raise CheckpointError(
            f"{where}: tensor {name!r} has shape {list(got)}, but {config_file} implies "
            f"{list(shape)} ({why}). config.json and the weights disagree: use the "
            f"config.json that came with these weights."
        )


def build_model(
    cfg: Config,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | str | None = None,
    model: CausalLM | None = None,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """Fill a model built on the meta device (`model`, or a new one) with validated tensors (by
    checkpoint name), through the decoder's `load_weights`, on `device`, with no copy unless
    `dtype` or `device` asks for one; then apply the runtime speed-ups."""
    dtype, device = checked_dtype(dtype), checked_device(device)
    model = model if model is not None else meta_model(cfg)
    prefix = model.arch.checkpoint_prefix

    def get_tensor(key: str) -> torch.Tensor:  # the tensor itself if device and dtype match
        t = tensors[key]  # integer buffers (an n-gram hash's) keep their dtype
        return t.to(device=device, dtype=dtype if t.is_floating_point() else None)

    load_weights(model, tensors, get_tensor, prefix)
    return convert_for_runtime(model.eval())


def checked_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`dtype` (a torch.dtype or its name, "bfloat16") as one the weights can be computed in;
    None stays None (the stored dtype). A ValueError naming it otherwise."""
    if dtype is None:
        return None
    found = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. torch.float32 or torch.bfloat16.")
    if not found.is_floating_point or found.itemsize < 2:  # float8: storage only, no matmul
        raise ValueError(
            f"dtype={dtype!r}: the weights are computed in floating point; use torch.float32, "
            f"torch.bfloat16 or torch.float16 (or None, the dtype they are stored in)."
        )
    return found


def checked_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device this machine has; ValueError naming it otherwise."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"unknown device {device!r}; use 'cpu', 'cuda', 'cuda:1' (the second GPU) or 'mps'."
        ) from None
    if found.type == "meta":
        raise ValueError("device 'meta' holds no weights; use 'cpu' or an accelerator.")
    try:
        torch.empty(0, device=found)  # the one test every backend answers the same way
    except (RuntimeError, AssertionError) as e:  # no such GPU, or torch built without it
        raise ValueError(
            f"device {str(found)!r} is not available on this machine ({e}); 'cpu' always is."
        ) from None
    return found


def _read_json(path: Path) -> dict:
    """A JSON object file of the checkpoint (config, index, generation config)."""
    try:
        return read_json_object(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def load_checkpoint(
    folder: str | Path,
    dtype: torch.dtype | str | None = None,
    arch: Architecture | None = None,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """Load a Hugging Face checkpoint folder into a `CausalLM`, memory-mapped.

    dtype=None keeps the stored dtype (bfloat16 for the released Qwen models); a dtype such as
    torch.float32 converts each tensor (which then costs memory for the converted copy).
    arch: the architecture row to build from (default: the row of config.json's model_type),
    e.g. one with your own blocks: the real weights then load into them.
    device: where the weights go ("cpu", memory-mapped, or e.g. "cuda", copied there).
    The model gets `generation_config` (dict), `source` (the folder) and `is_standin` (False).
    Everything is checked before a tensor is read: the config's fields, the weights' headers,
    names, shapes and dtypes, the size against the files and the memory, generation_config.json.
    """
    folder, dtype = as_path(folder, "load_checkpoint: folder"), checked_dtype(dtype)
    device = checked_device(device)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder. Pass the folder that holds config.json.")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{config_file}: missing. A checkpoint folder needs config.json next to the "
            f"weights; copy it from where the weights came from."
        )
    try:
        cfg = config_from_file(config_file, arch)
    except ValueError as e:  # unknown model_type, missing field, bad JSON
        raise CheckpointError(str(e)) from None
    generation_config = _generation_config(folder / "generation_config.json")
    where, stored = _stored_tensors(folder, cfg)
    cfg = _mtp_head(cfg, arch or architecture(cfg.model_type, config_file), config_file, stored)
    check_size(cfg, stored, where, config_file, dtype)
    model = meta_model(cfg, arch)  # built once: what to expect, then what to fill
    files = sorted({path for path, _, _ in stored.values()})
    stored, derived = convert_expert_layout(stored, expected_shapes(cfg, model), config_file)
    found = {name: shape for name, (_, _, shape) in stored.items()}
    validate(cfg, found, str(where), str(config_file), model)
    if cfg.tie_word_embeddings and "lm_head.weight" in stored and _head_differs(model, stored):
        warnings.warn(
            f"{config_file} says tie_word_embeddings, but {stored['lm_head.weight'][0]} stores "
            f"an lm_head.weight that differs from the embedding: using the stored head, as "
            f"transformers does. Set tie_word_embeddings to false to silence this.",
            stacklevel=2,
        )
        cfg = replace(cfg, tie_word_embeddings=False)
        model = meta_model(cfg, arch)
    keep = expected_shapes(cfg, model)
    dtype = load_dtype(stored, weights_of(model, keep, stored, where), where, dtype)
    sources = {source for names, _ in derived.values() for source in names}
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:  # memory-mapped: nothing is read yet
            for name in f.keys():
                if name in sources or (name in keep and stored[name][0] == path):
                    tensors[name] = f.get_tensor(name)
    for name, (names, make) in derived.items():  # experts in the other layout
        tensors[name] = make([tensors[source] for source in names])
    model = build_model(cfg, tensors, dtype, model, device)
    check_stored_values(model, where)
    model.generation_config = generation_config
    model.source, model.is_standin = str(folder), False
    return model


def weights_of(model: CausalLM, names, stored: dict, where: Path) -> list[str]:
    """The checkpoint names among `names` that hold weights; the others are the model's integer
    buffers (the hash tables of an n-gram embedding), which must be stored in their own dtype."""
    integer = {
        checkpoint_name(k, model.config, model.arch): v.dtype
        for k, v in model.state_dict().items()
        if not v.is_floating_point()
    }
    for name, dtype in integer.items():
        if name in names and stored[name][1] != dtype:
            raise CheckpointError(
                f"{stored[name][0]}: tensor {name!r} is stored as {stored[name][1]}, but it "
                f"holds the model's integers and must be {dtype}. {REDO}"
            )
    return [n for n in names if n not in integer]


def check_stored_values(model: CausalLM, where: Path) -> None:
    """Refuse stored values a module says are wrong (`stored_problem()`: the n-gram hash
    buffers against config.json), naming the tensor."""
    for name, module in model.named_modules():
        problem = getattr(module, "stored_problem", None)
        if problem is not None and (why := problem()):
            key = checkpoint_name(f"{name}.", model.config, model.arch)
            raise CheckpointError(f"{where}: the tensors under {key!r}: {why}.")


def _head_differs(model: CausalLM, stored: dict, rows: int = 8) -> bool:
    """Whether a stored lm_head.weight differs from the embedding it is meant to be tied to
    (transformers then keeps both). Compared on `rows` rows at the start, middle and end of the
    vocabulary, so the check reads a few kilobytes, not the two largest tensors."""
    cfg = model.config
    embed = checkpoint_name("model.embed_tokens.weight", cfg, model.arch)
    middle = cfg.vocab_size // 2
    blocks = [(0, rows), (middle, middle + rows), (cfg.vocab_size - rows, cfg.vocab_size)]
    read = []
    for name in (embed, "lm_head.weight"):
        with safe_open(str(stored[name][0]), framework="pt") as f:
            table = f.get_slice(name)
            read.append(torch.cat([table[max(lo, 0) : hi] for lo, hi in blocks]))
    return not torch.equal(*read)


def _generation_config(path: Path) -> dict:
    """generation_config.json, its values checked now rather than at the first generate."""
    if not path.is_file():
        return {}
    gc = _read_json(path)
    try:
        check_generation_config(gc)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e} Fix the file or delete it.") from None
    return gc


def scan_nonfinite(folder: str | Path, rows: int = 4096) -> list[tuple[Path, str, int, int]]:
    """(file, tensor, how many values are NaN or infinite, of how many) for every stored tensor
    that holds any: a full read of the weights, so only on request (`qwen-mini doctor --scan`).
    Read in blocks of `rows` rows, so the scan needs little memory beyond the mapped file."""
    folder = as_path(folder, "scan_nonfinite: folder")
    _, stored = _stored_tensors(folder)
    found = []
    for path in sorted({path for path, _, _ in stored.values()}):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if not tensor.dtype.is_floating_point or tensor.numel() == 0:
                    continue
                flat = tensor.reshape(tensor.shape[0] if tensor.dim() else 1, -1)
                bad = sum(
                    int((~torch.isfinite(flat[i : i + rows].float())).sum())
                    for i in range(0, flat.shape[0], rows)
                )
                if bad:
                    found.append((path, name, bad, tensor.numel()))
    return found
