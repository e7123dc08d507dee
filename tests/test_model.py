"""The model's context limit and its cache after a failed call: a failure changes nothing."""

import pytest
import torch

from qwen_mini import CausalLM, Config

CFG = dict(
    model_type="qwen3",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=16,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = CausalLM(Config.from_dict(CFG)).eval()
    for p in m.parameters():  # default init leaves norms at one and logits tiny: spread them
        torch.nn.init.normal_(p, std=0.3)
    return m


IDS = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_overflow_raises_and_leaves_the_cache_as_it_was(model):
    whole = model(IDS)  # all 16 positions fit exactly
    cache = model.new_cache()
    model(IDS[:, :10], cache)
    with pytest.raises(ValueError, match=r"17 tokens \(10 cached \+ 7 new\).*16 positions"):
        model(IDS[:, :7], cache)
    assert cache.length == 10
    rest = model(IDS[:, 10:], cache)  # the cache still describes exactly the first 10 tokens
    assert (rest - whole[:, 10:]).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(IDS[:, :1], cache)


@torch.no_grad()
def test_a_pass_that_fails_midway_leaves_the_cache_as_it_was(model, monkeypatch):
    whole = model(IDS[:, :12])
    cache = model.new_cache()
    model(IDS[:, :8], cache)
    last = model.model.layers[-1]

    def broken(*args, **kwargs):  # the first layer has already written its keys and values
        raise RuntimeError("boom")

    monkeypatch.setattr(last, "forward", broken)
    with pytest.raises(RuntimeError, match="boom"):
        model(IDS[:, 8:10], cache)
    monkeypatch.undo()
    assert cache.length == 8
    rest = model(IDS[:, 8:12], cache)
    assert (rest - whole[:, 8:]).abs().max().item() <= 1e-5


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ValueError, match="'qwen3_next'.*qwen2, qwen3"):
        Config.from_dict(dict(CFG, model_type="qwen3_next"))
