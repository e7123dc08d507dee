"""Tiny checkpoints written by transformers itself, to test qwen_mini against.

    from helpers import write_checkpoint
    hf = write_checkpoint(tmp_path, "qwen3", tied=False, max_shard_size="20KB")
    ours = qwen_mini.load_model(tmp_path)   # same weights, read back from disk
    hf(ids).logits                          # the reference

transformers is the test oracle only; qwen_mini never imports it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

# model_type -> (transformers config class, model class): a new architecture adds its pair here
HF_CLASSES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}

# The one tiny config: small enough to write in milliseconds; grouped KV heads (4 query heads
# share 2 KV heads); Qwen3 gets head_dim 16 != hidden / heads, as the real one has 128 != 64.
TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=10000.0,
)


def tiny_config(model_type: str = "qwen3", **overrides) -> dict:
    """A tiny config.json (as a dict) of `model_type`; overrides change or add any field."""
    extra = {"head_dim": 16} if model_type == "qwen3" else {}
    return {"model_type": model_type, **TINY, **extra, **overrides}


def hf_config(model_type: str = "qwen3", **overrides):
    """The same tiny config as a transformers config object."""
    config_cls, _ = HF_CLASSES[model_type]
    fields = tiny_config(model_type, **overrides)
    del fields["model_type"]
    return config_cls(**fields)


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> torch.nn.Module:
    """Weights large enough that logits differ clearly (the default init gives near-zero logits,
    which would let a wrong implementation pass a tolerance check). Norms stay near 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else std * noise)
    return model


def tiny_model(model_type: str = "qwen3", seed: int = 0, std: float = 0.2, **overrides):
    """A qwen_mini model of the tiny config, randomized, in eval mode (no checkpoint on disk)."""
    from qwen_mini import CausalLM, Config

    cfg = Config.from_dict(tiny_config(model_type, **overrides))
    return randomize(CausalLM(cfg), seed, std).eval()


def write_checkpoint(
    folder: str | Path,
    model_type: str = "qwen3",
    *,
    tied: bool = True,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides,
):
    """Write a random tiny checkpoint with transformers' `save_pretrained`; return the model.

    tied: tie_word_embeddings (transformers then stores no lm_head.weight).
    max_shard_size: e.g. "20KB" to get model.safetensors.index.json and several shards.
    dtype: the stored dtype. overrides: any config field (hidden_size=64, attention_bias=True...).
    The returned transformers model is in eval mode, in `dtype`, with the written weights.
    """
    _, model_cls = HF_CLASSES[model_type]
    config = hf_config(model_type, tie_word_embeddings=tied, **overrides)
    model = model_cls(config)
    randomize(model, seed)
    model = model.to(dtype).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return model


def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The reference logits [B, T, vocab] of a transformers model."""
    with torch.no_grad():
        return model(input_ids).logits
