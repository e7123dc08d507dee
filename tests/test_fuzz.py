"""A corpus of bad input, generated systematically from checkpoints transformers writes.

Every case edits a copy of a tiny Qwen3, sharded Qwen2, Qwen3-MoE, Qwen3.5 or bf16 checkpoint (a
config field, a safetensors header, an index, a tensor's dtype or values, a generation config, a
tokenizer file) or misuses the runtime (sampling settings, ids, text, chat messages). Each must
end in one of two ways:

- a clear error: qwen_mini's own exception (never a raw json / safetensors / tokenizers one),
  whose message names the file and the field or tensor at fault;
- a correct load: logits equal to transformers' on the same folder (atol 1e-4, as the oracle).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helpers import HF_CLASSES, hf_logits, tiny_model, write_checkpoint
from safetensors.torch import load_file, save_file

from qwen_mini import chat, load_model, load_tokenizer
from qwen_mini.checkpoint import INDEX_FILE, SINGLE_FILE, load_checkpoint, scan_nonfinite
from qwen_mini.generation import NonFiniteLogitsError, generate_tokens
from qwen_mini.tokenizer import VENDORED_QWEN3

IDS = torch.tensor([[3, 17, 99, 42, 5, 64, 120, 7]])


class _Delete:
    def __repr__(self):  # in test ids: the same in every process (pytest -n 2 compares them)
        return "DELETE"


DELETE = _Delete()  # as a field value: remove the field
BASES = {  # name -> how write_checkpoint writes it
    "qwen3": dict(model_type="qwen3", tied=True),
    "qwen2-sharded": dict(model_type="qwen2", tied=False, max_shard_size="20KB"),
    "qwen3_moe": dict(model_type="qwen3_moe", tied=False),
    "qwen3_5": dict(model_type="qwen3_5", tied=True),
    "qwen3-bf16": dict(model_type="qwen3", tied=False, dtype=torch.bfloat16),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Each base checkpoint written once; cases edit copies of it."""
    root = tmp_path_factory.mktemp("bases")
    for name, spec in BASES.items():
        write_checkpoint(root / name, **spec)
    shutil.copytree(VENDORED_QWEN3, root / "tokenizer", ignore=shutil.ignore_patterns("*.md"))
    return {name: root / name for name in [*BASES, "tokenizer"]}


def copy(base: Path, folder: Path) -> Path:
    """A copy whose files are links to the base's: every edit below replaces a file, never
    writes into one, so the base stays intact."""
    folder.mkdir()
    for f in base.iterdir():
        (folder / f.name).symlink_to(f)
    return folder


def replace_file(path: Path, data: bytes) -> None:
    path.unlink(missing_ok=True)
    path.write_bytes(data)


def is_ours(error: BaseException) -> bool:
    """Raised by qwen_mini itself, as one of the exception kinds a learner is promised."""
    return type(error).__module__.startswith("qwen_mini") or (
        type(error) in (ValueError, TypeError)
        and error.__traceback__ is not None
        and _raised_in_qwen_mini(error)
    )


def _raised_in_qwen_mini(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return "qwen_mini" in tb.tb_frame.f_code.co_filename


def assert_clear_error(error: BaseException, words: list[str]) -> None:
    message = str(error)
    assert is_ours(error), f"{type(error).__module__}.{type(error).__name__}: {message}"
    assert isinstance(error, (ValueError, TypeError, RuntimeError)), type(error)
    missing = [w for w in words if w not in message]
    assert not missing, f"{missing} not in: {message}"


# --- the cases: (base, an edit of the folder, the words the error must hold or None: loads) ------


@dataclass
class Case:
    base: str
    edit: object  # folder -> None
    words: list[str] | None  # None: the folder loads and matches transformers
    id: str = ""
    notes: list[str] = field(default_factory=list)


def text_part(cfg: dict, base: str) -> dict:
    return cfg["text_config"] if base == "qwen3_5" else cfg


def set_fields(base: str, **fields):
    """An edit that sets (or with DELETE removes) config.json fields of the text model; the
    name `rope_theta` means rope_parameters.rope_theta where the config keeps it there."""

    def edit(folder: Path):
        cfg = json.loads((folder / "config.json").read_text())
        for name, value in fields.items():
            top = name == "tie_word_embeddings"
            part = cfg if top else text_part(cfg, base)
            if name == "rope_theta" and "rope_parameters" in part:
                part = part["rope_parameters"]
            if value is DELETE:
                part.pop(name, None)
            else:
                part[name] = value
        replace_file(folder / "config.json", json.dumps(cfg).encode())

    return edit


def set_top_fields(**fields):
    """An edit of config.json's top-level fields (model_type of a multimodal config too)."""

    def edit(folder: Path):
        cfg = json.loads((folder / "config.json").read_text())
        for name, value in fields.items():
            if value is DELETE:
                cfg.pop(name, None)
            else:
                cfg[name] = value
        replace_file(folder / "config.json", json.dumps(cfg).encode())

    return edit


def config_cases() -> list[Case]:
    cases = []
    sizes = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "max_position_embeddings"]  # fmt: skip
    bad_sizes = [None, -1, 0, "8", 2.5, True, [2], {"n": 2}, 2**40, DELETE]
    bad_floats = [0, -1.0, math.nan, math.inf, -math.inf, "1e6", None, True, [1]]
    for base in BASES:
        for name in [*sizes, "num_key_value_heads"]:
            for value in bad_sizes:
                if value == 0 and name == "num_hidden_layers":
                    continue  # no layers is a model (the course builds one); see below
                if name == "num_key_value_heads" and value is DELETE:
                    continue  # a default (num_attention_heads): the shapes then disagree
                cases.append(
                    Case(
                        base,
                        set_fields(base, **{name: value}),
                        ["config.json", name],
                        f"{base}-{name}={value!r}",
                    )
                )
        for value in bad_floats:
            cases.append(
                Case(
                    base,
                    set_fields(base, rope_theta=value),
                    ["rope_theta"],
                    f"{base}-rope_theta={value!r}",
                )
            )
        for value in [-1e-6, math.nan, math.inf, "1e-6", None, False]:
            cases.append(
                Case(
                    base,
                    set_fields(base, rms_norm_eps=value),
                    ["rms_norm_eps"],
                    f"{base}-rms_norm_eps={value!r}",
                )
            )
        for value in [0, 1.5, -0.5, math.nan, "0.5", None]:
            cases.append(
                Case(
                    base,
                    set_fields(base, partial_rotary_factor=value),
                    ["partial_rotary_factor"],
                    f"{base}-partial_rotary={value!r}",
                )
            )
        if base != "qwen3_5":  # transformers ignores the field here: refused, never ignored
            words = ["config.json", "partial_rotary_factor", "transformers ignores"]
            cases.append(
                Case(base, set_fields(base, partial_rotary_factor=0.5), words,
                     f"{base}-partial_rotary=0.5-not-read")
            )  # fmt: skip
            cases.append(
                Case(base, set_fields(base, partial_rotary_factor=1.0), None,
                     f"{base}-partial_rotary=1.0")
            )  # fmt: skip
        # model_type names the row: anything but one of its strings is refused first
        for value in [["qwen3"], {"qwen3": 1}, 3, None, DELETE, "Qwen3"]:
            cases.append(
                Case(base, set_top_fields(model_type=value), ["config.json", "model_type"],
                     f"{base}-model_type={value!r}")
            )  # fmt: skip
        for name, values in [("tie_word_embeddings", ["false", "true", 0, 1, None]),
                             ("attention_bias", ["false", 1, None]),
                             ("use_sliding_window", ["false", 1])]:  # fmt: skip
            for value in values:
                cases.append(
                    Case(
                        base, set_fields(base, **{name: value}), [name], f"{base}-{name}={value!r}"
                    )
                )
        for value in ["gelu", "relu", "gelu_pytorch_tanh", "SiLU", None]:
            cases.append(
                Case(
                    base,
                    set_fields(base, hidden_act=value),
                    ["hidden_act"],
                    f"{base}-hidden_act={value!r}",
                )
            )
        # transformers' "swish" is nn.SiLU: the same model
        cases.append(Case(base, set_fields(base, hidden_act="swish"), None, f"{base}-swish"))
        for value in ["int8", "float8", 5, "fp16"]:
            cases.append(
                Case(base, set_fields(base, dtype=value), ["dtype"], f"{base}-dtype={value!r}")
            )
        for value in ["x", -1, [1, "a"], 2.5]:
            cases.append(
                Case(
                    base,
                    set_fields(base, eos_token_id=value),
                    ["eos_token_id"],
                    f"{base}-eos={value!r}",
                )
            )
        rope = "rope_parameters" if base == "qwen3_5" else "rope_scaling"
        # implemented (qwen_mini.rope_scaling): these load, and match transformers
        scalings = [{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                    {"rope_type": "linear", "factor": 2.0}]  # fmt: skip
        for value in scalings:
            cases.append(
                Case(base, set_fields(base, **{rope: value}), None, f"{base}-{rope}={value!r}")
            )
        refused = [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "llama3", "factor": 8.0},
                   {"rope_type": "linear"}, {"rope_type": "yarn", "factor": float("nan")},
                   {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": -4},
                   "yarn", [1], {"rope_type": "yarn"},  # transformers: "Missing ... factor"
                   {"rope_type": "yarn", "original_max_position_embeddings": 16}]  # fmt: skip
        for value in refused:
            cases.append(
                Case(base, set_fields(base, **{rope: value}), [rope], f"{base}-{rope}={value!r}")
            )
        # head counts that cannot share out: 4 query heads over 3 or 8 key/value heads
        for name, value in [("num_key_value_heads", 3), ("num_key_value_heads", 8),
                            ("num_attention_heads", 3)]:  # fmt: skip
            cases.append(
                Case(
                    base,
                    set_fields(base, **{name: value}),
                    [name],
                    f"{base}-{name}={value}-does-not-divide",
                )
            )
        # resource limits: refused from the config alone, before anything is built
        # no layers: a model (the course builds one), but not the one these weights are
        no_layers = set_fields(base, num_hidden_layers=0, layer_types=DELETE)
        cases.append(Case(base, no_layers, ["num_hidden_layers = 0"], f"{base}-no-layers"))
        layers = dict(num_hidden_layers=100_000, layer_types=DELETE)
        if base == "qwen3_5":  # its layer_types names each layer
            layers["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * 25_000
        cases.append(
            Case(
                base,
                set_fields(base, **layers),
                ["num_hidden_layers = 100000", "parameters"],
                f"{base}-100000-layers",
            )
        )
        cases.append(
            Case(base, set_fields(base, hidden_size=2**20), ["hidden_size"], f"{base}-huge-hidden")
        )
    return cases


# (id, fields, refused by Qwen2/Qwen3, refused by Qwen3-MoE). Without layer_types transformers
# derives it: Qwen2 and Qwen3 window the layers from max_window_layers on; Qwen3-MoE windows every
# layer; a layer_types list decides for Qwen2 and Qwen3; a window as long as the context is none.
WINDOW = dict(use_sliding_window=True, sliding_window=4, layer_types=DELETE)
SLIDING_WINDOWS = [
    ("from-0", dict(WINDOW, max_window_layers=0), True, True),
    ("from-1", dict(WINDOW, max_window_layers=1), True, True),
    ("past-last-layer", dict(WINDOW, max_window_layers=2), False, True),
    ("longer-than-context", dict(WINDOW, sliding_window=1000, max_window_layers=0), False, False),
    ("off", dict(WINDOW, use_sliding_window=False, max_window_layers=0), False, False),
    ("layer_types-full", dict(WINDOW, max_window_layers=0, layer_types=["full_attention"] * 2),
     False, True),
    # a window of 0 tokens where a layer is windowed: transformers fails in its first forward
    ("zero", dict(WINDOW, sliding_window=0, max_window_layers=0), True, True),
    ("zero-past-last-layer", dict(WINDOW, sliding_window=0, max_window_layers=2), False, True),
    ("zero-layer_types-full", dict(WINDOW, sliding_window=0, max_window_layers=0,
                                   layer_types=["full_attention"] * 2), False, True),
    ("null", dict(WINDOW, sliding_window=None, max_window_layers=0), False, False),
]  # fmt: skip


def sliding_window_cases() -> list[Case]:
    """Refused exactly where transformers would window a layer; loaded where it would not."""
    cases = []
    for base in ("qwen3", "qwen2-sharded", "qwen3_moe"):
        for kind, fields, dense, moe in SLIDING_WINDOWS:
            refused = moe if base == "qwen3_moe" else dense
            words = ["use_sliding_window", "sliding_window"] if refused else None
            cases.append(Case(base, set_fields(base, **fields), words, f"{base}-window-{kind}"))
    default = dict(WINDOW, sliding_window=DELETE, max_window_layers=0, max_position_embeddings=8192)
    cases.append(
        Case("qwen3", set_fields("qwen3", **default), ["use_sliding_window", "4096"],
             "qwen3-window-default-4096")
    )  # fmt: skip
    return cases


def without_weights(base: str, **fields):
    """The config edited, and the weights gone: the message gives the size, quickly."""

    def edit(folder: Path):
        set_fields(base, **fields)(folder)
        for f in folder.glob("model*.safetensors*"):
            f.unlink()

    return edit


def moe_cases() -> list[Case]:
    b = "qwen3_moe"
    cases = [Case(b, set_fields(b, num_experts_per_tok=v), ["num_experts_per_tok"],
                  f"moe-top_k={v!r}") for v in [0, DELETE, 5, -1, 2.5, None]]  # fmt: skip
    cases += [Case(b, set_fields(b, decoder_sparse_step=v), ["decoder_sparse_step"],
                   f"moe-sparse_step={v!r}") for v in [0, -1, None, "1"]]  # fmt: skip
    cases += [Case(b, set_fields(b, moe_intermediate_size=v), ["moe_intermediate_size"],
                   f"moe-width={v!r}") for v in [0, -16, None]]  # fmt: skip
    cases += [Case(b, set_fields(b, mlp_only_layers=v), ["mlp_only_layers"],
                   f"moe-mlp_only={v!r}") for v in ["0", [0.5], 3]]  # fmt: skip
    cases.append(
        Case(b, set_fields(b, num_experts=20_000), ["num_experts = 20000"], "moe-20000-experts")
    )
    cases.append(Case(b, set_fields(b, norm_topk_prob="true"), ["norm_topk_prob"], "moe-norm"))
    for name, value in [("num_experts", 20_000), ("num_hidden_layers", 100_000)]:
        edit = without_weights(b, **{name: value}, layer_types=DELETE)
        words = ["no weights found", "at least", "parameters"]
        cases.append(Case(b, edit, words, f"moe-{name}={value}-without-weights"))
    return cases


def qwen3_5_cases() -> list[Case]:
    b = "qwen3_5"
    cases = [Case(b, set_fields(b, layer_types=v), ["layer_types"], f"q35-layer_types={v!r}")
             for v in [["linear_attention"] * 4, ["sliding_attention"] * 4, "full",
                       ["full_attention"] * 3, [1, 2, 3, 4]]]  # fmt: skip
    cases += [Case(b, set_fields(b, **{n: v}), [n], f"q35-{n}={v!r}")
              for n in ("linear_num_key_heads", "linear_key_head_dim", "linear_conv_kernel_dim")
              for v in (0, None, "2")]  # fmt: skip
    cases.append(
        Case(
            b,
            set_fields(b, linear_num_value_heads=3),
            ["linear_num_value_heads"],
            "q35-value-heads-not-a-multiple",
        )
    )

    def text_config_list(folder):
        cfg = json.loads((folder / "config.json").read_text())
        cfg["text_config"] = [cfg["text_config"]]
        replace_file(folder / "config.json", json.dumps(cfg).encode())

    cases.append(Case(b, text_config_list, ["text_config"], "q35-text_config-list"))
    return cases


def whole_file_cases() -> list[Case]:
    """config.json, the index and generation_config.json as files of the wrong kind."""
    contents = {
        "list": b"[1, 2]", "number": b"3", "string": b'"qwen3"', "null": b"null",
        "deep": b"[" * 100_000 + b"]" * 100_000, "bom": b"\xef\xbb\xbf{}",
        "utf16": '{"model_type": "qwen3"}'.encode("utf-16"), "truncated": b'{"model_type": ',
        "empty": b"", "latin1": '{"model_type": "qwén3"}'.encode("latin-1"),
    }  # fmt: skip
    cases = []
    for kind, data in contents.items():
        for base, name in [("qwen3", "config.json"), ("qwen2-sharded", INDEX_FILE),
                           ("qwen3", "generation_config.json")]:  # fmt: skip
            cases.append(
                Case(
                    base, lambda f, n=name, d=data: replace_file(f / n, d), [name], f"{name}-{kind}"
                )
            )
    index_maps = {
        "no-weight_map": {"metadata": {}}, "weight_map-list": {"weight_map": []},
        "shard-number": {"weight_map": {"lm_head.weight": 3}},
        "shard-outside": {"weight_map": {"lm_head.weight": "../model.safetensors"}},
        "shard-in-folder": {"weight_map": {"lm_head.weight": "sub/model.safetensors"}},
    }  # fmt: skip
    for kind, index in index_maps.items():
        data = json.dumps(index).encode()
        cases.append(
            Case(
                "qwen2-sharded",
                lambda f, d=data: replace_file(f / INDEX_FILE, d),
                [INDEX_FILE, "weight_map"],
                f"index-{kind}",
            )
        )
    return cases


def generation_config_cases() -> list[Case]:
    settings = {
        "temperature": ["hot", math.nan, -1, math.inf], "top_k": [2.5, -1, "20", math.inf],
        "top_p": [0, 1.5, math.nan, "x"], "min_p": [2, -0.1], "presence_penalty": [math.nan,
        math.inf, "x"], "repetition_penalty": [0, -1.1, "x", math.nan], "do_sample": ["yes", 1],
        "eos_token_id": ["x", -1, [1, 2.5]],
        # what transformers would decode with and this package does not implement
        "no_repeat_ngram_size": [3], "num_beams": [4], "typical_p": [0.9],
        "bad_words_ids": [[[5]]], "min_new_tokens": [8],
    }  # fmt: skip
    cases = []
    for name, values in settings.items():
        for value in values:
            data = json.dumps({"do_sample": True, name: value}).encode()
            edit = lambda f, d=data: replace_file(f / "generation_config.json", d)  # noqa: E731
            cases.append(
                Case(
                    "qwen3",
                    edit,
                    ["generation_config.json", name],
                    f"generation_config-{name}={value!r}",
                )
            )
    return cases


# --- safetensors headers ----------------------------------------------------------------------


def header_of(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw(path: Path, header_bytes: bytes, body: bytes) -> None:
    replace_file(path, struct.pack("<Q", len(header_bytes)) + header_bytes + body)


def edit_header(file: str, change):
    """An edit of one safetensors file's header: change(header) edits the dict in place."""

    def edit(folder: Path):
        path = folder / file if file != "first shard" else first_shard(folder)
        header, body = header_of(path)
        change(header)
        write_raw(path, json.dumps(header).encode(), body)

    return edit


def first_shard(folder: Path) -> Path:
    """The first shard that holds several tensors (the embedding alone fills one)."""
    shards = list(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values())
    return folder / sorted(s for s in set(shards) if shards.count(s) > 2)[0]


def in_data_order(header: dict) -> list[str]:
    names = [k for k in header if k != "__metadata__"]
    return sorted(names, key=lambda k: header[k]["data_offsets"])


def header_cases() -> list[Case]:
    def entry(which: int, key: str, value):
        def change(h):
            h[in_data_order(h)[which]][key] = value

        return change

    def shift(which: int, by: int):
        def change(h):
            lo, hi = h[in_data_order(h)[which]]["data_offsets"]
            h[in_data_order(h)[which]]["data_offsets"] = [lo + by, hi + by]

        return change

    edits = {
        "overlap": (shift(1, -4), 1), "gap": (shift(-1, 4), -1), "offsets-negative":
        (entry(0, "data_offsets", [-4, 60]), 0), "offsets-float": (entry(1, "data_offsets",
        [0.0, 8.0]), 1), "offsets-strings": (entry(0, "data_offsets", ["0", "8"]), 0),
        "offsets-three": (entry(0, "data_offsets", [0, 4, 8]), 0), "offsets-reversed":
        (entry(1, "data_offsets", [8, 0]), 1), "offsets-null": (entry(0, "data_offsets", None),
        0),
    }  # fmt: skip
    for dtype in ["F33", "f32", "C64", "F4", "F8_E8M0", "F6_E2M3", 5, None, "int8"]:
        edits[f"dtype-{dtype}"] = (entry(0, "dtype", dtype), 0)
    for shape in [["64", "32"], [-64, 32], [64.0, 32], [[64], 32], "64x32", None, [64, 32, 0]]:
        edits[f"shape-{shape}"] = (entry(1, "shape", shape), 1)

    def not_a_dict(h):
        h[in_data_order(h)[0]] = [1, 2]

    def without(key):
        def change(h):
            del h[in_data_order(h)[1]][key]

        return change

    edits["entry-list"] = (not_a_dict, 0)
    for key in ("dtype", "shape", "data_offsets"):
        edits[f"entry-no-{key}"] = (without(key), 1)
    cases = []
    for base, file in [("qwen3", SINGLE_FILE), ("qwen2-sharded", "first shard"),
                       ("qwen3_5", SINGLE_FILE)]:  # fmt: skip
        for kind, (change, which) in edits.items():

            def edit(folder, change=change, which=which, file=file):
                path = folder / file if file != "first shard" else first_shard(folder)
                header, _ = header_of(path)
                tensor = in_data_order(header)[which]
                edit_header(file, change)(folder)
                (folder / "expected-tensor").write_text(tensor)

            name = "model-" if file == "first shard" else SINGLE_FILE
            cases.append(Case(base, edit, [name, "<tensor>"], f"{base}-header-{kind}"))
        for meta in [{"format": 1}, ["pt"], "pt", {"a": None}]:
            cases.append(
                Case(
                    base,
                    edit_header(file, lambda h, m=meta: h.update(__metadata__=m)),
                    ["__metadata__"],
                    f"{base}-metadata-{meta!r}",
                )
            )
        cases += raw_header_cases(base, file)
    return cases


def raw_header_cases(base: str, file: str) -> list[Case]:
    """Headers broken below the JSON: encoding, duplicates, lengths."""

    def raw(make):
        def edit(folder):
            path = folder / file if file != "first shard" else first_shard(folder)
            data = path.read_bytes()
            (n,) = struct.unpack("<Q", data[:8])
            replace_file(path, make(data[8 : 8 + n], data[8 + n :], data))

        return edit

    def duplicate(again):  # the first tensor's name again at the end, with `again`'s range
        def make(h, body, data):
            entries = [(k, v) for k, v in json.loads(h).items() if k != "__metadata__"]
            first = (entries[0][0], dict(entries[0][1], data_offsets=again(entries)))
            text = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in [*entries, first])
            text = ("{" + text + "}").encode()
            return struct.pack("<Q", len(text)) + text + body

        return make

    makes = {
        "bom": lambda h, body, d: struct.pack("<Q", len(h) + 3) + b"\xef\xbb\xbf" + h + body,
        "utf16": lambda h, body, d: (lambda u: struct.pack("<Q", len(u)) + u + body)(
            h.decode().encode("utf-16")
        ),
        "not-an-object": lambda h, body, d: struct.pack("<Q", 6) + b"[1, 2]" + body,
        "length-too-large": lambda h, body, d: struct.pack("<Q", len(d)) + d[8:],
        "length-2**63": lambda h, body, d: struct.pack("<Q", 2**63) + d[8:],
        "length-zero": lambda h, body, d: struct.pack("<Q", 0) + d[8:],
        "four-bytes": lambda h, body, d: d[:4],
        "trailing-garbage": lambda h, body, d: struct.pack("<Q", len(h) + 3) + h + b"xyz" + body,
        "truncated": lambda h, body, d: d[:-100],
        "extra-bytes": lambda h, body, d: d + b"\0" * 16,
        "duplicate-name-other-range": duplicate(lambda e: e[1][1]["data_offsets"]),
    }  # fmt: skip
    name = "model-" if file == "first shard" else SINGLE_FILE
    cases = [Case(base, raw(make), [name], f"{base}-raw-{kind}") for kind, make in makes.items()]
    # a name written twice with the same entry: safetensors (and so transformers) keeps the last
    same = duplicate(lambda e: e[0][1]["data_offsets"])
    return [*cases, Case(base, raw(same), None, f"{base}-raw-duplicate-name")]


# --- tensors: dtypes, tied heads -------------------------------------------------------------


def edit_tensors(change, file: str = SINGLE_FILE):
    def edit(folder: Path):
        path = folder / file
        tensors = load_file(path)
        change(tensors)
        path.unlink()
        save_file(tensors, path)

    return edit


UP = "model.layers.0.mlp.up_proj.weight"
EMBED = "model.embed_tokens.weight"


def tensor_cases() -> list[Case]:
    cases = []
    for dtype in [torch.int8, torch.int32, torch.int64, torch.bool, torch.uint8]:
        for name in (UP, EMBED):
            change = lambda t, n=name, d=dtype: t.update({n: t[n].to(d)})  # noqa: E731
            cases.append(
                Case("qwen3", edit_tensors(change), [SINGLE_FILE, name], f"tensor-{name}-{dtype}")
            )
    for dtype in [torch.float16, torch.bfloat16, torch.float64]:  # cast once, with a notice
        change = lambda t, d=dtype: t.update({UP: t[UP].to(d)})  # noqa: E731
        cases.append(Case("qwen3", edit_tensors(change), None, f"tensor-mixed-{dtype}"))
    head = lambda t: t.update({"lm_head.weight": torch.randn_like(t[EMBED])})  # noqa: E731
    cases.append(Case("qwen3", edit_tensors(head), None, "tied-with-a-different-stored-head"))
    same = lambda t: t.update({"lm_head.weight": t[EMBED].clone()})  # noqa: E731
    cases.append(Case("qwen3", edit_tensors(same), None, "tied-with-a-copy-of-the-embedding"))
    cases.append(
        Case(
            "qwen2-sharded",
            set_fields("qwen2-sharded", tie_word_embeddings=True),
            None,
            "untied-checkpoint-said-tied",
        )
    )
    cases.append(Case("qwen3", set_fields("qwen3", rope_scaling=None), None, "rope_scaling-null"))
    cases.append(
        Case(
            "qwen3",
            set_fields("qwen3", rope_scaling={"rope_type": "default"}),
            None,
            "rope_scaling-default",
        )
    )
    return cases


LOAD_CASES = (
    config_cases()
    + sliding_window_cases()
    + moe_cases()
    + qwen3_5_cases()
    + whole_file_cases()
    + generation_config_cases()
    + header_cases()
    + tensor_cases()
)


def test_the_corpus_is_large_and_named_uniquely():
    ids = [c.id for c in LOAD_CASES]
    assert len(ids) == len(set(ids))
    assert len(LOAD_CASES) >= 300


@pytest.fixture
def scratch(bases):
    """An empty folder per case, beside the bases: cheaper than pytest's tmp_path a thousand
    times over."""
    folder = bases["qwen3"].parent / "case"
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("case", LOAD_CASES, ids=[c.id for c in LOAD_CASES])
def test_loading(bases, scratch, case):
    folder = copy(bases[case.base], scratch)
    case.edit(folder)
    if case.words is None:
        return assert_loads_as_transformers(folder, BASES[case.base]["model_type"])
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a notice before the error is not what is tested
        with pytest.raises(BaseException) as e:
            load_checkpoint(folder)
    tensor = folder / "expected-tensor"
    words = [tensor.read_text() if w == "<tensor>" else w for w in case.words]
    assert_clear_error(e.value, words)
    assert time.perf_counter() - started < 1.0, "refused, but slowly"


def assert_loads_as_transformers(folder: Path, model_type: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # both in float32 (a bf16 checkpoint is widened exactly), so 1e-4 is a fair bound
        ours = load_checkpoint(folder, dtype=torch.float32)
        reference = HF_CLASSES[model_type][1].from_pretrained(folder).float().eval()
    want = hf_logits(reference, IDS)
    with torch.no_grad():
        got = ours(IDS).float()
    assert want.std() > 0.5  # far from zero: a wrong model could not pass by accident
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_window_of_no_tokens_fails_in_transformers_too(bases, scratch):
    """Why `sliding_window: 0` is refused where a layer is windowed: transformers builds such a
    model, then fails in its first forward (the mask and the keys disagree in length)."""
    folder = copy(bases["qwen3_moe"], scratch)
    set_fields("qwen3_moe", use_sliding_window=True, sliding_window=0)(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = HF_CLASSES["qwen3_moe"][1].from_pretrained(folder).eval()
    with pytest.raises(RuntimeError):
        hf_logits(reference, IDS)


@pytest.mark.parametrize("base", ["qwen3", "qwen2-sharded"])
def test_partial_rotary_factor_is_not_read_by_transformers_for_full_rope_types(
    bases, scratch, base
):
    """Why a partial_rotary_factor other than 1 is refused for Qwen2 / Qwen3 (and their MoE
    variants): transformers loads the file and turns every dimension anyway, so the file does
    not describe the model transformers runs."""
    folder = copy(bases[base], scratch)
    plain = HF_CLASSES[BASES[base]["model_type"]][1].from_pretrained(folder).eval()
    set_fields(base, partial_rotary_factor=0.5)(folder)
    edited = HF_CLASSES[BASES[base]["model_type"]][1].from_pretrained(folder).eval()
    torch.testing.assert_close(hf_logits(edited, IDS), hf_logits(plain, IDS), atol=0, rtol=0)


@pytest.mark.parametrize("stored", [torch.int8, torch.bool], ids=str)
@pytest.mark.parametrize("asked", [torch.float32, torch.bfloat16, "float16"], ids=str)
def test_integer_weights_are_refused_whatever_dtype_is_asked(bases, scratch, stored, asked):
    """An explicit dtype= would otherwise cast the integers into weights (or fail in torch)."""
    folder = copy(bases["qwen3"], scratch)
    edit_tensors(lambda t: t.update({UP: t[UP].to(stored)}))(folder)
    with pytest.raises(BaseException) as e:
        load_checkpoint(folder, dtype=asked)
    assert_clear_error(e.value, [SINGLE_FILE, UP, "floating point"])


@pytest.mark.parametrize(
    "dtype",
    [torch.int8, torch.bool, torch.int64, "int8", "bool", torch.float8_e4m3fn, torch.complex64,
     "fp32", 5, [torch.float32]],
    ids=repr,
)  # fmt: skip
def test_a_dtype_the_weights_cannot_be_computed_in_is_refused(bases, dtype):
    for load in (load_checkpoint, load_model):
        with pytest.raises(BaseException) as e:
            load(bases["qwen3"], dtype=dtype)
        assert_clear_error(e.value, ["dtype"])


@pytest.mark.parametrize("dtype", [None, "float32", torch.float32])
def test_dtype_none_or_a_name_loads_as_transformers(bases, dtype):
    """None keeps the stored dtype (float32 here); a name is the torch dtype of that name."""
    model = load_model(bases["qwen3"], dtype=dtype)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    reference = HF_CLASSES["qwen3"][1].from_pretrained(bases["qwen3"]).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), hf_logits(reference, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("where", [5, None, "", b"model", "~no-such-user-here/model"], ids=repr)
@pytest.mark.parametrize("load", [load_model, load_checkpoint, load_tokenizer])
def test_a_path_that_is_no_path_is_refused(load, where):
    with pytest.raises(BaseException) as e:
        load(where)
    assert_clear_error(e.value, [repr(where) if where != "~no-such-user-here/model" else "~"])


# --- Qwen Sparse Attention: ties at the top-k boundary, broken as transformers breaks them ----


def test_the_indexer_breaks_ties_as_a_topk_over_the_blocks_each_query_sees():
    """transformers takes each query's top k over exactly the complete blocks it sees; a row
    padded with -inf can keep another of several blocks tied at 0. Scores with many ties, from
    a cache of 0, 5 and 13 positions."""
    from qwen_mini.sparse_attention import QSAIndexer

    g = torch.Generator().manual_seed(0)
    for ratio, top, past in [(2, 2, 0), (3, 1, 5), (4, 3, 13), (2, 5, 0)]:
        indexer = QSAIndexer.__new__(QSAIndexer)  # only its two numbers are read
        indexer.ratio, indexer.top_blocks = ratio, top
        T = 40
        t_all = past + T
        scores = torch.randint(0, 3, (2, T, t_all // ratio), generator=g).float()
        chosen = indexer.chosen(scores, t_all)
        for b in range(2):
            for t in range(T):
                seen = (past + t + 1) // ratio
                want = torch.zeros(scores.shape[-1])
                if seen:
                    want[scores[b, t, :seen].topk(min(top, seen), dim=0).indices] = 1
                assert torch.equal(chosen[b, t], want), (ratio, top, past, b, t)


QWEN4_SIZE = dict(vocab_size=256, hidden_size=32, max_position_embeddings=512, eos_token_id=3)
# blocks of 3 tokens, the top 1 kept: with seed 1, some prompts make an attention layer's indexer
# meet a query whose two best blocks both score exactly 0
QWEN4_TIES = dict(hc_count=4, indexer_budget=3, indexer_compress_ratio=3, indexer_n_heads=3,
                  ngram_size=2, heads_per_ngram=4, ple_layer_ids=[2], seed=1)  # fmt: skip
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
               "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
               "mrope_interleaved": True}  # fmt: skip


@pytest.fixture(scope="module")
def qwen4_tied(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen4_exp")
    write_checkpoint(folder, "qwen4_exp", tied=False, **QWEN4_SIZE, **QWEN4_TIES)
    return folder


def boundary_tied(model, ids: torch.Tensor) -> bool:
    """Whether some query's k-th and (k+1)-th best blocks score the same."""
    from qwen_mini.sparse_attention import QSAIndexer

    found = []
    hooks = [m.register_forward_hook(lambda m, a, out: found.append((m, m.block_scores(*a))))
             for m in model.modules() if isinstance(m, QSAIndexer)]  # fmt: skip
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    for indexer, scores in found:
        k, r = indexer.top_blocks, indexer.ratio
        for t in range(scores.shape[1]):
            if (t + 1) // r > k:
                ranked = scores[:, t, : (t + 1) // r].sort(dim=-1, descending=True).values
                if (ranked[:, k - 1] == ranked[:, k]).any():
                    return True
    return False


@pytest.mark.parametrize(
    "fields",
    [{}, {"norm_topk_prob": False}, {"rope_parameters": LINEAR_ROPE}],
    ids=["as-written", "norm_topk_prob-false", "linear-rope"],
)
def test_qwen4_exp_past_the_budget_keeps_the_blocks_transformers_keeps(qwen4_tied, scratch, fields):
    folder = copy(qwen4_tied, scratch)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"].update(fields)
    replace_file(folder / "config.json", json.dumps(cfg).encode())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_checkpoint(folder, dtype=torch.float32)
        reference = HF_CLASSES["qwen4_exp"][1].from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():  # the first of a few prompts with a tie at the boundary
        prompts = (torch.randint(4, 256, (2, 24), generator=torch.Generator().manual_seed(seed))
                   for seed in range(16))  # fmt: skip
        ids = next((ids for ids in prompts if boundary_tied(ours, ids)), None)
        assert ids is not None, "no tie: the case would show nothing"
        want = hf_logits(reference.eval(), ids)
        torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=0)
        cache = ours.new_cache(batch_size=2)  # in pieces through the cache: the same blocks
        got = torch.cat([ours(ids[:, a:b], cache=cache) for a, b in [(0, 7), (7, 8), (8, 24)]], 1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


# --- non-finite weights: they load (as in transformers) but never become tokens --------------


NONFINITE = [(base, name, value) for base in ("qwen3", "qwen3-bf16")
             for name in (EMBED, "model.layers.0.mlp.down_proj.weight", "model.norm.weight")
             for value in (math.nan, math.inf, -math.inf)]  # fmt: skip


@pytest.mark.parametrize("base, name, value", NONFINITE)
def test_non_finite_weights_stop_generation_and_are_found(bases, tmp_path, base, name, value):
    folder = copy(bases[base], tmp_path / base)

    def poison(tensors):
        t = tensors[name].clone()
        t.view(-1)[5 * t.shape[-1] if t.dim() > 1 else 0 :][:4] = value  # row 5: token 5
        tensors[name] = t

    edit_tensors(poison)(folder)
    model = load_checkpoint(folder)
    with pytest.raises(NonFiniteLogitsError) as e:
        list(generate_tokens(model, [3, 5, 7], max_new_tokens=3, temperature=0))
    assert_clear_error(e.value, ["doctor --scan", "NaN"])
    assert [(p.name, n, bad) for p, n, bad, _ in scan_nonfinite(folder)] == [(SINGLE_FILE, name, 4)]


def test_scan_of_a_clean_checkpoint_finds_nothing(bases):
    assert scan_nonfinite(bases["qwen2-sharded"]) == []


# --- tokenizer files ----------------------------------------------------------------------


def tokenizer_cases() -> list[tuple[str, bytes]]:
    return [
        ("tokenizer.json", b"[]"), ("tokenizer.json", b"not json"), ("tokenizer.json", b""),
        ("tokenizer.json", b'{"version": "1.0"}'), ("tokenizer.json", b"\xef\xbb\xbf{"),
        ("tokenizer_config.json", b"[1]"), ("tokenizer_config.json", b"{"),
        ("tokenizer_config.json", b"[" * 50_000), ("tokenizer_config.json", b"\xff\xfe"),
        ("tokenizer_config.json", b'{"chat_template": 5}'),
        ("tokenizer_config.json", b'{"chat_template": "{% if %}"}'),
        ("tokenizer_config.json", b'{"chat_template": [{"template": "x"}]}'),
        ("tokenizer_config.json", b'{"chat_template": [1]}'),
        ("chat_template.jinja", b"{% for m in messages %}"), ("chat_template.jinja", b"\xff\xfe"),
        ("chat_template.jinja", b"{{ 1 + }}"),
        ("tokenizer_config.json", b'{"eos_token": "<nope>"}'),
        ("tokenizer_config.json", b'{"eos_token": {"content": "<nope>"}}'),
    ]  # fmt: skip


@pytest.mark.parametrize("file, data", tokenizer_cases(), ids=lambda x: repr(x)[:30])
def test_corrupt_tokenizer_file_is_named(bases, tmp_path, file, data):
    folder = copy(bases["tokenizer"], tmp_path / "tok")
    replace_file(folder / file, data)
    with pytest.raises(BaseException) as e:
        load_tokenizer(folder)
    assert_clear_error(e.value, [file])


def edit_tokenizer(folder: Path, drop: tuple[str, ...] = (), listed: dict | None = None) -> None:
    """tokenizer.json without the added tokens `drop`; tokenizer_config.json's
    added_tokens_decoder updated with `listed` (id -> entry, None: remove the id)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in drop]
    replace_file(folder / "tokenizer.json", json.dumps(data).encode())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key, entry in (listed or {}).items():
        config["added_tokens_decoder"].pop(key, None)
        if entry is not None:
            config["added_tokens_decoder"][key] = entry
    replace_file(folder / "tokenizer_config.json", json.dumps(config).encode())


THINK = {"content": "<think>", "lstrip": False, "normalized": False, "rstrip": False,
         "single_word": False, "special": False}  # fmt: skip


@pytest.mark.parametrize(
    "drop", [("<think>", "</think>"), ("<think>",), ("<tool_call>",)], ids=lambda d: "+".join(d)
)
def test_added_tokens_listed_only_in_tokenizer_config_are_added_as_transformers_adds_them(
    bases, tmp_path, drop
):
    from transformers import AutoTokenizer

    folder = copy(bases["tokenizer"], tmp_path / "tok")
    edit_tokenizer(folder, drop)
    ours, reference = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    text = "a<think>\nwhy\n</think>\n\n<tool_call>{}</tool_call>"
    assert ours.encode(text) == reference.encode(text)
    assert ours.think_id == 151667 and ours.end_think_id == 151668
    assert len(ours) == len(reference) == 151669
    ids = ours.encode(text)
    assert ours.decode(ids) == reference.decode(ids) == text
    assert ours.decode(ids, True) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "drop, listed, words",
    [
        ((), {"151667": None, "151700": THINK}, ["'<think>'", "151700", "151667"]),  # moved
        (("<think>",), {"151667": None, "151668": THINK}, ["151668", "'</think>'"]),  # id taken
        ((), {"x": THINK}, ["'x'"]),
        ((), {"151667": "<think>"}, ["151667"]),
        ((), {"151667": {"content": 5}}, ["151667"]),
    ],
    ids=["id-moved", "id-taken", "key-not-an-id", "entry-string", "content-number"],
)
def test_added_tokens_the_two_files_disagree_on_are_refused(bases, tmp_path, drop, listed, words):
    """transformers then encodes <think> as 151668 and decodes 151667 as </think>: no behaviour
    to copy, so both files are named."""
    folder = copy(bases["tokenizer"], tmp_path / "tok")
    edit_tokenizer(folder, drop, listed)
    with pytest.raises(BaseException) as e:
        load_tokenizer(folder)
    assert_clear_error(e.value, ["tokenizer_config.json", "added_tokens_decoder", *words])


def test_added_tokens_decoder_not_an_object_is_refused(bases, tmp_path):
    folder = copy(bases["tokenizer"], tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = ["<think>"]
    replace_file(folder / "tokenizer_config.json", json.dumps(config).encode())
    with pytest.raises(BaseException) as e:
        load_tokenizer(folder)
    assert_clear_error(e.value, ["tokenizer_config.json", "added_tokens_decoder"])


@pytest.mark.parametrize(
    "template",
    ["{% for i in range(10**9) %}x{% endfor %}", "{{ 'a' + 1 }}",
     "{{ (messages | length) / 0 }}", "{{ foo() }}"],
    ids=["huge-range", "text-plus-number", "division-by-zero", "undefined-function"],
)  # fmt: skip
def test_a_template_whose_code_fails_is_named(bases, tmp_path, template):
    """transformers raises the template's own error (OverflowError, TypeError, ...)."""
    folder = copy(bases["tokenizer"], tmp_path / "tok")
    replace_file(folder / "chat_template.jinja", template.encode())
    tok = load_tokenizer(folder)
    with pytest.raises(BaseException) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert_clear_error(e.value, ["chat template", "tokenizer.json"])


# --- the runtime: settings, ids, text, messages -----------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(VENDORED_QWEN3)


SETTINGS = [(name, value) for name, values in {
    "temperature": [math.nan, math.inf, -math.inf, -1, "0.7", True],
    "top_k": [math.nan, math.inf, 2.5, -1, "5"], "top_p": [math.nan, math.inf, 0, 1.5, "x"],
    "min_p": [math.nan, 2, "x"], "presence_penalty": [math.nan, math.inf, -math.inf, "x"],
    "repetition_penalty": [math.nan, math.inf, 0, -1.2, "x"],
    "max_new_tokens": [-1, 2.5, "3", None, True],
    # what transformers has and this package does not: refused by name, never ignored
    "no_repeat_ngram_size": [3], "num_beams": [2], "frequency_penalty": [0.5],
}.items() for value in values]  # fmt: skip


@pytest.mark.parametrize("name, value", SETTINGS, ids=lambda x: repr(x))
def test_bad_setting_is_named(model, name, value):
    extra = {} if name == "temperature" else {"temperature": 0.7}
    with pytest.raises(BaseException) as e:
        generate_tokens(model, [1, 2, 3], **{**extra, name: value})
    assert_clear_error(e.value, [name])


@pytest.mark.parametrize("seed", [2**70, 2**64, -(2**63) - 1, 1.5, "1", True, [1]], ids=repr)
def test_a_seed_torch_cannot_take_is_refused(model, tok, seed):
    with pytest.raises(BaseException) as e:
        generate_tokens(model, [1, 2, 3], max_new_tokens=2, temperature=0.7, seed=seed)
    assert_clear_error(e.value, ["seed"])
    with pytest.raises(BaseException) as e:
        chat.ChatSession(model, tok, seed=seed)
    assert_clear_error(e.value, ["seed"])


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_every_seed_torch_takes_samples_reproducibly(model, seed):
    def run() -> list[int]:
        return list(generate_tokens(model, [1, 2, 3], max_new_tokens=4, temperature=1.0, seed=seed))

    assert run() == run()


@pytest.mark.parametrize("ids", [[1.5], [1000], [-1], ["a"], [True], [10**9], [None]], ids=repr)
def test_bad_prompt_ids_are_refused(model, ids):
    with pytest.raises(BaseException) as e:
        generate_tokens(model, [1, *ids], max_new_tokens=1)
    assert_clear_error(e.value, ["prompt ids"])


@pytest.mark.parametrize(
    "input_ids",
    [torch.tensor([[1.0, 2.0]]), torch.tensor([[1000]]), torch.tensor([[-1]]),
     torch.tensor([[True]]), torch.tensor([1, 2]), torch.zeros(1, 0, dtype=torch.long),
     torch.zeros(0, 3, dtype=torch.long)],
    ids=["float", "past-vocab", "negative", "bool", "1-d", "no-tokens", "no-rows"],
)  # fmt: skip
def test_bad_input_ids_in_a_forward_are_refused(model, input_ids):
    cache = model.new_cache()
    with pytest.raises(BaseException) as e:
        model(input_ids, cache=cache)
    assert_clear_error(e.value, ["input_ids"])
    assert cache.length == 0


@pytest.mark.parametrize("input_ids", [[[1, 2]], ((1, 2),), "12", None], ids=repr)
def test_input_ids_that_are_no_tensor_are_refused(model, input_ids):
    with pytest.raises(BaseException) as e:
        model(input_ids)
    assert_clear_error(e.value, ["input_ids", "torch.Tensor"])


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, "2", True, None], ids=repr)
def test_a_cache_of_no_rows_is_refused(model, batch_size):
    with pytest.raises(BaseException) as e:
        model.new_cache(batch_size=batch_size)
    assert_clear_error(e.value, ["batch_size"])


@pytest.mark.parametrize("other", ["qwen3_5", "dict", "list"])
def test_a_cache_not_made_by_this_model_is_refused(model, other):
    cache = {"dict": {}, "list": []}[other] if other in ("dict", "list") else None
    cache = tiny_model(other).new_cache() if cache is None else cache
    with pytest.raises(BaseException) as e:
        model(torch.tensor([[1, 2]]), cache=cache)
    assert_clear_error(e.value, ["cache", "new_cache"])


@pytest.mark.parametrize("prompt", [None, "hello", b"hi", 5], ids=repr)
def test_a_prompt_that_is_no_list_of_ids_is_refused(model, prompt):
    with pytest.raises(BaseException) as e:
        generate_tokens(model, prompt, max_new_tokens=1)
    assert_clear_error(e.value, ["prompt ids"])


@pytest.mark.parametrize("name", ["no_repeat_ngram_size", "repetition_penalty_typo"])
def test_a_setting_not_implemented_is_refused_next_to_a_sampling_too(model, name):
    from qwen_mini.generation import Sampling

    with pytest.raises(BaseException) as e:
        generate_tokens(model, [1, 2], max_new_tokens=1, sampling=Sampling(), **{name: 3})
    assert_clear_error(e.value, [name, "unknown sampling setting"])


@pytest.mark.parametrize("where", ["argument", "generation_config.json"])
def test_repetition_penalty_decodes_as_transformers(bases, tmp_path, where):
    """Qwen2.5's generation_config.json asks for repetition_penalty 1.05-1.1: taken whatever
    do_sample says (a logits processor in transformers, not a sampling warper), over the
    prompt's tokens and the generated ones."""
    folder = tmp_path / "m"
    shutil.copytree(bases["qwen3"], folder)
    penalty, prompt, n = 1.5, [3, 17, 99, 42, 5, 64, 120, 7], 12
    gc = {"do_sample": False, "eos_token_id": 0}
    if where == "generation_config.json":
        gc["repetition_penalty"] = penalty
    (folder / "generation_config.json").write_text(json.dumps(gc))
    ours = load_model(folder)
    explicit = {"repetition_penalty": penalty} if where == "argument" else {}
    got = list(generate_tokens(ours, prompt, max_new_tokens=n, eos_token_ids=[], **explicit))
    plain = list(
        generate_tokens(ours, prompt, max_new_tokens=n, eos_token_ids=[], repetition_penalty=1.0)
    )
    reference = HF_CLASSES["qwen3"][1].from_pretrained(folder).eval()
    out = reference.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
        repetition_penalty=penalty, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    assert got == out[0, len(prompt) :].tolist()
    assert got != plain  # the penalty changes this decode: the comparison can fail


@pytest.mark.parametrize(
    "kwargs, name",
    [({"thinking": "no"}, "thinking"), ({"thinking": 1}, "thinking"),
     ({"thinking": None}, "thinking"), ({"budget": "5"}, "budget"), ({"budget": -1}, "budget"),
     ({"budget": 2.5}, "budget")],
    ids=repr,
)  # fmt: skip
def test_chat_session_arguments_of_the_wrong_kind_are_named(model, tok, kwargs, name):
    with pytest.raises(BaseException) as e:
        chat.ChatSession(model, tok, **kwargs)
    assert_clear_error(e.value, [name])


def test_sampling_given_as_a_dict_is_refused(model):
    with pytest.raises(BaseException) as e:
        generate_tokens(model, [1, 2], max_new_tokens=1, sampling={"temperature": 1.0})
    assert_clear_error(e.value, ["sampling", "Sampling"])


def test_padding_rows_decode_to_nothing_and_other_ids_are_refused(tok):
    assert tok.decode([151935]) == ""  # the real model's last embedding row: padding
    assert tok.decode(tok.encode("hi")) == "hi"


@pytest.mark.parametrize("ids", [[10**9], [-1], [1.5], "abc", [None], [True], b"ab", None])
def test_decode_refuses_what_is_no_id(tok, ids):
    with pytest.raises(BaseException) as e:
        tok.decode(ids)
    assert_clear_error(e.value, ["decode"])


@pytest.mark.parametrize("text", [b"x", None, 5, "a\ud800b", ["a"]], ids=repr)
def test_encode_refuses_what_is_no_text(tok, text):
    with pytest.raises(BaseException) as e:
        tok.encode(text)
    assert_clear_error(e.value, ["encode"])


BAD_CONVERSATIONS = {
    "no-content": ([{"role": "user"}], None, "content"),
    "assistant-content-none": ([{"role": "user", "content": "hi"}, {"role": "assistant",
                                "content": None, "tool_calls": [{"function": {"name": "f",
                                "arguments": {}}}]}], None, "content"),
    "content-number": ([{"role": "user", "content": 5}], None, "content"),
    "content-bytes": ([{"role": "user", "content": b"hi"}], None, "content"),
    "content-surrogate": ([{"role": "user", "content": "\ud800"}], None, "surrogate"),
    "unknown-role": ([{"role": "bot", "content": "hi"}], None, "role"),
    "no-role": ([{"content": "hi"}], None, "role"),
    "message-list": ([["user", "hi"]], None, "message"),
    "messages-string": ("hi", None, "messages"),
    "messages-empty": ([], None, "messages"),
    "tool_calls-string": ([{"role": "assistant", "content": "", "tool_calls": "f()"}], None,
                          "tool_calls"),
    "tool-name-number": ([{"role": "assistant", "content": "",
                           "tool_calls": [{"function": {"name": 5, "arguments": {}}}]}], None,
                         "tool call"),
    "tool-arguments-number": ([{"role": "assistant", "content": "",
                                "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
                              None, "tool call"),
    "tool-call-string": ([{"role": "assistant", "content": "", "tool_calls": ["f"]}], None,
                         "tool call"),
    # the official template writes `arguments | tojson`: transformers fails on Undefined
    "tool-call-no-arguments": ([{"role": "assistant", "content": "",
                                 "tool_calls": [{"function": {"name": "f"}}]}], None,
                               "'arguments'"),
    "flat-tool-call-no-arguments": ([{"role": "assistant", "content": "",
                                      "tool_calls": [{"name": "f"}]}], None, "'arguments'"),
    "tool-arguments-null": ([{"role": "assistant", "content": "",
                              "tool_calls": [{"function": {"name": "f", "arguments": None}}]}],
                            None, "tool call"),
    "tool_calls-on-user": ([{"role": "user", "content": "", "tool_calls": []}], None,
                           "tool_calls"),
    "tools-string": ([{"role": "user", "content": "hi"}], "search", "tools"),
    "tools-list-of-strings": ([{"role": "user", "content": "hi"}], ["search"], "tools"),
    "reasoning-number": ([{"role": "assistant", "content": "a", "reasoning_content": 3}], None,
                         "reasoning_content"),
}  # fmt: skip


@pytest.mark.parametrize(
    "messages, tools, word", BAD_CONVERSATIONS.values(), ids=BAD_CONVERSATIONS.keys()
)
@pytest.mark.parametrize("renderer", ["tokenizer", "render_prompt"])
def test_bad_conversation_is_refused(tok, renderer, messages, tools, word):
    render = (
        (lambda: tok.apply_chat_template(messages, tools=tools))
        if renderer == "tokenizer"
        else (lambda: chat.render_prompt(messages, tools=tools))
    )
    with pytest.raises(BaseException) as e:
        render()
    assert_clear_error(e.value, [word])


def test_valid_conversations_still_render_as_the_official_template(tok):
    """The checks refuse only what is invalid: tools, a tool call and its response render."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    assert '{"name": "weather", "arguments": {"city": "Oslo"}}' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_tool_call_without_arguments_fails_in_transformers_too():
    """Why it is refused: the official template writes `arguments | tojson`, and transformers
    cannot serialise the undefined value."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(VENDORED_QWEN3)
    messages = BAD_CONVERSATIONS["tool-call-no-arguments"][0]
    with pytest.raises(TypeError, match="Undefined"):
        reference.apply_chat_template(messages, tokenize=False)
