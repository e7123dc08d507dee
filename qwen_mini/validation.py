"""Checking the values in a checkpoint's `config.json` before anything is built.

A field the model does not implement, or a value that makes no sense, would otherwise give a
model that runs and is silently different from the one the checkpoint was trained as (a YaRN
scaling ignored, routed experts that never fire), or a crash deep inside a matrix multiply. So
every field is checked here in one pass, and the one error lists every bad field with what to do.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path

# the dtype names config.json may give for the weights (`dtype`, or `torch_dtype` before
# transformers 5)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# what transformers calls "default" RoPE: plain rotations, no scaling of the frequencies
PLAIN_ROPE = (None, "default")
SCALED_ROPE = ("linear", "yarn")  # what qwen_mini.rope_scaling implements
# sizes: whole numbers >= 1 (num_hidden_layers >= 0); the first six have no default (unless the
# model type gives one: intermediate_size of a model with no dense layer)
REQUIRED_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
OPTIONAL_SIZES = ("num_key_value_heads", "decoder_sparse_step", "full_attention_interval")
# counts and widths where 0 means "none" (no experts, no linear-attention layers)
COUNTS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "max_window_layers",
    "mtp_num_hidden_layers",
    "num_nextn_predict_layers",
)
NULLABLE_SIZES = ("head_dim", "sliding_window")  # null: worked out from other fields / no window
FLAGS = ("tie_word_embeddings", "attention_bias", "attn_output_gate", "norm_topk_prob")
FLAGS += ("use_sliding_window", "qkv_bias")
LARGEST = 2**31 - 1  # no tensor dimension of a real model comes near it
MAX_DEPTH = 64  # a config.json nests 3 levels deep; a file nested thousands deep is not one


class ConfigError(ValueError):
    """A config.json whose values qwen_mini cannot build the model from; the message lists each
    bad field."""


def as_path(value: object, what: str) -> Path:
    """`value` (a str or os.PathLike) as a Path, `~` expanded; a ValueError naming `what` for
    anything else (a number, None, ""), or for a `~user` with no home folder."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"{what} must be a non-empty path or name (a string), got {value!r}.")
    try:
        return Path(value).expanduser()
    except RuntimeError:  # "~someone" of no such user
        raise ValueError(f"{what} {str(value)!r}: no home folder for its '~'.") from None


def read_json(path: Path) -> object:
    """The JSON value in `path` (UTF-8, as Hugging Face writes it), or an error naming the file."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it again as UTF-8."
        ) from None
    if text.startswith("\ufeff"):
        raise ConfigError(f"{path}: starts with a byte-order mark; save it as UTF-8 without one.")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}).") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a configuration file.") from None


def read_json_object(path: Path) -> dict:
    """`read_json` for the files that must hold one JSON object (config, index, ...)."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise ConfigError(
            f"{path}: holds a JSON {json_type(value)}, but it must be one JSON object "
            f"({{...}}); the file is not the one that came with the checkpoint."
        )
    return value


def json_type(value: object) -> str:
    """How JSON names the type of `value`: what a learner sees in the file."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "list"}
    names |= {dict: "object", type(None): "null"}
    return names.get(type(value), f"{type(value).__name__} (no JSON type)")


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _show(value: object) -> str:
    """`value` as config.json spells it (null, true, "8"); repr for what JSON cannot hold."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no number


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_whole_number(value) -> bool:
    """An int, or an integer numpy/torch scalar: never a float (int(2.7) would be 2) or a bool."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and getattr(value, "ndim", 1) == 0 and "int" in str(dtype)


def _size_problem(value: object, smallest: int) -> str | None:
    """Why `value` is not a whole number from `smallest` to LARGEST, or None."""
    if not _is_int(value):
        return f"must be a whole number, got {_show(value)} (a JSON {json_type(value)})"
    if not smallest <= value <= LARGEST:
        return f"must be a whole number from {smallest} to {LARGEST:,}, got {value}"
    return None


def text_fields(d: dict) -> dict:
    """The text model's fields: a multimodal config (Qwen3.5) keeps them under text_config."""
    return {**d, **d["text_config"]} if isinstance(d.get("text_config"), dict) else d


def check_config_json(d: object, source: str, architectures: Mapping[str, object]) -> None:
    """Raise one ConfigError listing every field of config.json `d` that is missing, of the wrong
    type or out of range, or that asks for something qwen_mini does not implement, judged by the
    row of its model type in `architectures` (the table, handed in: it imports the blocks, and
    the blocks use the helpers here)."""
    if not isinstance(d, dict):
        raise ConfigError(
            f"{source}: holds a JSON {json_type(d)}, but a config.json is one JSON object "
            f"({{...}}) of fields; use the config.json that came with the weights."
        )
    if _depth(d) > MAX_DEPTH:
        raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep: not a config.")
    if not isinstance(d.get("model_type"), str) or d["model_type"] not in architectures:
        return  # the model type is named first (architecture()): its fields may mean other things
    arch = architectures[d["model_type"]]
    problems = _type_problems(d, text_fields(d), arch)
    if not problems:  # the relations between fields can only be read off well-typed fields
        # with the model type's defaults for the fields the file leaves out
        problems = _relation_problems({**arch.config_defaults, **text_fields(d)}, arch)
    if problems:
        lines = "".join(f"\n  - {p}" for p in problems)
        raise ConfigError(
            f"{source}: {len(problems)} field{'s' if len(problems) > 1 else ''} qwen_mini "
            f"cannot use:{lines}\nFix these fields, or use the config.json that came with the "
            f"weights."
        )


def _type_problems(d: dict, t: dict, arch) -> list[str]:
    """Each field on its own: present if required (by the model type of row `arch`), of the
    right JSON type, in range."""
    problems = []
    if "text_config" in d and not isinstance(d["text_config"], (dict, type(None))):
        problems.append(f"text_config must be an object, got a JSON {json_type(d['text_config'])}")
    for name in REQUIRED_SIZES:
        if name not in t and name not in arch.config_defaults:
            problems.append(f"{name} is missing (required)")
    # a model of no layers (the embedding, then the head) is a model too: the course builds one
    checks = [(n, 0 if n == "num_hidden_layers" else 1) for n in REQUIRED_SIZES + OPTIONAL_SIZES]
    checks += [(n, 0) for n in COUNTS]
    # sliding_window 0: no window (what transformers writes for qwen2_moe without one)
    checks += [(n, int(n != "sliding_window")) for n in NULLABLE_SIZES if t.get(n) is not None]
    for name, smallest in checks:
        if name in t and (why := _size_problem(t[name], smallest)):
            problems.append(f"{name} {why}")
    for where in (d, t):
        for name in FLAGS:
            if name in where and not isinstance(where[name], bool):
                got = _show(where[name])
                problems.append(f"{name} must be true or false (no quotes), got {got}")
    problems += _float_problems(t)
    problems += _list_problems(t)
    for name in ("dtype", "torch_dtype"):
        if t.get(name) is not None and t[name] not in FLOAT_DTYPES:
            problems.append(
                f"{name} must be one of {', '.join(FLOAT_DTYPES)} (the dtype of the weights), "
                f"got {_show(t[name])}"
            )
    act = t.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers builds both as nn.SiLU
        problems.append(
            f"hidden_act is {_show(act)}, but qwen_mini's feed-forward is SwiGLU, which "
            f"uses silu: a model with another activation would give different results"
        )
    return list(dict.fromkeys(problems))  # a top-level flag and the merged view say it once


def _rope_tables(t: dict) -> list[tuple[str, object]]:
    return [(n, t[n]) for n in ("rope_parameters", "rope_scaling") if t.get(n) is not None]


def _float_problems(t: dict) -> list[str]:
    problems = []
    for name, table in _rope_tables(t):
        if not isinstance(table, dict):
            problems.append(f"{name} must be an object or null, got a JSON {json_type(table)}")
            continue
        kind = table.get("rope_type", table.get("type"))
        if kind in SCALED_ROPE:
            problems += _scaling_problems(name, kind, table)
        elif kind not in PLAIN_ROPE:
            problems.append(
                f"{name} asks for {_show(kind)} RoPE scaling, which qwen_mini does not "
                f'implement (plain RoPE, "linear" and "yarn" only); without it the model would '
                f"differ from the one trained"
            )
    rope = t.get("rope_parameters") if isinstance(t.get("rope_parameters"), dict) else {}
    # (where the value sits, value, smallest allowed, whether the smallest itself is allowed)
    numbers = [(n, t[n], 0.0, n != "rope_theta") for n in ("rope_theta", "rms_norm_eps") if n in t]
    numbers += [(f"rope_parameters.{n}", rope[n], 0.0, False) for n in ("rope_theta",) if n in rope]
    if "router_aux_loss_coef" in t:
        numbers.append(("router_aux_loss_coef", t["router_aux_loss_coef"], -math.inf, True))
    for name, value, smallest, inclusive in numbers:
        if not is_number(value) or not math.isfinite(value):
            problems.append(f"{name} must be a finite number, got {_show(value)}")
        elif value < smallest or (value == smallest and not inclusive):
            sign = ">=" if inclusive else ">"
            problems.append(f"{name} must be {sign} {smallest:g}, got {value}")
    for table, prefix in ((t, ""), (rope, "rope_parameters.")):
        factor = table.get("partial_rotary_factor", 1.0)
        if not is_number(factor) or not 0 < factor <= 1:
            problems.append(f"{prefix}partial_rotary_factor must be in (0, 1], got {_show(factor)}")
    return problems


def _scaling_problems(name: str, kind: str, table: dict) -> list[str]:
    """The numbers a linear or YaRN scaling reads (qwen_mini.rope_scaling), each checked."""
    problems = []
    factor = table.get("factor")
    if factor is None and kind == "linear":
        problems.append(f"{name}.factor is missing: linear RoPE scaling needs one")
    positive = ["factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"]
    for key in positive:
        value = table.get(key)
        if value is not None and not (is_number(value) and math.isfinite(value) and value > 0):
            problems.append(f"{name}.{key} must be a finite number > 0, got {_show(value)}")
    original = table.get("original_max_position_embeddings")
    if original is not None and _size_problem(original, 1):
        problems.append(
            f"{name}.original_max_position_embeddings {_size_problem(original, 1)} (the context "
            f"the model was trained on)"
        )
    if "truncate" in table and not isinstance(table["truncate"], bool):
        problems.append(f"{name}.truncate must be true or false, got {_show(table['truncate'])}")
    return problems


def _list_problems(t: dict) -> list[str]:
    problems = []
    layer_types = t.get("layer_types")
    if layer_types is not None and not (
        isinstance(layer_types, list) and all(isinstance(x, str) for x in layer_types)
    ):
        problems.append("layer_types must be a list of strings, one per layer")
    only = t.get("mlp_only_layers")
    if only is not None and not (isinstance(only, list) and all(_is_int(i) for i in only)):
        problems.append("mlp_only_layers must be a list of layer numbers")
    eos = t.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not all(_is_int(i) and i >= 0 for i in ids):
        problems.append(f"eos_token_id must be a token id or a list of them, got {_show(eos)}")
    return problems


def _relation_problems(t: dict, arch) -> list[str]:
    """What well-typed fields must satisfy together, in a model built from the row `arch` of
    the architecture table."""
    problems = []
    heads, hidden = t["num_attention_heads"], t["hidden_size"]
    kv = t.get("num_key_value_heads", heads)
    if kv > heads or heads % kv:
        problems.append(
            f"num_attention_heads = {heads} must be a multiple of num_key_value_heads = {kv} "
            f"(each key/value head serves a whole group of query heads)"
        )
    head_dim = t.get("head_dim")
    if head_dim is None and hidden % heads:
        problems.append(
            f"hidden_size = {hidden} is not a multiple of num_attention_heads = {heads}, and "
            f"there is no head_dim to say how wide each head is"
        )
    head_dim = head_dim or hidden // heads
    rope = t.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0))
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        problems.append(
            f"RoPE turns head_dim * partial_rotary_factor = {head_dim} * {factor} -> {rotary} "
            f"dimensions of each head, which must be an even number >= 2 (pairs are rotated)"
        )
    problems += _moe_problems(t)
    problems += _fixed_field_problems(t, arch)
    if "linear_attention" in arch.mixers:
        problems += _linear_attention_problems(t)
    problems += _sliding_window_problems(t, arch)
    return problems + _block_problems(t, arch)


def _block_problems(t: dict, arch) -> list[str]:
    """What the row's own blocks need of the config: each block with a `config_problems(t)`
    (a function of the text model's fields, the row's defaults filled in, giving messages like
    the ones here) is asked."""
    blocks = [*arch.mixers.values(), arch.mlp, arch.decoder_layer, arch.forward]
    blocks = [b.func if isinstance(b, partial) else b for b in blocks]  # asked as the block
    checks = dict.fromkeys(getattr(b, "config_problems", None) for b in blocks)  # each once
    fields = {**arch.config_defaults, **t}
    return [p for check in checks if check is not None for p in check(fields)]


def _moe_problems(t: dict) -> list[str]:
    experts = t.get("num_experts", t.get("num_local_experts", 0))
    if not experts:
        return []
    k = t.get("num_experts_per_tok", 0)
    problems = []
    if not 1 <= k <= experts:
        problems.append(
            f"num_experts_per_tok = {k} must be from 1 to num_experts = {experts} (how many "
            f"experts each token is routed to; with 0 the experts would add nothing)"
        )
    if not t.get("moe_intermediate_size"):
        problems.append("moe_intermediate_size must be >= 1 (the width of each expert)")
    return problems


def _fixed_field_problems(t: dict, arch) -> list[str]:
    """Fields a model type does not read (`arch.fixed_fields`: Qwen3.5-MoE always renormalises
    its router and has experts in every layer): another value in the file is refused, since
    transformers ignores it and the model would not be the one the file describes."""
    problems = []
    rope = t.get("rope_parameters") if isinstance(t.get("rope_parameters"), dict) else {}
    for name, value in arch.fixed_fields.items():
        # transformers 5 keeps partial_rotary_factor in rope_parameters; older files beside it
        where = [("", t)] + [("rope_parameters.", rope)] * (name == "partial_rotary_factor")
        for prefix, part in where:
            if part.get(name) is None or part[name] == value:
                continue
            problems.append(
                f"{prefix}{name} is {_show(part[name])}, but this model type always has "
                f"{_show(value)} (transformers ignores the field); remove it, or use the "
                f"model_type the checkpoint was trained as"
            )
    return problems


def _linear_attention_problems(t: dict) -> list[str]:
    if "linear_attention" not in (t.get("layer_types") or []):
        return []
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim")
    names += ("linear_value_head_dim", "linear_conv_kernel_dim")
    problems = [f"{n} must be >= 1 for linear_attention layers" for n in names if not t.get(n)]
    k, v = t.get("linear_num_key_heads"), t.get("linear_num_value_heads")
    if k and v and v % k:
        problems.append(
            f"linear_num_value_heads = {v} must be a multiple of linear_num_key_heads = {k}"
        )
    return problems


def _sliding_window_problems(t: dict, arch) -> list[str]:
    """Which layers transformers windows, by the row's `sliding_window_layers`: with
    use_sliding_window true and a window (4096 when the field is absent), "all" layers
    (Qwen3-MoE), those from max_window_layers on (28 when absent; Qwen2, Qwen3),
    "alternate_below_max_window_layers" (Qwen2-MoE: layers 0, 2, 4, ... below it), unless
    layer_types lists the layers itself (a "sliding_attention" there is refused as an unknown
    layer type), or "none" (the type ignores the field). A window as long as the context
    changes nothing."""
    window = t.get("sliding_window", 4096)
    mode = arch.sliding_window_layers
    if not t.get("use_sliding_window") or window is None or mode == "none":
        return []
    if window >= t["max_position_embeddings"]:
        return []
    if mode != "all" and t.get("layer_types") is not None:  # the list decides; checked elsewhere
        return []
    n, limit = t["num_hidden_layers"], t.get("max_window_layers", 28)
    windowed = {
        "all": range(n),
        "from_max_window_layers": range(limit, n),
        "alternate_below_max_window_layers": range(0, min(limit, n), 2),
    }[mode]
    if not windowed:
        return []
    which = (
        f"layers {windowed[0]} and later"
        if mode != "alternate_below_max_window_layers"
        else (f"layers {', '.join(map(str, windowed[:4]))}{', ...' if len(windowed) > 4 else ''}")
    )
    if window == 0:  # transformers then masks every key and fails in its first forward
        return [
            f"use_sliding_window is true with sliding_window = 0, so {which} would attend to no "
            f"token at all (transformers fails on such a model too); set use_sliding_window to "
            f"false, or sliding_window to null, if the checkpoint was trained without a window"
        ]
    return [
        f"use_sliding_window is true with sliding_window = {window}, so {which} attend only "
        f"to the last {window} tokens (max_window_layers, layer_types); qwen_mini does not "
        f"implement sliding-window attention. Set use_sliding_window to false only if the "
        f"checkpoint was trained without it"
    ]
