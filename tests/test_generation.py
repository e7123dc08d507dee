"""Generation: the cached decoding loop, the sampling filters, stopping, streaming, overflow."""

import math
from dataclasses import replace

import helpers
import pytest
import torch
from helpers import tiny_config
from torch import nn

from qwen_mini import CausalLM
from qwen_mini.architectures import config_from_dict
from qwen_mini.generation import generate, generate_tokens, next_token, stream_text
from qwen_mini.sampling import (
    Sampling,
    apply_presence_penalty,
    apply_temperature,
    filter_logits,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)

TINY = tiny_config(
    vocab_size=97, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True, eos_token_id=96
)


def tiny_model(model_type="qwen3", seed=0):
    # larger weights than the default init: sharper, less tied logits
    return helpers.tiny_model(**{**TINY, "model_type": model_type}, seed=seed, std=0.5)


class FakeCache:
    def __init__(self):
        self.ids = []

    @property
    def length(self):
        return len(self.ids)


class FakeLM(nn.Module):
    """A stand-in model whose next-token logits are `logits_for(history)`; counts its calls."""

    def __init__(self, logits_for, vocab_size=97, max_positions=64, eos=(96,)):
        super().__init__()
        self.config = config_from_dict(
            {
                **TINY,
                "vocab_size": vocab_size,
                "max_position_embeddings": max_positions,
                "eos_token_id": list(eos),
            }
        )
        self.dummy = nn.Parameter(torch.zeros(1))
        self.logits_for = logits_for
        self.calls = 0

    def new_cache(self, batch_size=1):
        return FakeCache()

    def forward(self, input_ids, cache=None, last_only=False):
        assert cache is not None and last_only, "generation must use the cache and last_only"
        self.calls += 1
        cache.ids += input_ids[0].tolist()
        row = torch.as_tensor(self.logits_for(cache.ids), dtype=torch.float32)
        return row.view(1, 1, -1)


def scripted(tokens, vocab_size=97, eos=96):
    """A FakeLM that, after the prompt, says `tokens` then eos (greedy: one-hot logits)."""
    state = {"start": None}

    def logits_for(history):
        if state["start"] is None:
            state["start"] = len(history)
        i = len(history) - state["start"]
        target = tokens[i] if i < len(tokens) else eos
        row = torch.zeros(vocab_size)
        row[target] = 10.0
        return row

    return FakeLM(logits_for, vocab_size=vocab_size, max_positions=4096, eos=(eos,))


# --- the decoding loop -----------------------------------------------------------------------


def naive_greedy(model, prompt, n):
    """The reference: recompute the whole sequence every step, no cache at all."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_greedy_with_cache_equals_naive_loop(model_type):
    model = tiny_model(model_type)
    prompt = [5, 17, 42, 3, 88, 11]
    got = list(generate_tokens(model, prompt, max_new_tokens=20, temperature=0, eos_token_ids=[]))
    want = naive_greedy(model, prompt, 20)
    assert got == want
    assert len(set(got)) > 1  # a degenerate constant output would prove little


def test_top_k_1_sampling_equals_greedy():
    model = tiny_model()
    prompt = [1, 2, 3]
    greedy = list(
        generate_tokens(model, prompt, max_new_tokens=15, temperature=0, eos_token_ids=[])
    )
    sampled = list(
        generate_tokens(
            model, prompt, max_new_tokens=15, temperature=1.3, top_k=1, seed=7, eos_token_ids=[]
        )
    )
    assert sampled == greedy


def test_same_seed_same_tokens_different_seed_differs():
    model = tiny_model()
    kw = dict(max_new_tokens=24, temperature=1.0, eos_token_ids=[])
    a = list(generate_tokens(model, [4, 5], seed=123, **kw))
    b = list(generate_tokens(model, [4, 5], seed=123, **kw))
    c = list(generate_tokens(model, [4, 5], seed=124, **kw))
    assert a == b
    assert a != c


def test_no_seed_follows_torch_manual_seed():
    model = tiny_model()
    kw = dict(max_new_tokens=12, temperature=1.0, eos_token_ids=[])
    torch.manual_seed(5)
    a = list(generate_tokens(model, [4, 5], **kw))
    torch.manual_seed(5)
    b = list(generate_tokens(model, [4, 5], **kw))
    assert a == b


def test_inference_mode_does_not_leak_to_the_caller():
    model = tiny_model()
    for _ in generate_tokens(model, [1, 2], max_new_tokens=3, temperature=0):
        assert not torch.is_inference_mode_enabled()


# --- the filters on hand-made logits ---------------------------------------------------------

PROBS = [0.5, 0.3, 0.15, 0.05]


def kept(logits):
    return sorted(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def test_temperature_divides_the_logits():
    out = apply_temperature(torch.tensor([2.0, 1.0, 0.0]), 0.5)
    assert out.tolist() == [4.0, 2.0, 0.0]


def test_top_k_keeps_the_k_largest_and_ties():
    assert kept(top_k_filter(torch.tensor([1.0, 3.0, 2.0, 4.0, 0.0]), 2)) == [1, 3]
    # a tie with the k-th value is kept, as transformers does
    assert kept(top_k_filter(torch.tensor([5.0, 1.0, 3.0, 3.0]), 2)) == [0, 2, 3]
    assert kept(top_k_filter(torch.tensor([1.0, 2.0]), 10)) == [0, 1]  # k > vocab: all
    out = top_k_filter(torch.tensor([1.0, 3.0, 2.0]), 2)
    assert out[1] == 3.0 and out[2] == 2.0  # kept logits are unchanged


@pytest.mark.parametrize(
    "p, want",
    [
        (0.3, [0]),
        (0.5, [0]),
        (0.6, [0, 1]),
        (0.79, [0, 1]),
        (0.81, [0, 1, 2]),
        (0.96, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, want):
    # the tokens in a shuffled order, so the filter must sort
    perm = [2, 0, 3, 1]  # position i holds token perm[i]
    logits = torch.tensor([math.log(PROBS[t]) for t in perm])
    assert sorted(perm[i] for i in kept(top_p_filter(logits, p))) == want


@pytest.mark.parametrize(
    "min_p, want", [(0.5, [0, 1]), (0.2, [0, 1, 2]), (0.05, [0, 1, 2, 3]), (1.0, [0])]
)
def test_min_p_is_relative_to_the_best_token(min_p, want):
    logits = torch.log(torch.tensor(PROBS))
    assert kept(min_p_filter(logits, min_p)) == want


def test_min_p_sees_the_temperature():
    # ratios to the best token 1, 0.6, 0.3, 0.1; temperature 2 takes their square roots:
    # 1, 0.77, 0.55, 0.32, so min_p 0.35 then keeps token 2 as well
    logits = torch.log(torch.tensor(PROBS))
    assert kept(filter_logits(logits, temperature=1.0, min_p=0.35)) == [0, 1]
    assert kept(filter_logits(logits, temperature=2.0, min_p=0.35)) == [0, 1, 2]


def test_presence_penalty_once_per_distinct_token():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    seen = torch.tensor([False, True, False, True])
    assert apply_presence_penalty(logits, seen, 1.5).tolist() == [1.0, 0.5, 3.0, 2.5]


def test_presence_penalty_in_the_loop():
    # token 3 leads token 5 by 1.0; a penalty of 2 pushes 3 below 5 once 3 was generated, then
    # both are penalised once and 3 leads again. A frequency penalty would alternate instead.
    def logits_for(history):
        row = torch.zeros(97)
        row[3], row[5] = 5.0, 4.0
        return row

    model = FakeLM(logits_for)
    kw = dict(max_new_tokens=6, temperature=0, eos_token_ids=[])
    assert list(generate_tokens(model, [3, 3], presence_penalty=2.0, **kw)) == [3, 5, 3, 3, 3, 3]
    assert list(generate_tokens(model, [3, 3], presence_penalty=0.0, **kw)) == [3] * 6


def test_sampling_respects_the_filters_and_the_probabilities():
    logits = torch.log(torch.tensor(PROBS))
    s = Sampling(temperature=1.0, top_p=0.79)
    gen = torch.Generator().manual_seed(0)
    seen = torch.zeros(4, dtype=torch.bool)
    draws = [next_token(logits, seen, s, gen) for _ in range(2000)]
    assert set(draws) == {0, 1}
    assert abs(draws.count(0) / 2000 - 0.5 / 0.8) < 0.04  # renormalised over the kept tokens


def test_filters_match_transformers_warpers():
    tp = pytest.importorskip("transformers.generation.logits_process")
    torch.manual_seed(0)
    scores = torch.randn(8, 300) * 3
    ids = torch.zeros(8, 1, dtype=torch.long)
    cases = [
        (dict(temperature=0.7), [tp.TemperatureLogitsWarper(0.7)]),
        (dict(top_k=20), [tp.TopKLogitsWarper(20)]),
        (dict(top_p=0.9), [tp.TopPLogitsWarper(0.9)]),
        (dict(min_p=0.1), [tp.MinPLogitsWarper(0.1)]),
        (
            dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05),
            [
                tp.TemperatureLogitsWarper(0.6),
                tp.TopKLogitsWarper(20),
                tp.TopPLogitsWarper(0.95),
                tp.MinPLogitsWarper(0.05),
            ],
        ),
    ]
    for ours, theirs in cases:
        want = scores.clone()
        for warper in theirs:
            want = warper(ids, want)
        got = filter_logits(scores, **ours)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), ours
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite])


# --- settings ---------------------------------------------------------------------------------


def test_settings_come_from_generation_config_else_greedy():
    model = tiny_model()
    assert Sampling.for_model(model).temperature == 0.0  # no generation_config: greedy
    model.generation_config = {
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "eos_token_id": [151645, 151643],
    }
    s = Sampling.for_model(model)
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.6, 20, 0.95, None)
    s = Sampling.for_model(model, temperature=0.7, top_p=0.8)  # explicit values win
    assert (s.temperature, s.top_k, s.top_p) == (0.7, 20, 0.8)
    model.generation_config = {"do_sample": False, "temperature": 0.6}
    assert Sampling.for_model(model).temperature == 0.0
    with pytest.raises(ValueError, match="top_p"):
        Sampling.for_model(model, top_p=1.5)


# --- stopping ---------------------------------------------------------------------------------


def test_stops_at_the_eos_argument_and_yields_it_last():
    model = tiny_model()
    first = next(generate_tokens(model, [7, 8, 9], max_new_tokens=1, temperature=0))
    got = list(
        generate_tokens(model, [7, 8, 9], max_new_tokens=10, temperature=0, eos_token_ids=first)
    )
    assert got == [first]


def test_eos_from_generation_config_then_config():
    model = scripted([10, 11, 12, 13], eos=96)
    model.config = replace(model.config, eos_token_ids=(12,))
    assert list(generate_tokens(model, [1], max_new_tokens=10, temperature=0)) == [10, 11, 12]
    model = scripted([10, 11, 12, 13], eos=96)
    model.config = replace(model.config, eos_token_ids=(12,))
    model.generation_config = {"eos_token_id": 11}  # wins over config.json
    assert list(generate_tokens(model, [1], max_new_tokens=10, temperature=0)) == [10, 11]


def test_stops_when_the_model_favours_eos():
    model = scripted([], eos=96)
    assert list(generate_tokens(model, [1, 2], max_new_tokens=10, temperature=0)) == [96]
    assert model.calls == 1


# --- text and streaming -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    tok_mod = pytest.importorskip("qwen_mini.tokenizer")
    return tok_mod.load_tokenizer("Qwen/Qwen3-0.6B")


TEXT = "Grüße 👋🏽 from 世界! ∑ é"


def test_stream_concatenates_to_the_text_and_never_splits_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    # the test only means something if some character spans several tokens
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    model = scripted(ids, vocab_size=151936, eos=tokenizer.im_end_id)
    text = generate(model, tokenizer, "Hi", max_new_tokens=100, temperature=0)
    assert text == TEXT  # the end token is not part of the text
    model = scripted(ids, vocab_size=151936, eos=tokenizer.im_end_id)
    pieces = list(generate(model, tokenizer, "Hi", max_new_tokens=100, temperature=0, stream=True))
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)
    assert " 👋" in pieces and " ∑" in pieces  # each whole once its last byte arrived


def test_stream_flushes_an_unfinished_character_at_the_end(tokenizer):
    ids = tokenizer.encode("a🦜")  # the parrot is two byte-level tokens
    partial = ids[:-1]  # stop inside its bytes
    assert tokenizer.decode(partial).endswith("\ufffd")
    assert "".join(stream_text(tokenizer, partial)) == tokenizer.decode(partial)


def test_generate_accepts_ids_and_streams_random_model_text(tokenizer):
    torch.manual_seed(0)
    cfg = {
        **TINY,
        "vocab_size": 151936,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
    }
    model = CausalLM(config_from_dict(cfg)).eval()
    kw = dict(max_new_tokens=40, temperature=1.0, seed=3, eos_token_ids=[])
    text = generate(model, tokenizer, [9707, 11], **kw)
    streamed = "".join(generate(model, tokenizer, [9707, 11], stream=True, **kw))
    assert streamed == text and len(text) > 0


# --- context overflow -------------------------------------------------------------------------


def test_overflow_is_refused_before_any_work():
    model = scripted([1, 2, 3])
    model.config = replace(model.config, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"60 tokens.*64 positions.*at most 4"):
        generate_tokens(model, list(range(60)), max_new_tokens=10)  # raises at the call
    assert model.calls == 0
    with pytest.raises(ValueError, match="shorten the prompt"):
        list(generate_tokens(model, list(range(70)), max_new_tokens=1))
    # exactly filling the context is fine
    got = list(generate_tokens(model, list(range(60)), max_new_tokens=4, eos_token_ids=[]))
    assert len(got) == 4


def test_overflow_on_a_real_model():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, None, [1] * 50, max_new_tokens=20, stream=True)


def test_bad_prompts_are_explained():
    model = tiny_model()
    with pytest.raises(ValueError, match="empty"):
        list(generate_tokens(model, [], max_new_tokens=3))
    with pytest.raises(ValueError, match="vocabulary"):
        list(generate_tokens(model, [1, 500], max_new_tokens=3))
