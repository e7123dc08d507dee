"""Qwen3.5 as a whole model: the hybrid cache (KV + conv + recurrent states) against
transformers on tiny checkpoints transformers wrote, and the exact real Qwen3.5-0.8B shape.

The test that matters for a recurrent model is "the prompt in pieces": each piece continues from
the states the previous pieces left, so any piece that restarts from a zero state (the bug
several public implementations had) or forgets the conv inputs changes the logits.
"""

from __future__ import annotations

import gc
import json
import shutil

import pytest
import torch
from helpers import HF_CLASSES, write_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_modeling

import qwen_mini
from qwen_mini.config import ASSETS
from qwen_mini.deltanet import DeltaNetState

TOL = 1e-4  # max abs logit difference, float32 both sides
VOCAB = 256
CONFIGS = ASSETS / "configs"


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_text"])
def pair(request, tmp_path_factory):
    """(qwen_mini model, transformers model) from one tiny checkpoint of each class."""
    model_type = request.param
    folder = tmp_path_factory.mktemp(model_type)
    write_checkpoint(
        folder,
        model_type,
        tied=True,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=300,
        eos_token_id=None,
    )
    ours = qwen_mini.load_model(folder, dtype=torch.float32).eval()
    ref = HF_CLASSES[model_type][1].from_pretrained(folder, dtype=torch.float32).eval()
    yield ours, ref
    del ours, ref
    gc.collect()


def reference_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits for the whole prompt, its Gated DeltaNet run token by token.

    transformers' chunk form takes differences of float32 cumulative log-decays, which lose
    ~1e-4 of the logits over a hundred tokens of these random weights (2.5e-4 from a float64
    run, measured; ours 4.6e-5: it sums in float64, tests/test_deltanet.py). Its recurrent form
    has no such sums, so it is the sharper oracle for long prompts.
    """

    def recurrent(q, k, v, g, beta, chunk_size=64, **kwargs):
        return hf_modeling.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_modeling, "torch_chunk_gated_delta_rule", recurrent)
        return ref(ids).logits


def prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


PIECES = {
    "3+2+1": [3, 2, 1],
    "2+3+1": [2, 3, 1],
    "one at a time": [1] * 10,
    "longer than a chunk": [70, 5, 1],
    "crossing chunk boundaries": [60, 10, 1, 57, 2],  # ends at 130: chunks of 64 crossed twice
    "decode then a long piece": [1, 1, 100],
}


@pytest.mark.parametrize("pieces", list(PIECES))
@torch.inference_mode()
def test_prompt_in_pieces_equals_the_whole_prompt(pair, pieces):
    ours, ref = pair
    sizes = PIECES[pieces]
    ids = prompt(2, sum(sizes))
    expected = reference_logits(ref, ids)  # transformers, the whole prompt at once
    cache = ours.new_cache(batch_size=2)
    got, start = [], 0
    for n in sizes:
        got.append(ours(ids[:, start : start + n], cache=cache))
        start += n
    assert cache.length == sum(sizes)
    assert max_diff(torch.cat(got, dim=1), expected) <= TOL


@torch.inference_mode()
def test_the_cache_holds_one_state_per_layer_of_the_right_kind(pair):
    ours, _ = pair
    cache = ours.new_cache(batch_size=1)
    kinds = [type(s).__name__ for s in cache.layers]
    assert kinds == ["DeltaNetState"] * 3 + ["KVCache"]  # 3 Gated DeltaNet : 1 attention
    before = cache.nbytes()
    ours(prompt(1, 50), cache=cache)
    delta_net = sum(s.nbytes() for s in cache.layers if isinstance(s, DeltaNetState))
    assert delta_net == before  # fixed size: 50 tokens later, not a byte more
    assert cache.nbytes() > before  # only the attention layer's KV grew


@torch.inference_mode()
def test_context_overflow_raises_and_leaves_every_state_unchanged(pair):
    ours, ref = pair
    ids = prompt(1, 300)
    cache = ours.new_cache(batch_size=1)
    ours(ids[:, :290], cache=cache)
    saved = [(s.conv.clone(), s.recurrent.clone()) for s in cache.layers[:3]]
    with pytest.raises(ValueError, match="exceed this model's context of 300 positions"):
        ours(prompt(1, 11, seed=9), cache=cache)
    assert cache.length == 290 and cache.layers[3].length == 290
    for s, (conv, recurrent) in zip(cache.layers[:3], saved, strict=True):
        assert torch.equal(s.conv, conv) and torch.equal(s.recurrent, recurrent)
    # and the cache still continues the 290 tokens correctly
    got = ours(ids[:, 290:], cache=cache)
    assert max_diff(got, reference_logits(ref, ids)[:, 290:]) <= TOL


@torch.inference_mode()
def test_a_pass_failing_in_a_later_layer_leaves_deltanet_states_unchanged(pair, monkeypatch):
    ours, ref = pair
    ids = prompt(1, 12)
    cache = ours.new_cache(batch_size=1)
    ours(ids[:, :8], cache=cache)
    saved = [(s.conv.clone(), s.recurrent.clone()) for s in cache.layers[:3]]

    def broken(*args, **kwargs):
        raise RuntimeError("interrupted")

    # the DeltaNet layers 0-2 run and stage their states, then the attention layer fails
    monkeypatch.setattr(ours.model.layers[3].self_attn, "forward", broken)
    with pytest.raises(RuntimeError, match="interrupted"):
        ours(ids[:, 8:], cache=cache)
    monkeypatch.undo()
    for s, (conv, recurrent) in zip(cache.layers[:3], saved, strict=True):
        assert torch.equal(s.conv, conv) and torch.equal(s.recurrent, recurrent)
    assert max_diff(ours(ids[:, 8:], cache=cache), ref(ids).logits[:, 8:]) <= TOL


def test_a_recurrent_cache_cannot_rewind(pair):
    ours, _ = pair
    cache = ours.new_cache(batch_size=1)
    with torch.inference_mode():
        ours(prompt(1, 6), cache=cache)
    with pytest.raises(ValueError, match="recurrent state"):
        cache.truncate(3)
    assert cache.length == 6
    cache.truncate(6)  # keeping every token is allowed


def test_multi_token_prediction_tensors_are_ignored(tmp_path):
    """The released checkpoint also stores an MTP head under mtp.; a text model ignores it."""
    write_checkpoint(tmp_path, "qwen3_5", tied=True, vocab_size=VOCAB, hidden_size=64)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = qwen_mini.load_model(tmp_path, dtype=torch.float32)
    assert not any(k.startswith("mtp") for k in model.state_dict())


# --- the exact real shape ------------------------------------------------------------------


@pytest.mark.slow
def test_real_qwen3_5_shape_in_bfloat16(tmp_path):
    """Qwen3.5-0.8B's real config, random weights saved by transformers in bfloat16; the verbatim
    config.json put back. Parameter counts from transformers' own model; float32 logits equal;
    the prompt in pieces equals the whole."""
    src = CONFIGS / "qwen3.5-0.8b"
    torch.manual_seed(0)
    hf_cfg = AutoConfig.from_pretrained(src)
    model = Qwen3_5ForConditionalGeneration(hf_cfg).to(torch.bfloat16).eval()
    params = {id(p): p.numel() for p in model.parameters()}  # a tied head counted once
    assert sum(params.values()) == 852_985_920
    text = {id(p): p.numel() for p in model.model.language_model.parameters()}
    text.update({id(p): p.numel() for p in model.lm_head.parameters()})
    assert sum(text.values()) == 752_393_024  # the head is the embedding: counted once
    model.save_pretrained(tmp_path, max_shard_size="10GB")
    del model
    gc.collect()
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_slice(k) for k in f.keys()}
        assert {s.get_dtype() for s in stored.values()} == {"BF16"}
        assert sum(torch.Size(s.get_shape()).numel() for s in stored.values()) == 852_985_920
        assert tuple(
            stored["model.language_model.layers.0.linear_attn.conv1d.weight"].get_shape()
        ) == (
            6144,
            1,
            4,
        )
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["text_config"]["layer_types"].count("full_attention") == 6

    ids = torch.randint(0, 248_044, (1, 12), generator=torch.Generator().manual_seed(1))
    ref = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = ref(ids).logits
    del ref
    gc.collect()

    ours = qwen_mini.load_model(tmp_path, dtype=torch.float32)
    unique = {id(p): p.numel() for p in ours.parameters()}
    assert sum(unique.values()) == 752_393_024  # the text model only, tied head once
    with torch.inference_mode():
        assert max_diff(ours(ids), expected) <= TOL
        cache = ours.new_cache(batch_size=1)
        pieces = [ours(ids[:, a:b], cache=cache) for a, b in [(0, 5), (5, 6), (6, 12)]]
        assert max_diff(torch.cat(pieces, dim=1), expected) <= TOL


# --- the stand-in for load_model("Qwen/Qwen3.5-0.8B") without the weights --------------------


def test_standin_has_the_real_qwen3_5_design_and_matches_transformers(tmp_path):
    from transformers import Qwen3_5ForCausalLM

    from qwen_mini.config import Config
    from qwen_mini.standin import STANDINS, load_standin

    name = "Qwen/Qwen3.5-0.8B"
    model = load_standin(name, torch.float32)
    ours, real = model.config, Config.from_file(CONFIGS / "qwen3.5-0.8b" / "config.json")
    for field in ("model_type", "vocab_size", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "partial_rotary_factor", "attn_output_gate",
                  "linear_conv_kernel_dim", "eos_token_ids", "dtype"):  # fmt: skip
        assert getattr(ours, field) == getattr(real, field), field
    assert ours.layer_types == real.layer_types[: ours.num_hidden_layers]  # 3 : 1
    assert ours.linear_num_value_heads == ours.linear_num_key_heads  # as 16 and 16
    assert model.generation_config == {}  # the official repository has none
    ids = torch.tensor([[248045, 846, 198, 9707, 248046, 248044]])
    with torch.inference_mode():
        logits = model(ids)
        assert torch.equal(logits, load_standin(name, torch.float32)(ids))  # deterministic
        cache = model.new_cache(1)
        pieces = torch.cat([model(ids[:, :4], cache=cache), model(ids[:, 4:], cache=cache)], 1)
        assert max_diff(pieces, logits) <= TOL
    assert logits.std() > 0.1
    # a valid text-only checkpoint of the architecture: transformers computes the same logits
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = {**STANDINS[name]["config"], "model_type": "qwen3_5_text"}
    config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": config.pop("rope_theta"),
        "partial_rotary_factor": config.pop("partial_rotary_factor"),
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    ref = Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        assert max_diff(logits, ref(ids).logits) <= TOL
