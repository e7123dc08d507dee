"""Tiny models with the real architectures: what runs when the real weights are absent.

Each stand-in has the real model's `model_type`, QKV bias or QK-Norm, weight tying, RoPE base,
context length, vocabulary (151,936 or 248,320 rows, so the real tokenizer works) and
end-of-sequence ids, but only 2 layers of width 64 (Qwen3.5: 4, three Gated DeltaNet and one
attention, as 3 : 1). It runs every notebook in seconds.

The stand-ins of Qwen3-0.6B and Qwen3.5-0.8B are trained (scripts/train_standins.py, weights in
assets/standins/) on about 120,000 tokens of narrative books of the King James Bible (public
domain), so they write simple English in that style: real words, mostly grammatical, with no
knowledge and no reasoning. Qwen3-0.6B's also saw chat turns, so it closes a think block and
answers; Qwen3.5-0.8B's multi-token-prediction head is trained too, so it drafts for
speculative decoding. The Qwen2.5-0.5B stand-in keeps random weights: its text is gibberish.
Their weights go through the same validation and assignment as a real checkpoint's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file

from .architectures import Architecture, config_from_dict
from .checkpoint import build_model, checkpoint_name, expected_shapes, meta_model, validate
from .config import ASSETS
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
        "chat": True,  # its training text has chat turns (the template ships with the tokenizer)
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
            # the real checkpoint's multi-token-prediction head (mtp.*, one layer): the stand-in
            # carries one too, trained after the main model (which stays as it was) to guess
            # the token after next from its last hidden state, so draft="mtp" drafts as on the
            # real model (acceptance on the held-out book: assets/standins/qwen3.5-0.8b.json)
            mtp_num_hidden_layers=1,
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
# the stand-ins with trained weights (scripts/train_standins.py); the others stay random
TRAINED = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B")
WEIGHTS_DIR = ASSETS / "standins"
# the rows of the embedding that the training text never used: tiny fixed noise (the random
# stand-in's, scaled down), so their logits stay ~0 as trained, yet an id outside the text
# still gives a hidden state that is not all zeros
UNUSED_SCALE = 1e-3


def standin_kind(name: str) -> str:
    """A few words on what `name`'s stand-in writes, for notices."""
    if name in TRAINED:
        return "tiny: simple English"  # one line of a notebook: under 100 characters
    return "tiny, random: gibberish"


def standin_file(name: str) -> Path:
    """Where the trained weights of `name`'s stand-in are stored."""
    return WEIGHTS_DIR / (name.split("/")[-1].lower() + ".safetensors")


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


def _trained_weights(name: str, weights: dict, model: CausalLM) -> dict[str, torch.Tensor]:
    """The random `weights` with the trained ones of standin_file(name) in their place: every
    stored tensor, and the stored rows (`used_ids`) of the embedding, whose other rows become
    the random rows scaled by UNUSED_SCALE."""
    path = standin_file(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"the stand-in's weights {path} are missing: reinstall qwen_mini, or write them "
            f"with `python scripts/train_standins.py {name}` from the repository's root."
        )
    stored = load_file(str(path))
    ids = stored.pop("used_ids")
    embed = checkpoint_name("model.embed_tokens.weight", model.config, model.arch)
    full = (weights[embed].float() * UNUSED_SCALE).to(weights[embed].dtype)
    full[ids] = stored.pop(embed)
    return {**weights, **stored, embed: full}


def load_standin(
    name: str,
    dtype: torch.dtype | str | None = None,
    arch: Architecture | None = None,
    device: torch.device | str = "cpu",
    trained: bool = True,
) -> CausalLM:
    """The stand-in for a known model name, e.g. "Qwen/Qwen3-0.6B" (same weights every call),
    built from `arch` (default: the row of its model_type), on `device`. trained=False gives the
    random weights it starts from (what training added is the difference)."""
    if name not in STANDINS:
        raise ValueError(f"no stand-in for {name!r}; stand-ins exist for: {', '.join(STANDINS)}.")
    spec = STANDINS[name]
    cfg = config_from_dict(spec["config"], f"stand-in {name}", arch)
    model = meta_model(cfg, arch)
    weights = _random_weights(model, SEED)
    if trained and name in TRAINED:
        weights = _trained_weights(name, weights, model)
    # the same checks and the same assignment as a checkpoint read from disk
    validate(cfg, {k: tuple(w.shape) for k, w in weights.items()}, f"stand-in {name}", model=model)
    model = build_model(cfg, weights, dtype, model, device=device)
    model.generation_config = copy.deepcopy(spec["generation_config"])
    model.source, model.is_standin = "stand-in", True
    return model
