"""The model configuration, read from a checkpoint's `config.json`.

Which blocks a `model_type` is built from is not decided here but in one table,
`qwen_mini.architectures.ARCHITECTURES`; this file only reads the numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .validation import check_config


def _package_folder(name: str) -> Path:
    """A data folder shipped inside the package, as a real path: `tokenizers` opens files by
    name, and a wheel (or an editable install) puts the package on disk, never in a zip."""
    folder = resources.files(__package__) / name
    if not isinstance(folder, Path) or not folder.is_dir():
        raise RuntimeError(
            f"qwen_mini's data folder {folder} is missing or not on disk. Reinstall the package "
            "unzipped, from its wheel (`pip install --force-reinstall qwen_mini-*.whl`) or from "
            "a clone (`pip install -e .`): the tokenizers library opens its files by name."
        )
    return folder


# the package's assets/ folder: real config.json files, the vendored tokenizers, the course's
# small data files (each folder's README gives their source and licence)
ASSETS = _package_folder("assets")


@dataclass
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # width of a dense SwiGLU feed-forward
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # its own field in Qwen3: 128 != 1024 / 16 in the 0.6B
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on the q/k/v projections (Qwen2 always; Qwen3 if attention_bias)
    o_bias: bool  # Qwen3's `attention_bias` also adds one to o_proj (False in every release)
    qk_norm: bool  # RMSNorm on each query/key head before RoPE (Qwen3)
    dtype: str = "float32"  # how the checkpoint stores its weights
    eos_token_ids: list[int] = field(default_factory=list)
    # the mixer of each layer: "full_attention" (softmax attention with a KV cache) or
    # "linear_attention" (Gated DeltaNet, with a fixed-size state); all full by default
    layer_types: list[str] = field(default_factory=list)
    partial_rotary_factor: float = 1.0  # RoPE turns only this fraction of each head (Qwen3.5)
    attn_output_gate: bool = False  # sigmoid gate on the attention output (Qwen3.5)
    # mixture of experts (Qwen3-MoE and later); num_experts = 0 means dense everywhere
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # every n-th layer is sparse ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... except these
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    router_aux_loss_coef: float = 0.0
    # Gated DeltaNet (Qwen3.5 linear-attention layers)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

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
    def from_dict(cls, d: dict, source: str = "config.json") -> Config:
        from .architectures import ARCHITECTURES  # the table imports the blocks, which import us

        check_config(d, source)  # every bad field in one error, before anything is read
        model_type = d.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported by qwen_mini; "
                f"supported model types: {', '.join(ARCHITECTURES)}."
            )
        arch = ARCHITECTURES[model_type]
        # a multimodal checkpoint (Qwen3.5) keeps the text model's fields under text_config
        t = {**d, **d["text_config"]} if isinstance(d.get("text_config"), dict) else d
        try:
            cfg = cls._read(model_type, arch, d, t)
        except KeyError as e:
            raise ValueError(f"{source}: required field {e.args[0]!r} is missing.") from None
        unknown = sorted(set(cfg.layer_types) - set(arch.mixers))
        if unknown or len(cfg.layer_types) != cfg.num_hidden_layers:
            raise ValueError(
                f"{source}: layer_types must name one mixer per layer ({cfg.num_hidden_layers} "
                f"layers) out of {', '.join(arch.mixers)} for a {model_type} model; it has "
                f"{len(cfg.layer_types)} entries" + (f" and {unknown}." if unknown else ".")
            )
        return cfg

    @classmethod
    def _read(cls, model_type: str, arch, d: dict, t: dict) -> Config:
        """The fields of `t` (the text model's part of config.json `d`), with their defaults."""
        heads = t["num_attention_heads"]
        hidden = t["hidden_size"]
        # transformers 5 writes rope_parameters; the released configs have rope_theta
        rope = t.get("rope_parameters") or {}
        theta = rope.get("rope_theta", t.get("rope_theta", 10000.0))
        eos = t.get("eos_token_id")
        bias = t.get("attention_bias", False)
        return cls(
            model_type=model_type,
            vocab_size=t["vocab_size"],
            hidden_size=hidden,
            intermediate_size=t["intermediate_size"],
            num_hidden_layers=t["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=t.get("num_key_value_heads", heads),
            head_dim=t.get("head_dim") or hidden // heads,
            max_position_embeddings=t["max_position_embeddings"],
            rope_theta=float(theta),
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=d.get("tie_word_embeddings", t.get("tie_word_embeddings", False)),
            qkv_bias=arch.qkv_bias or bias,
            o_bias=bias and not arch.qkv_bias,
            qk_norm=arch.qk_norm,
            dtype=t.get("dtype") or t.get("torch_dtype") or d.get("torch_dtype") or "float32",
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            layer_types=list(t.get("layer_types") or []),
            partial_rotary_factor=rope.get(
                "partial_rotary_factor", t.get("partial_rotary_factor", 1.0)
            ),
            attn_output_gate=t.get("attn_output_gate", False),
            # the released configs say num_experts; transformers 5 writes num_local_experts
            num_experts=t.get("num_experts", t.get("num_local_experts", 0)),
            num_experts_per_tok=t.get("num_experts_per_tok", 0),
            moe_intermediate_size=t.get("moe_intermediate_size", 0),
            norm_topk_prob=t.get("norm_topk_prob", True),
            decoder_sparse_step=t.get("decoder_sparse_step", 1),
            mlp_only_layers=list(t.get("mlp_only_layers") or []),
            shared_expert_intermediate_size=t.get("shared_expert_intermediate_size", 0),
            router_aux_loss_coef=t.get("router_aux_loss_coef", 0.0),
            linear_num_key_heads=t.get("linear_num_key_heads", 0),
            linear_num_value_heads=t.get("linear_num_value_heads", 0),
            linear_key_head_dim=t.get("linear_key_head_dim", 0),
            linear_value_head_dim=t.get("linear_value_head_dim", 0),
            linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 0),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}).") from None
        return cls.from_dict(d, source=str(path))
