"""compile=True: the preallocated cache and the compiled fixed-shape step give the eager
tokens. torch.compile on the CPU compiles C++ for each model: a minute or more each."""

import helpers
import pytest
import torch

from qwen_mini.generation import generate_tokens

PROMPT = [1, 5, 9, 3, 7, 2, 11]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, dtype, mode",
    [
        ("qwen2", torch.float32, True),  # dense, QKV bias
        ("qwen3", torch.float32, True),  # dense, QK-Norm
        ("qwen3_5_text", torch.float32, True),  # hybrid
        ("qwen3_moe", torch.bfloat16, True),  # MoE, in the dtype checkpoints ship in
        ("qwen3_next", torch.float32, True),  # hybrid MoE, gated attention
        ("qwen3", torch.float32, "max-autotune"),
        ("qwen3_5_text", torch.bfloat16, "max-autotune"),
    ],
)
def test_compiled_greedy_equals_eager_greedy(model_type, dtype, mode):
    model = helpers.tiny_model(model_type, seed=0, std=0.5).to(dtype)
    kw = dict(max_new_tokens=12, temperature=0, eos_token_ids=[])
    eager = list(generate_tokens(model, PROMPT, **kw))
    assert list(generate_tokens(model, PROMPT, compile=mode, **kw)) == eager
    assert list(generate_tokens(model, PROMPT[:3], compile=mode, **kw)) == list(
        generate_tokens(model, PROMPT[:3], **kw)
    )  # again, a new prompt: the compiled step is reused, its buffers reloaded


@pytest.mark.slow
def test_a_frozen_step_follows_weights_changed_after_it_was_compiled():
    # bfloat16: "max-autotune" repacks these weights into copies, which would go stale
    model = helpers.tiny_model("qwen3", seed=0, std=0.5).to(torch.bfloat16)
    kw = dict(max_new_tokens=6, temperature=0, eos_token_ids=[], compile="max-autotune")
    before = list(generate_tokens(model, PROMPT, **kw))
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)  # in place: the least likely token wins now
    after = list(generate_tokens(model, PROMPT, **kw))
    assert after[0] != before[0]
    assert after == list(generate_tokens(model, PROMPT, **{**kw, "compile": False}))


@pytest.mark.slow
def test_every_model_compiles_its_own_step(monkeypatch):
    # torch.compile keeps compiled code per code object, and past torch._dynamo's recompile_limit
    # of variants of one it runs the code eagerly without a word: with one forward shared by
    # every decoder, the ninth model compiled in a process (here the third: the limit set to 2)
    # would decode eagerly, and its tokens would still equal the eager ones
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    kw = dict(max_new_tokens=3, temperature=0, eos_token_ids=[], compile=True)
    for hidden in (16, 24, 32):
        model = helpers.tiny_model("qwen3", num_hidden_layers=1, hidden_size=hidden)
        graphs = counters["stats"]["unique_graphs"]
        list(generate_tokens(model, PROMPT, **kw))
        assert counters["stats"]["unique_graphs"] == graphs + 1, f"hidden_size {hidden}"


def test_compile_refuses_what_it_cannot_run():
    model = helpers.tiny_model("qwen4_exp_text")
    with pytest.raises(ValueError, match="no fixed-shape decode step"):
        generate_tokens(model, PROMPT, max_new_tokens=4, compile=True)
    with pytest.raises(ValueError, match='compile must be False, True or "max-autotune"'):
        generate_tokens(helpers.tiny_model("qwen3"), PROMPT, max_new_tokens=4, compile="fast")
    with pytest.raises(ValueError, match="compile must be"):
        generate_tokens(helpers.tiny_model("qwen3"), PROMPT, max_new_tokens=4, compile=1)
    with pytest.raises(ValueError, match="cannot be combined"):
        generate_tokens(
            helpers.tiny_model("qwen3"), PROMPT, max_new_tokens=4, compile=True, draft="mtp"
        )


def test_the_kept_compiled_step_is_not_part_of_the_model():
    from qwen_mini.static_decode import compiled_step

    model = helpers.tiny_model("qwen3")
    before = list(model.state_dict())
    compiled_step(model, 16)  # builds and keeps it; compiles lazily, at the first step
    assert list(model.state_dict()) == before
    assert all(not name.startswith("_static") for name, _ in model.named_modules())
