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
from helpers import greedy_reference, loaded_pair, write_checkpoint

import qwen_mini
import qwen_mini.architectures
from qwen_mini.generation import generate_tokens
from qwen_mini.runtime import linear_all_threads

TOL = 1e-4  # max abs logit difference, float32 both sides
VOCAB = 256

# One named case per configuration worth telling apart; every architecture in the table has some
# (test_every_architecture_has_a_case), so a new row is tested by adding its cases here.
# Fields are config.json overrides on top of the shared size below; "shard" splits the file.
SIZE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
CASES = [
    # head_dim 24 != 64 / 4; two query heads per KV head
    pytest.param(dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=24, tied=True), id="qwen3-gqa2-tied-single"),
    # MHA (ratio 1), spread over several shards
    pytest.param(dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=4,
                      head_dim=16, tied=False, shard="40KB"), id="qwen3-mha-untied-sharded"),
    # ratio 4; in Qwen3 attention_bias adds q/k/v and o biases
    pytest.param(dict(model_type="qwen3", num_attention_heads=8, num_key_value_heads=2,
                      head_dim=8, tied=False, attention_bias=True), id="qwen3-gqa4-bias-untied"),
    # MQA: one KV head serves every query head
    pytest.param(dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=1,
                      head_dim=32, tied=True, shard="40KB"), id="qwen3-mqa-tied-sharded"),
    pytest.param(dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2,
                      tied=True), id="qwen2-gqa2-tied-single"),
    pytest.param(dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=1,
                      tied=False, shard="40KB"), id="qwen2-mqa-untied-sharded"),
    pytest.param(dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=4,
                      tied=True), id="qwen2-mha-tied-single"),
    # qwen3_moe: every layer sparse, 8 experts, top-2, renormalised
    pytest.param(dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, tied=False), id="qwen3_moe-e8k2-norm-untied"),
    # top-1 of 4 without renormalisation (weights are the full-softmax probabilities), sharded
    pytest.param(dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=1,
                      head_dim=16, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=24,
                      norm_topk_prob=False, tied=True, shard="40KB"),
                 id="qwen3_moe-e4k1-nonorm-tied-sharded"),
    # 4 layers, every 2nd sparse, layer 3 dense by mlp_only_layers: only layer 1 has experts
    pytest.param(dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[3],
                      norm_topk_prob=False, tied=False), id="qwen3_moe-e16k4-step2-mlponly"),
    # 3 layers, layer 0 dense; k = 3 of 5, renormalised
    pytest.param(dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=3, num_experts=5, num_experts_per_tok=3,
                      moe_intermediate_size=16, mlp_only_layers=[0], norm_topk_prob=True,
                      tied=True), id="qwen3_moe-e5k3-norm-layer0dense"),
    # Qwen3.5 (3 Gated DeltaNet : 1 gated attention), multimodal checkpoint: text under
    # model.language_model., a vision tower to ignore; two value heads per key head
    pytest.param(dict(model_type="qwen3_5", tied=True), id="qwen3_5-tied-single"),
    pytest.param(dict(model_type="qwen3_5", tied=False, shard="40KB"),
                 id="qwen3_5-untied-sharded"),
    # text-only checkpoint (Qwen3_5ForCausalLM); one value head per key head
    pytest.param(dict(model_type="qwen3_5_text", tied=True, linear_num_value_heads=2),
                 id="qwen3_5_text-hv1-tied"),
    pytest.param(dict(model_type="qwen3_5_text", tied=False), id="qwen3_5_text-untied"),
    # Qwen2-MoE: Qwen2 attention with q/k/v bias, 8 experts top-2 not renormalised (the type's
    # default) plus a shared expert of its own width, in every layer
    pytest.param(dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=2,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, tied=False),
                 id="qwen2_moe-e8k2-shared48-untied"),
    # top-1 of 4, renormalised (weight 1), MQA, no q/k/v bias, sharded
    pytest.param(dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=1,
                      num_experts=4, num_experts_per_tok=1, moe_intermediate_size=24,
                      shared_expert_intermediate_size=16, norm_topk_prob=True, qkv_bias=False,
                      tied=True, shard="40KB"), id="qwen2_moe-e4k1-norm-nobias-tied-sharded"),
    # 4 layers, every 2nd sparse, layer 3 dense by mlp_only_layers; MHA; k = 3 of 6
    pytest.param(dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=4,
                      num_hidden_layers=4, num_experts=6, num_experts_per_tok=3,
                      moe_intermediate_size=16, shared_expert_intermediate_size=64,
                      decoder_sparse_step=2, mlp_only_layers=[3], tied=False),
                 id="qwen2_moe-e6k3-step2-mlponly-mha"),
    # Qwen3-Next: 3 fused Gated DeltaNet : 1 gated attention, two value heads per key head,
    # 8 experts top-2 renormalised, shared expert; sharded
    pytest.param(dict(model_type="qwen3_next", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=32, tied=False,
                      shard="40KB"), id="qwen3_next-e8k2-hv2-untied-sharded"),
    # another layer pattern (full first and last), one value head per key head, RoPE on half
    # of each head, layer 0 dense, not renormalised, one KV head
    pytest.param(dict(model_type="qwen3_next", num_key_value_heads=1,
                      layer_types=["full_attention", "linear_attention", "linear_attention",
                                   "full_attention"],
                      linear_num_value_heads=2, mlp_only_layers=[0], norm_topk_prob=False,
                      num_experts=5, num_experts_per_tok=3, moe_intermediate_size=16,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5}, tied=True),
                 id="qwen3_next-pattern-hv1-rope0.5-layer0dense-tied"),
    # four value heads per key head (one key head), every 2nd layer sparse
    pytest.param(dict(model_type="qwen3_next", linear_num_key_heads=1, linear_num_value_heads=4,
                      decoder_sparse_step=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=8, tied=False),
                 id="qwen3_next-hv4-step2-untied"),
    # Qwen3.5-MoE, multimodal checkpoint (text under model.language_model., a vision tower)
    pytest.param(dict(model_type="qwen3_5_moe", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, tied=True),
                 id="qwen3_5_moe-e8k2-tied-single"),
    pytest.param(dict(model_type="qwen3_5_moe", num_experts=4, num_experts_per_tok=1,
                      moe_intermediate_size=16, tied=False, shard="40KB"),
                 id="qwen3_5_moe-e4k1-untied-sharded"),
    # text-only; one value head per key head, 3 of 6 experts, RoPE on half of each head
    # (M-RoPE sections of the 4 rotary frequencies), one KV head
    pytest.param(dict(model_type="qwen3_5_moe_text", linear_num_value_heads=2,
                      num_key_value_heads=1, num_experts=6, num_experts_per_tok=3,
                      moe_intermediate_size=16, shared_expert_intermediate_size=16,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                       "mrope_interleaved": True}, tied=True),
                 id="qwen3_5_moe_text-hv1-e6k3-rope0.5-tied"),
    pytest.param(dict(model_type="qwen3_5_moe_text", tied=False, shard="40KB"),
                 id="qwen3_5_moe_text-untied-sharded"),
]  # fmt: skip


def test_every_architecture_has_a_case():
    from test_oracle_qwen4 import CASES as QWEN4_CASES  # its own checks around the same tests

    covered = {case.values[0]["model_type"] for case in CASES + QWEN4_CASES}
    assert covered == set(qwen_mini.architectures.ARCHITECTURES)


@pytest.fixture(scope="module", params=[c.values[0] for c in CASES], ids=[c.id for c in CASES])
def pair(request, tmp_path_factory):
    """(qwen_mini model, transformers model), both loaded from one saved checkpoint."""
    case = dict(request.param)
    model_type, tied, shard = case.pop("model_type"), case.pop("tied"), case.pop("shard", None)
    folder = tmp_path_factory.mktemp(model_type)
    write_checkpoint(
        folder,
        model_type,
        tied=tied,
        max_shard_size=shard,
        eos_token_id=None,  # nothing stops generation early
        **SIZE,
        **case,
    )
    # the fixture must really be what its name says
    assert (folder / "model.safetensors.index.json").exists() == bool(shard)
    if shard:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1

    ours, ref = loaded_pair(folder, model_type, tied)
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
    # float32 rounding grows with the logits' size, and two orders of summation are compared
    # (ours in pieces against transformers' whole): 2 * TOL up to |logits| 4, scaled beyond. On
    # an Intel Xeon, qwen3_next-e8k2 (|logits| 6.1) differs by 1.55e-4 at one position, where
    # transformers' own cached pass differs from its full one by 1.04e-4 and ours whole from its
    # whole by 1.02e-4. Wrong caches are far away: there, the conv state zeroed between pieces
    # moves the logits by 8.9, the recurrent state scaled by 0.999 by 5e-2
    assert max_diff(got, expected) <= 2 * TOL * max(1.0, expected.abs().max().item() / 4)


@torch.inference_mode()
def test_greedy_generation_is_token_identical(pair):
    ours, ref = pair
    ids = prompt(1, 8, seed=3)
    # while the tokens agree both sides see the same inputs, so their logits differ by <= TOL
    # (test_cached_decode...): a lead over 2 * TOL cannot flip (greedy_reference asks for 10x)
    expected = greedy_reference(ref, ids, 32, TOL, min_new_tokens=32)[0, 8:].tolist()
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
