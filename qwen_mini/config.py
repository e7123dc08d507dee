"""The model configuration, read from a checkpoint's `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")

# the repository's assets/ folder: real config.json files, the vendored tokenizer (the package
# is installed editable from a clone, so it sits next to the package)
ASSETS = Path(__file__).resolve().parent.parent / "assets"


@dataclass
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q/k/v projections
    o_bias: bool  # Qwen3's `attention_bias` also adds one to o_proj (False in every release)
    qk_norm: bool  # Qwen3: RMSNorm on each query/key head before RoPE
    dtype: str = "float32"  # how the checkpoint stores its weights
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> Config:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported by qwen_mini; "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        try:
            heads = d["num_attention_heads"]
            hidden = d["hidden_size"]
            # transformers 5 writes rope_parameters; the released configs have rope_theta
            rope = d.get("rope_parameters") or {}
            theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
            eos = d.get("eos_token_id")
            qwen3 = model_type == "qwen3"
            return cls(
                model_type=model_type,
                vocab_size=d["vocab_size"],
                hidden_size=hidden,
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim") or hidden // heads,
                max_position_embeddings=d["max_position_embeddings"],
                rope_theta=float(theta),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                tie_word_embeddings=d.get("tie_word_embeddings", False),
                qkv_bias=d.get("attention_bias", False) if qwen3 else True,
                o_bias=d.get("attention_bias", False) if qwen3 else False,
                qk_norm=qwen3,
                dtype=d.get("dtype") or d.get("torch_dtype") or "float32",
                eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            )
        except KeyError as e:
            raise ValueError(f"{source}: required field {e.args[0]!r} is missing.") from None

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}).") from None
        return cls.from_dict(d, source=str(path))
