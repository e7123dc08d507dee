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
import re
import struct
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .architectures import Architecture, architecture, config_from_file
from .config import Config
from .decoder import checkpoint_key, load_weights
from .model import CausalLM
from .runtime import convert_for_runtime
from .safetensors_file import read_safetensors_header

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# bytes per element of each safetensors dtype, to check that the header and the file size agree
DTYPE_BYTES = dict(F64=8, F32=4, F16=2, BF16=2, I64=8, I32=4, I16=2, I8=1, U64=8, U32=4, U16=2)
DTYPE_BYTES.update(U8=1, BOOL=1, F8_E4M3=1, F8_E5M2=1)


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
    }
    fields: dict[int, list[str]] = {}
    for name, size in sizes.items():
        if size:
            fields.setdefault(size, []).append(name)
    return fields


def _hint(name: str, cfg: Config, arch: Architecture) -> str:
    """Which config.json field (or fact of the architecture row) decides whether `name` should
    exist."""
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


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file, checking that the file is whole.

    A safetensors file is: 8 bytes (little-endian header length N), N bytes of JSON naming
    every tensor with its dtype, shape and byte range, then the raw bytes. A download that
    stopped early leaves a file shorter than its header promises; that is caught here.
    """
    size = path.stat().st_size
    redo = "Download or convert the file again."
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: only {size} bytes, not a safetensors file. {redo}")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(
                f"{path}: the header claims {n} bytes but the file holds {size}: the file is "
                f"truncated or not a safetensors file. {redo}"
            )
    try:
        header = read_safetensors_header(path)  # the format's reader, once the size is known sane
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: the header is not valid JSON ({e}). {redo}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a table of tensors. {redo}")
    header.pop("__metadata__", None)
    out, end = {}, 0
    for name, info in header.items():
        try:
            dtype, shape, (lo, hi) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a broken header. {redo}") from None
        if dtype in DTYPE_BYTES and hi - lo != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype}, shape {list(shape)}) should take "
                f"{math.prod(shape) * DTYPE_BYTES[dtype]} bytes but its header gives {hi - lo}: "
                f"the file is corrupt. {redo}"
            )
        if 8 + n + hi > size:  # name a tensor that does not fit
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {8 + n + hi} but the file has only {size} "
                f"bytes: the file is truncated (an interrupted download?). {redo}"
            )
        out[name], end = (dtype, shape), max(end, hi)
    if 8 + n + end != size:
        raise CheckpointError(
            f"{path}: the tensors end at byte {8 + n + end} but the file has {size} bytes: the "
            f"file is corrupt. {redo}"
        )
    return out


def memory_needed(cfg: Config) -> str:
    """What the weights `cfg` describes amount to, from the meta model (nothing is allocated):
    "18,867 tensors, 30.5 B parameters: 61.1 GB in bfloat16"."""
    shapes = expected_shapes(cfg)
    params = sum(math.prod(shape) for shape in shapes.values())
    dtype = _dtype(cfg.dtype) or torch.float32
    gb = params * torch.empty((), dtype=dtype, device="meta").element_size() / 1e9
    return f"{len(shapes):,} tensors, {params / 1e9:.1f} B parameters: {gb:.1f} GB in {cfg.dtype}"


def _stored_tensors(
    folder: Path, cfg: Config | None = None
) -> tuple[Path, dict[str, tuple[Path, tuple[int, ...]]]]:
    """(the file to name in messages, tensor name -> (file that holds it, shape))."""
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if single.is_file():
        return single, {name: (single, shape) for name, (_, shape) in read_header(single).items()}
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


def _read_index(index: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Resolve a sharded checkpoint's index, checking each shard holds what the index says."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index}: not a valid index file ({e!r}).") from None
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
        out[name] = (path, headers[shard][name][1])
    return out


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
    dtype, device = _dtype(dtype), checked_device(device)
    model = model if model is not None else meta_model(cfg)
    prefix = model.arch.checkpoint_prefix

    def get_tensor(key: str) -> torch.Tensor:
        return tensors[key].to(device=device, dtype=dtype)  # the tensor itself if both match

    load_weights(model, tensors, get_tensor, prefix)
    return convert_for_runtime(model.eval())


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. torch.float32 or torch.bfloat16.")
    return getattr(torch, dtype)


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
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}).") from None


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
    """
    folder, dtype, device = Path(folder).expanduser(), _dtype(dtype), checked_device(device)
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
    where, stored = _stored_tensors(folder, cfg)
    model = meta_model(cfg, arch)  # built once: what to expect, then what to fill
    found = {name: shape for name, (_, shape) in stored.items()}
    validate(cfg, found, str(where), str(config_file), model)
    tensors, keep = {}, expected_shapes(cfg, model)
    for path in sorted({path for path, _ in stored.values()}):
        with safe_open(str(path), framework="pt") as f:  # memory-mapped: nothing is read yet
            for name in f.keys():
                if name in keep and stored[name][0] == path:
                    tensors[name] = f.get_tensor(name)
    model = build_model(cfg, tensors, dtype, model, device)
    gen = folder / "generation_config.json"
    model.generation_config = _read_json(gen) if gen.is_file() else {}
    model.source, model.is_standin = str(folder), False
    return model
