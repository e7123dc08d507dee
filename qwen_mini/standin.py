"""Tiny random models with the real architectures: what runs when the real weights are absent.

Each stand-in has the real model's `model_type`, QKV bias or QK-Norm, weight tying, RoPE base,
context length, vocabulary (151,936 or 248,320 rows, so the real tokenizer works) and
end-of-sequence ids, but only 2 layers of width 64 (Qwen3.5: 4, three Gated DeltaNet and one
attention, as 3 : 1). It runs every notebook in seconds; its text is gibberish.
Its weights go through the same validation and assignment as a real checkpoint's.
"""

from __future__ import annotations

import copy

import torch

from .architectures import Architecture, config_from_dict
from .checkpoint import build_model, checkpoint_name, expected_shapes, meta_model, validate
from .model import CausalLM

# shared by both stand-ins: small, but with grouped KV heads (4 query heads share 2 KV heads)
_TINY = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=151936,
    rms_norm_eps=1e-6,
    torch_dtype="bfloat16",
)

# config.json and generation_config.json of each stand-in, real values except the sizes above
STANDINS = {
    "Qwen/Qwen3-0.6B": {
        "config": dict(
            _TINY,
            model_type="qwen3",
            attention_bias=False,
            head_dim=32,  # != 64 / 4, as in the real model (128 != 1024 / 16)
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
        "generation_config": {
            "bos_token_id": 151643,
            "do_sample": True,
            "eos_token_id": [151645, 151643],
            "pad_token_id": 151643,
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
        },
    },
    # Qwen3.5-0.8B (text): the real 3 Gated DeltaNet : 1 gated attention pattern, partial RoPE
    # (a quarter of each head), vocabulary of 248,320 rows, theta 1e7, 262,144 positions
    "Qwen/Qwen3.5-0.8B": {
        "config": dict(
            _TINY,
            model_type="qwen3_5",
            vocab_size=248320,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            head_dim=32,
            attn_output_gate=True,
            partial_rotary_factor=0.25,
            linear_num_key_heads=2,
            linear_num_value_heads=2,  # = key heads, as in the real model (16 and 16)
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            max_position_embeddings=262144,
            rope_theta=10000000.0,
            tie_word_embeddings=True,
            eos_token_id=248044,
        ),
        # the official repository has no generation_config.json
        "generation_config": {},
    },
    "Qwen/Qwen2.5-0.5B": {
        "config": dict(
            _TINY,
            model_type="qwen2",
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151643,
        ),
        # the base model's generation_config.json: greedy, stops at <|endoftext|>
        "generation_config": {
            "bos_token_id": 151643,
            "do_sample": False,
            "eos_token_id": 151643,
            "max_new_tokens": 2048,
        },
    },
}

SEED = 0


def _random_weights(model: CausalLM, seed: int) -> dict[str, torch.Tensor]:
    """A state dict (by checkpoint name) of the shapes of the meta `model`: norms at 1 (at 0 where
    the norm scales by 1 + weight), everything else small and random.

    Uniform noise, not Gaussian: torch draws uniform numbers with the same scalar code on every
    CPU, so the stand-in is bit-identical on every machine. Drawn on the CPU whatever torch's
    default device is (the loader then puts them on the device asked for).
    """
    cfg = model.config
    g, dtype = torch.Generator().manual_seed(seed), getattr(torch, cfg.dtype)
    cpu = torch.device("cpu")  # where g draws, whatever torch's default device is
    # Qwen3.5's norms scale by (1 + weight): their neutral weight is 0, not 1
    zero_centred = {
        checkpoint_name(f"{name}.weight", cfg, model.arch)
        for name, module in model.named_modules()
        if getattr(module, "zero_centred", False)
    }
    weights = {}
    for name, shape in expected_shapes(cfg, model).items():
        if name in zero_centred:
            weights[name] = torch.zeros(shape, dtype=dtype, device=cpu)
        elif "norm" in name:
            weights[name] = torch.ones(shape, dtype=dtype, device=cpu)
        else:  # uniform on [-0.1, 0.1]: std 0.058, enough for the logits to differ visibly
            noise = torch.empty(shape, dtype=dtype, device=cpu)
            weights[name] = noise.uniform_(-0.1, 0.1, generator=g)
    return weights


def load_standin(
    name: str,
    dtype: torch.dtype | str | None = None,
    arch: Architecture | None = None,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """The stand-in for a known model name, e.g. "Qwen/Qwen3-0.6B" (same weights every call),
    built from `arch` (default: the row of its model_type), on `device`."""
    if name not in STANDINS:
        raise ValueError(f"no stand-in for {name!r}; stand-ins exist for: {', '.join(STANDINS)}.")
    spec = STANDINS[name]
    cfg = config_from_dict(spec["config"], f"stand-in {name}", arch)
    model = meta_model(cfg, arch)
    weights = _random_weights(model, SEED)
    # the same checks and the same assignment as a checkpoint read from disk
    validate(cfg, {k: tuple(w.shape) for k, w in weights.items()}, f"stand-in {name}", model=model)
    model = build_model(cfg, weights, dtype, model, device=device)
    model.generation_config = copy.deepcopy(spec["generation_config"])
    model.source, model.is_standin = "stand-in", True
    return model
