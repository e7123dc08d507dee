"""The model's context limit and its cache after a failed call: a failure changes nothing."""

import pytest
import torch
from helpers import tiny_config, tiny_model

from qwen_mini import CausalLM
from qwen_mini.architectures import ARCHITECTURES, config_from_dict

# 16 positions: the context limit is part of what these tests check
CFG = tiny_config(vocab_size=97, max_position_embeddings=16, tie_word_embeddings=True)


@pytest.fixture
def model():
    return tiny_model(**CFG, std=0.3)


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
    with pytest.raises(ValueError, match="'llama'.*qwen2, qwen3"):
        config_from_dict(dict(CFG, model_type="llama"))


class StagedState:
    """A layer state updated in place, as a recurrent one is: each pass adds its tokens to a
    running sum. Staged until commit, so a failed pass must leave the committed sum alone."""

    can_rewind = False

    def __init__(self):
        self.length, self.total, self.staged = 0, torch.zeros(()), None

    def update(self, x):
        self.staged = self.total + x.sum()  # never touches self.total before commit
        return self.staged

    def commit(self, n_tokens):
        self.total, self.staged, self.length = self.staged, None, self.length + n_tokens

    def discard(self):
        self.staged = None

    def truncate(self, n):
        assert n == self.length

    def nbytes(self):
        return self.total.element_size()


class SummingMixer(torch.nn.Module):
    """A mixer that reads and writes a StagedState: adds the running sum to every position."""

    def __init__(self, cfg, layer_idx, arch):
        super().__init__()

    def forward(self, x, cos, sin, cache=None):
        total = cache.update(x) if cache is not None else x.sum()
        return torch.zeros_like(x) + 1e-3 * total

    def new_state(self, batch_size, dtype, device):
        return StagedState()


@torch.no_grad()
def test_a_failed_pass_leaves_in_place_states_as_they_were(model, monkeypatch):
    """The cache protocol for states updated in place: stage, then commit or discard."""
    arch = ARCHITECTURES["qwen3"].with_blocks(mixers={"linear_attention": SummingMixer})
    layer_types = ["linear_attention", "full_attention"]
    cfg = config_from_dict(dict(CFG, layer_types=layer_types), arch=arch)
    hybrid = CausalLM(cfg, arch=arch).eval()
    assert type(hybrid.model.layers[0].linear_attn) is SummingMixer
    cache = hybrid.new_cache()
    hybrid(IDS[:, :5], cache)
    committed = cache.layers[0].total.clone()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        hybrid(IDS, cache)  # overflow: refused before any layer runs
    monkeypatch.setattr(hybrid.model.layers[1], "forward", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        hybrid(IDS[:, 5:8], cache)  # layer 0 staged a new sum, then layer 1 failed
    assert cache.length == 5 and cache.layers[0].length == 5
    assert cache.layers[0].staged is None and torch.equal(cache.layers[0].total, committed)
    with pytest.raises(ValueError, match="recurrent state"):
        cache.truncate(3)  # a state that cannot rewind: refused, nothing changed
    assert cache.length == 5 and cache.layers[1].length == 5


@torch.no_grad()
def test_truncate_reuses_a_prefix(model):
    whole = model(IDS[:, :12])
    cache = model.new_cache()
    model(IDS[:, :9], cache)
    cache.truncate(6)  # forget the last 3 tokens, keep the first 6
    assert cache.length == 6 and all(s.length == 6 for s in cache.layers)
    rest = model(IDS[:, 6:12], cache)
    assert (rest - whole[:, 6:]).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(13)


def test_layer_types_must_name_known_mixers():
    with pytest.raises(ValueError, match="layer_types.*full_attention"):
        config_from_dict(dict(CFG, layer_types=["full_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="one mixer per layer"):
        config_from_dict(dict(CFG, layer_types=["full_attention"]))
