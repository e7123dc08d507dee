"""qwen_mini against transformers on tiny random checkpoints that transformers wrote itself.

Each case is one tiny config, saved once per module with `save_pretrained` and loaded by both
libraries from that folder in float32, so any difference comes from the forward pass (or from
how qwen_mini reads the files), never from the weights.

The weights come from tests/helpers.py: std 0.2 instead of transformers' 0.02. With small weights
a tiny model's logits are nearly flat (std ~0.15) and its greedy output collapses into repeating
one token; with larger ones the logits spread out (std ~1.6), the best token leads the runner-up
by a margin far above float32 round-off (asserted in the generation test), and the output varies.
So a greedy mismatch means a real difference, not an argmax tie broken the other way.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from helpers import write_checkpoint
from transformers import AutoModelForCausalLM

import qwen_mini
from qwen_mini.generation import generate_tokens
from qwen_mini.runtime import linear_all_threads

TOL = 1e-4  # max abs logit difference, float32 both sides
VOCAB = 256

# hidden size 64, 2 layers, vocab 256. head_dim None means hidden / heads (as Qwen2 always has).
# name: (model_type, query heads, KV heads, head_dim, tied head, attention_bias, max_shard_size)
CASES = {
    # head_dim 24 != 64 / 4; two query heads per KV head
    "qwen3-gqa2-tied-single": ("qwen3", 4, 2, 24, True, False, None),
    # MHA (ratio 1), spread over several shards
    "qwen3-mha-untied-sharded": ("qwen3", 4, 4, 16, False, False, "40KB"),
    # ratio 4; in Qwen3 attention_bias adds q/k/v and o biases
    "qwen3-gqa4-bias-untied-single": ("qwen3", 8, 2, 8, False, True, None),
    # MQA: one KV head serves every query head
    "qwen3-mqa-tied-sharded": ("qwen3", 4, 1, 32, True, False, "40KB"),
    "qwen2-gqa2-tied-single": ("qwen2", 4, 2, None, True, None, None),
    "qwen2-mqa-untied-sharded": ("qwen2", 4, 1, None, False, None, "40KB"),
    "qwen2-mha-tied-single": ("qwen2", 4, 4, None, True, None, None),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(qwen_mini model, transformers model), both loaded from one saved checkpoint."""
    model_type, heads, kv_heads, head_dim, tied, bias, shard = CASES[request.param]
    qwen3 = {"head_dim": head_dim, "attention_bias": bias} if model_type == "qwen3" else {}
    folder = tmp_path_factory.mktemp(request.param)
    write_checkpoint(
        folder,
        model_type,
        tied=tied,
        max_shard_size=shard,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        eos_token_id=None,  # nothing stops generation early
        **qwen3,
    )
    # the fixture must really be what its name says
    assert (folder / "model.safetensors.index.json").exists() == bool(shard)
    if shard:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1

    ours = qwen_mini.load_model(folder, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert ours.config.tie_word_embeddings == ref.config.tie_word_embeddings == tied
    yield ours, ref
    del ours, ref
    gc.collect()


def prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@torch.inference_mode()
def test_logits_match(pair):
    ours, ref = pair
    ids = prompt(2, 11)  # batch of 2, different rows
    assert max_diff(ours(ids), ref(ids).logits) <= TOL


@torch.inference_mode()
def test_last_only_is_last_position(pair):
    ours, _ = pair
    ids = prompt(2, 7)
    assert max_diff(ours(ids, last_only=True), ours(ids)[:, -1:]) <= TOL


@torch.inference_mode()
def test_cached_decode_matches_full_forward(pair):
    """Prefill 6, then 4 single tokens, then a 5-token continuation == one full forward."""
    ours, ref = pair
    ids = prompt(2, 15, seed=2)
    expected = ref(ids).logits
    cache = ours.new_cache(batch_size=2)
    pieces = [ids[:, :6]] + [ids[:, i : i + 1] for i in range(6, 10)] + [ids[:, 10:]]
    got = torch.cat([ours(p, cache=cache) for p in pieces], dim=1)
    assert cache.length == 15
    assert max_diff(got, expected) <= TOL


@torch.inference_mode()
def test_greedy_generation_is_token_identical(pair):
    ours, ref = pair
    ids = prompt(1, 8, seed=3)
    # an explicit mask: without one, generate() masks every prompt token equal to pad_token_id
    out = ref.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=32,
        min_new_tokens=32,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    expected = out.sequences[0, 8:].tolist()
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    # while the tokens agree both sides see the same inputs, so their logits differ by <= TOL
    # (test_cached_decode...): a lead over 2 * TOL cannot flip; ask for 10x that
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin > 10 * TOL, f"argmax nearly tied (margin {margin:.2e}): the test is fragile"
    assert len(set(expected)) >= 4, "the reference output is a loop: the test shows little"

    got = list(
        generate_tokens(ours, ids[0].tolist(), max_new_tokens=32, temperature=0, eos_token_ids=[])
    )
    assert got == expected


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_linear_all_threads_is_f_linear(threads):
    """The threaded product of every projection (qwen_mini/model.py) against F.linear."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        w, b = torch.randn(12, 16, generator=g), torch.randn(12, generator=g)  # 3 splits 12
        for x in (torch.randn(1, 1, 16, generator=g), torch.randn(2, 5, 16, generator=g)):
            for bias in (None, b):
                expected = torch.nn.functional.linear(x, w, bias)
                got = linear_all_threads(x, w, bias)
                assert max_diff(got, expected) <= 1e-5  # summation order
            got = linear_all_threads(x.bfloat16(), w.bfloat16()).float()
            assert max_diff(got, torch.nn.functional.linear(x, w)) < 0.1
    finally:
        torch.set_num_threads(saved)
