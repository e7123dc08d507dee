"""The model configuration: the numbers a checkpoint's `config.json` gives.

Which blocks a `model_type` is built from, its flags (QKV bias, QK-Norm, norm style) and its
per-type defaults are not decided here but in one table, `qwen_mini.architectures.ARCHITECTURES`,
which reads this module (never the other way round); this file only holds and reads numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path


def _package_folder(name: str) -> Path:
    """A data folder of the package, as a real path (`tokenizers` opens files by name): inside
    the package where a wheel installs it (qwen_mini/NAME), else the clone's top-level NAME
    beside qwen_mini/ (a clone on PYTHONPATH or an editable install: pyproject.toml maps the one
    to the other)."""
    package = Path(__file__).resolve().parent
    installed, clone = package / name, package.parent / name
    if installed.is_dir():
        return installed
    if clone.is_dir() and (package.parent / "pyproject.toml").is_file():
        return clone
    raise RuntimeError(
        f"qwen_mini's data folder {installed} is missing (nor is there a clone's {clone}). "
        "Reinstall the package unzipped, from its wheel (`pip install --force-reinstall "
        "qwen_mini-*.whl`) or from a clone (`pip install -e .`): the tokenizers library opens "
        "its files by name."
    )


# the package's data: real config.json files, the vendored tokenizers, the stand-ins' weights,
# the course's small data files (each folder's README gives their source and licence); the
# top-level assets/ of the clone, installed as qwen_mini/assets/
ASSETS = _package_folder("assets")


@dataclass(frozen=True)
class RopeScaling:
    """config.json's `rope_scaling` (or `rope_parameters`) when it asks for more than plain
    RoPE: how `qwen_mini.rope_scaling` stretches the angles past the trained context."""

    rope_type: str  # "linear" or "yarn"
    factor: float  # how many times the trained context
    original_max_position_embeddings: int = 0  # the trained context (YaRN)
    beta_fast: float = 32.0  # pairs turning more often than this over it are kept (YaRN)
    beta_slow: float = 1.0  # pairs turning less often than this are interpolated (YaRN)
    attention_factor: float | None = None  # cos and sin scale; None: from the factor (YaRN)
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True  # round the ramp's ends to whole pairs (YaRN)


@dataclass(frozen=True)
class Config:
    """The numbers of one model, and nothing else: which blocks they fill is the architecture
    row's business (`qwen_mini.architectures`). Every field has a default (Qwen3-0.6B's sizes), so
    a tiny test model states only what differs: `Config(hidden_size=64, num_hidden_layers=2)`.
    Frozen: a variant is `dataclasses.replace(cfg, num_key_value_heads=1)`."""

    model_type: str = "qwen3"  # the architecture row (ARCHITECTURES) that reads these numbers
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072  # width of a dense SwiGLU feed-forward
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 0  # 0: hidden_size // num_attention_heads (Qwen3 states its own: 128 in 0.6B)
    max_position_embeddings: int = 40960
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # config.json's switch for q/k/v/o biases (Qwen3 and later)
    qkv_bias: bool = True  # the q/k/v bias of rows with Qwen2 attention (qwen2_moe's switch)
    dtype: str = "float32"  # how the checkpoint stores its weights
    eos_token_ids: tuple[int, ...] = ()
    # the mixer of each layer: "full_attention" (softmax attention with a KV cache) or
    # "linear_attention" (Gated DeltaNet, with a fixed-size state); () means the pattern of
    # full_attention_interval
    layer_types: tuple[str, ...] = ()
    # with no layer_types: every n-th layer full attention, the others linear (the hybrids'
    # default, 4); 0 means all full
    full_attention_interval: int = 0
    partial_rotary_factor: float = 1.0  # RoPE turns only this fraction of each head (Qwen3.5)
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    attn_output_gate: bool = False  # sigmoid gate on the attention output (Qwen3.5)
    # mixture of experts (Qwen3-MoE and later); num_experts = 0 means dense everywhere
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # every n-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    router_aux_loss_coef: float = 0.0
    # Gated DeltaNet (Qwen3.5 linear-attention layers)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Qwen3.8-Flash-Next (qwen4_exp): Qwen Sparse Attention's indexer (0: none) ...
    indexer_n_heads: int = 0
    indexer_kv_heads: int = 0
    indexer_head_dim: int = 0
    indexer_budget: int = 0  # tokens of complete blocks each query may keep
    indexer_compress_ratio: int = 0  # tokens per block
    # ... gated residual streams (hyper-connections) ...
    hc_count: int = 0  # parallel residual streams
    hc_lowrank: int = 0  # rank of the read gate
    # ... the n-gram embedding (PLE) of the layers ple_layer_ids (1-indexed) ...
    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int = 0  # 0: hidden_size
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3  # the longest n-gram hashed (2..ngram_size)
    heads_per_ngram: int = 8  # hash heads per n-gram order
    ngram_vocab_size_base: int = 20_000_000  # the first head's table has the first prime >= it
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234  # of the hash multipliers
    split_ngram_parts: int = 512  # the table is stored in this many shards
    # ... and the activation of the DeltaNet output gate ("": hidden_act, silu)
    output_gate_type: str = ""
    # multi-token prediction (Qwen3-Next, Qwen3.5, Qwen3.8): decoder layers of the `mtp.` head
    # that drafts the token after next (0: none; qwen_mini.mtp)
    mtp_num_hidden_layers: int = 0

    def __post_init__(self):
        """The derived fields, in this one place: the layer types and head_dim left at their
        defaults, and lists given as tuples (a frozen config holds nothing that can change)."""
        derived = {
            "layer_types": tuple(self.layer_types) or self._interval_layer_types(),
            "head_dim": self.head_dim or self.hidden_size // max(self.num_attention_heads, 1),
            "eos_token_ids": tuple(self.eos_token_ids),
            "mlp_only_layers": tuple(self.mlp_only_layers),
            "ple_layer_ids": tuple(sorted(set(self.ple_layer_ids))),  # as transformers reads it
            "ple_embed_dim": self.ple_embed_dim or self.hidden_size,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # the one write a frozen dataclass allows

    def _interval_layer_types(self) -> tuple[str, ...]:
        """The layer types config.json leaves out, as transformers derives them: layer i is full
        attention when (i + 1) is a multiple of full_attention_interval, else linear."""
        n = self.full_attention_interval
        return tuple(
            "full_attention" if not n or (i + 1) % n == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        )

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions RoPE turns (all but in Qwen3.5's attention)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a mixture of experts instead of a dense feed-forward."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(
        cls, d: dict, source: str = "config.json", defaults: dict | None = None
    ) -> Config:
        """The numbers of a config.json `d`. `defaults`: values for the fields the file may leave
        out that differ by model type (the architecture row's `config_defaults`); reading a
        checkpoint's file goes through `qwen_mini.architectures.config_from_dict`, which passes
        them and checks the result against the row."""
        t = text_fields(d)
        try:
            return cls._read(d, t, {**cls.defaults(), **(defaults or {})}, set(defaults or ()))
        except KeyError as e:
            raise ValueError(f"{source}: required field {e.args[0]!r} is missing.") from None
        except RopeScalingError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def defaults(cls) -> dict:
        return {f.name: f.default for f in fields(cls)}

    @classmethod
    def _read(cls, d: dict, t: dict, default: dict, optional: set) -> Config:
        """The fields of `t` (the text model's part of config.json `d`), with their defaults;
        `optional`: the fields the row gives a default for, which the file may then leave out
        even where they are otherwise required (intermediate_size of a model with no dense
        layer)."""
        heads = t["num_attention_heads"]
        hidden = t["hidden_size"]
        # transformers 5 writes rope_parameters; the released configs have rope_theta
        rope = t.get("rope_parameters") or {}
        theta = rope.get("rope_theta", t.get("rope_theta", 10000.0))
        eos = t.get("eos_token_id")

        def get(name, *aliases):  # the field, or one of its older names, or the default
            for key in (name, *aliases):
                if t.get(key) is not None:
                    return t[key]
            return default[name]

        # a model with no dense layer (Qwen3.5-MoE) has no intermediate_size
        dense = (
            get("intermediate_size") if "intermediate_size" in optional else t["intermediate_size"]
        )
        return cls(
            model_type=d.get("model_type", default["model_type"]),
            vocab_size=t["vocab_size"],
            hidden_size=hidden,
            intermediate_size=dense,
            num_hidden_layers=t["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=t.get("num_key_value_heads", heads),
            head_dim=get("head_dim") or hidden // heads,
            max_position_embeddings=t["max_position_embeddings"],
            rope_theta=float(theta),
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=d.get("tie_word_embeddings", t.get("tie_word_embeddings", False)),
            attention_bias=get("attention_bias"),
            qkv_bias=get("qkv_bias"),
            dtype=t.get("dtype") or t.get("torch_dtype") or d.get("torch_dtype") or "float32",
            eos_token_ids=() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
            layer_types=tuple(t.get("layer_types") or ()),
            full_attention_interval=get("full_attention_interval"),
            partial_rotary_factor=rope.get("partial_rotary_factor", get("partial_rotary_factor")),
            rope_scaling=_rope_scaling(t),
            attn_output_gate=get("attn_output_gate"),
            # the released configs say num_experts; transformers 5 writes num_local_experts
            num_experts=get("num_experts", "num_local_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
            norm_topk_prob=get("norm_topk_prob"),
            decoder_sparse_step=get("decoder_sparse_step"),
            mlp_only_layers=tuple(t.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=get("shared_expert_intermediate_size"),
            router_aux_loss_coef=get("router_aux_loss_coef"),
            linear_num_key_heads=get("linear_num_key_heads"),
            linear_num_value_heads=get("linear_num_value_heads"),
            linear_key_head_dim=get("linear_key_head_dim"),
            linear_value_head_dim=get("linear_value_head_dim"),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim"),
            **{name: get(name) for name in QWEN4_FIELDS},
            ple_layer_ids=tuple(t.get("ple_layer_ids") or ()),
            output_gate_type=t.get("output_gate_type") or "",
            mtp_num_hidden_layers=get(*MTP_COUNT),
        )


# the MTP head's layer count; Qwen3-Next's name for it is DeepSeek-V3's (its released config.json
# has neither: the checkpoint's loader then counts the layers its weights carry)
MTP_COUNT = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def text_fields(d: dict) -> dict:
    """The text model's fields of config.json `d`: a multimodal checkpoint (Qwen3.5) keeps them
    under text_config."""
    return {**d, **d["text_config"]} if isinstance(d.get("text_config"), dict) else d


# the fields of Qwen3.8-Flash-Next read as they are (checked in qwen_mini.validation)
QWEN4_FIELDS = (
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
    "hc_count",
    "hc_lowrank",
    "ple_embed_dim",
    "ple_conv_kernel_size",
    "ngram_size",
    "heads_per_ngram",
    "ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by",
    "seed",
    "split_ngram_parts",
)


class RopeScalingError(ValueError):
    """A RoPE scaling this package does not implement, or one missing what it needs."""


def _rope_scaling(t: dict) -> RopeScaling | None:
    """The scaling config.json asks for, read as transformers reads it: a legacy `rope_scaling`
    table replaces `rope_parameters`; its kind is `rope_type` (or `type`)."""
    table = t.get("rope_scaling") or t.get("rope_parameters") or {}
    kind = table.get("rope_type", table.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "yarn"):
        raise RopeScalingError(
            f'rope_type {kind!r} is not implemented (only "default", "linear" and "yarn"); '
            "without it the model would differ from the checkpoint's."
        )
    original = table.get("original_max_position_embeddings") or t.get(
        "original_max_position_embeddings", t["max_position_embeddings"]
    )
    where = "rope_scaling" if t.get("rope_scaling") else "rope_parameters"
    if "factor" not in table:  # transformers refuses it too ("Missing required keys")
        raise RopeScalingError(
            f"{where}.factor is missing: {kind} RoPE scaling needs one (how many times the "
            f'trained context, e.g. {where}: {{"rope_type": "{kind}", "factor": 4.0}}).'
        )
    factor = table.get("factor")
    if factor is None and kind == "yarn":  # as transformers: the ratio of the two contexts
        factor = t["max_position_embeddings"] / original
    if factor is None:
        raise RopeScalingError(f"{kind} RoPE scaling needs a factor; rope_scaling has none.")
    return RopeScaling(
        rope_type=kind,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(table.get("beta_fast") or 32.0),
        beta_slow=float(table.get("beta_slow") or 1.0),
        attention_factor=table.get("attention_factor"),
        mscale=float(table.get("mscale") or 0.0),
        mscale_all_dim=float(table.get("mscale_all_dim") or 0.0),
        truncate=bool(table.get("truncate", True)),
    )
