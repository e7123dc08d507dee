"""The variants of a case (qwen_mini/course/variants.py): each kind passes the package's own
piece, fails an answer that is right on the CPU in float32 but wrong where the models run, and
says which idea it misses. (Through the grader: tests/test_grade_wrong_answers.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qwen_mini import attention as ref
from qwen_mini import decoder as dec
from qwen_mini import decoding, moe
from qwen_mini.course import variants
from qwen_mini.course.checking import exercises, get, register, run_checks
from qwen_mini.course.variants import case
from qwen_mini.mlp import MLP


def attention_in_float32(q, k, v, mask=None):
    out = ref.attention(q.float(), k.float(), v.float(), mask)
    return out  # float32 whatever the input


def causal_mask_on_the_cpu(t_new, t_total, device=None):
    q_pos = torch.arange(t_total - t_new, t_total)[:, None]
    return torch.arange(t_total)[None, :] <= q_pos


def decode_as_a_list(model, prompt_ids, max_new_tokens, choose=decoding.greedy, stop=()):
    return list(decoding.decode(model, prompt_ids, max_new_tokens, choose, stop))


class LayerWithInPlaceResidual(dec.DecoderLayer):
    def forward(self, x, cos, sin, cache=None):
        h = x + self.mixer(self.input_layernorm(x), cos, sin, cache)
        h += self.mlp(self.post_attention_layernorm(h))  # h is saved for the backward pass
        return h


class MoeWithAPlainList(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, norm=True, fused=False):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = [MLP(hidden_size, intermediate_size) for _ in range(num_experts)]

    forward = moe.SparseMoeBlock.forward


def zero_centred_norm_adding_in_bfloat16():
    from qwen_mini.norms import RMSNorm

    class Norm(RMSNorm):
        def __init__(self, dim, eps=1e-6):
            super().__init__(dim, eps)
            nn.init.zeros_(self.weight)

        def forward(self, x):
            return self.normalize(x).to(x.dtype) * (1 + self.weight)  # 1 + w in bfloat16

    return Norm


@pytest.mark.parametrize(
    "exercise, wrong, says",
    [
        ("ch01.attention", attention_in_float32, "a bfloat16 input must give a bfloat16 output"),
        ("ch01.causal_mask", causal_mask_on_the_cpu, "not on its input's device"),
        ("ch01.decode", decode_as_a_list, "must yield each item as it makes it"),
        ("ch01.DecoderLayer", LayerWithInPlaceResidual, "the backward pass through your"),
        ("ch03.SparseMoeBlock", MoeWithAPlainList, "parameters are not all registered"),
        (
            "ch05.ZeroCentredRMSNorm",
            zero_centred_norm_adding_in_bfloat16(),
            "1 + w (like the whole norm) must be computed in float32",
        ),
    ],
)
def test_each_kind_fails_a_wrong_answer_with_its_idea(exercise, wrong, says):
    result = run_checks(exercise, wrong)
    assert result.status == "failed" and says in result.message, result.message
    assert run_checks(exercise, get(exercise).reference, hidden=True).ok


def test_every_chapter_declares_variants_and_its_references_pass_them():
    kinds = set()
    for chapter in ("ch00", "ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07"):
        declared = [e for e in exercises(chapter) if e.variant_labels]
        # chapters 4 and 7 take text, token ids and decisions: no dtype or device to vary
        assert declared or chapter in ("ch04", "ch07"), chapter
        for e in declared:
            kinds |= {label.rsplit(", ", 1)[-1] for label in e.variant_labels}
    labels = {variants.Variant(k).label for k in ("bfloat16", "meta")}
    assert labels <= kinds


def test_variants_run_after_the_plain_checks_and_registration_first():
    names = [name for name, _ in get("ch01.attention").public]
    plain = [n for n in names if n not in get("ch01.attention").variant_labels]
    assert names[: len(plain)] == plain and len(names) > len(plain)
    first = get("ch03.SparseMoeBlock").public[0][0]
    assert first.endswith("parameters registered")


def test_a_variant_is_data_checked_when_declared():
    with pytest.raises(ValueError, match="unknown variant"):
        variants.Variant("float16")
    with pytest.raises(ValueError, match="needs build="):
        variants.Variant("backward")
    register("ch97.double", reference=lambda x: 2 * x)
    case("ch97.double", "doubles", lambda g: (torch.ones(3),), variants=("bfloat16", "meta"))
    case("ch97.double", "a later case", lambda g: (torch.zeros(2),))
    names = [n for n, _ in get("ch97.double").public]
    assert names == ["doubles", "a later case", "doubles, in bfloat16", "doubles, " + (
        "with the default device set to meta")]  # fmt: skip
    assert run_checks("ch97.double", lambda x: x + x).ok
    failed = run_checks("ch97.double", lambda x: (x + x).float())
    assert "a bfloat16 input must give a bfloat16 output" in failed.message
    made_here = run_checks("ch97.double", lambda x: x * torch.full(x.shape, 2.0, dtype=x.dtype))
    assert "not on its input's device" in made_here.message


def test_a_step_the_chapter_computes_in_float32_is_named_as_such():
    """A bfloat16 input whose reference answer is float32 (a statistic, a normalised key): the
    message says the output must be float32, not that a bfloat16 input gives bfloat16."""
    register("ch96.mean32", reference=lambda x: x.float().mean(-1))
    case("ch96.mean32", "a mean in float32", lambda g: (torch.ones(2, 3),), variants=("bfloat16",))
    assert run_checks("ch96.mean32", lambda x: x.float().mean(-1)).ok
    failed = run_checks("ch96.mean32", lambda x: x.mean(-1))
    assert "with bfloat16 inputs, the output must be float32: yours is bfloat16" in (
        failed.message
    ), failed.message
