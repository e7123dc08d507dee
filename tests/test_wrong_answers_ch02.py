"""Typical wrong answers to chapter 2's exercises: each must fail its checks, and the public
checks must already name the idea that is wrong (the learner sees only those)."""

import math

import pytest
import torch
import torch.nn.functional as F

from qwen_mini.attention import causal_mask, split_heads
from qwen_mini.course.checking import run_checks
from qwen_mini.course.lab import ch02 as lab
from qwen_mini.rope import apply_rope

# --- bias_logit_terms ----------------------------------------------------------------------------


def terms_swapped(qx, kx, b_q, b_k):
    t = lab.bias_logit_terms(qx, kx, b_q, b_k)
    return dict(t, query_bias=t["key_bias"], key_bias=t["query_bias"])


def terms_scaled(qx, kx, b_q, b_k):
    return {
        n: v / math.sqrt(qx.shape[-1]) for n, v in lab.bias_logit_terms(qx, kx, b_q, b_k).items()
    }


def terms_no_bias_bias(qx, kx, b_q, b_k):
    return dict(lab.bias_logit_terms(qx, kx, b_q, b_k), bias_bias=torch.zeros(len(qx), len(kx)))


# --- rope_bias_term ------------------------------------------------------------------------------


def rope_bias_unrotated(b_q, b_k, cos, sin):
    return (b_q @ b_k).expand(cos.shape[0], cos.shape[0])


def rope_bias_only_query_rotated(b_q, b_k, cos, sin):
    return apply_rope(b_q.expand(cos.shape[0], -1), cos, sin) @ b_k.expand(cos.shape[0], -1).T


# --- project_qk ----------------------------------------------------------------------------------


def project_rope_first(attn, x, cos, sin):
    q = apply_rope(split_heads(attn.q_proj(x), attn.n_heads), cos, sin)
    k = apply_rope(split_heads(attn.k_proj(x), attn.n_kv_heads), cos, sin)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k


def project_norm_all_heads(attn, x, cos, sin):
    q, k = attn.q_proj(x), attn.k_proj(x)
    if attn.q_norm is not None:  # the RMS of all heads together, then the per-head weight
        q = split_heads(q * q.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt(), attn.n_heads)
        k = split_heads(k * k.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt(), attn.n_kv_heads)
        q, k = q * attn.q_norm.weight, k * attn.k_norm.weight
    else:
        q, k = split_heads(q, attn.n_heads), split_heads(k, attn.n_kv_heads)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def project_no_bias(attn, x, cos, sin):
    q = split_heads(F.linear(x, attn.q_proj.weight), attn.n_heads)
    k = split_heads(F.linear(x, attn.k_proj.weight), attn.n_kv_heads)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def project_no_norm(attn, x, cos, sin):
    q = split_heads(attn.q_proj(x), attn.n_heads)
    k = split_heads(attn.k_proj(x), attn.n_kv_heads)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


# --- logit_stats ---------------------------------------------------------------------------------


def _logits(q, k, scale=True, mask=True):
    T = q.shape[-2]
    s = q.float() @ k.float().transpose(-2, -1)
    s = s / math.sqrt(q.shape[-1]) if scale else s
    return s.masked_fill(~causal_mask(T, T), float("-inf")) if mask else s


def stats_unscaled(q, k):
    s = _logits(q, k, scale=False)
    p = s.softmax(-1)
    e = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
    return s.amax(dim=(0, 2, 3)), e.mean(dim=(0, 2))


def stats_max_over_future(q, k):
    _, e = lab.logit_stats(q, k)
    return _logits(q, k, mask=False).amax(dim=(0, 2, 3)), e


def stats_nan_entropy(q, k):
    m, _ = lab.logit_stats(q, k)
    p = _logits(q, k).softmax(-1)
    return m, -(p * p.log()).sum(-1).mean(dim=(0, 2))  # 0 * log 0 = nan


def stats_bits(q, k):
    m, e = lab.logit_stats(q, k)
    return m, e / math.log(2)


def stats_all_heads(q, k):
    m, e = lab.logit_stats(q, k)
    return m.max(), e.mean()


# --- distinct_weights ----------------------------------------------------------------------------


def distinct_logits_not_rounded(logits, dtype):
    w = logits.float().softmax(-1).to(dtype)
    return int(torch.unique(w[w > 0]).numel())


def distinct_counts_zeros(logits, dtype):
    w = logits.to(dtype).float().softmax(-1).to(dtype)
    return int(torch.unique(w).numel())


# --- remove_qk_norm ------------------------------------------------------------------------------


def remove_by_unit_weight(state_dict):
    return {k: torch.ones_like(w) if "_norm" in k else w for k, w in state_dict.items()}


def remove_first_layer_only(state_dict):
    return {
        k: w for k, w in state_dict.items() if "layers.0.self_attn." not in k or "_norm" not in k
    }


def remove_every_norm(state_dict):
    return {k: w for k, w in state_dict.items() if "norm" not in k}


WRONG = [
    # (exercise, wrong answer, words the public message must contain)
    ("ch02.bias_logit_terms", terms_swapped, "swapped"),
    ("ch02.bias_logit_terms", terms_scaled, "unscaled"),
    ("ch02.bias_logit_terms", terms_no_bias_bias, "add up"),
    ("ch02.rope_bias_term", rope_bias_unrotated, "without RoPE"),
    ("ch02.rope_bias_term", rope_bias_only_query_rotated, "same position"),
    ("ch02.project_qk", project_rope_first, "RoPE comes before QK-Norm"),
    ("ch02.project_qk", project_norm_all_heads, "over all heads"),
    ("ch02.project_qk", project_no_norm, "QK-Norm is missing"),
    ("ch02.project_qk", project_no_bias, "bias is missing"),
    ("ch02.logit_stats", stats_unscaled, "√D"),
    ("ch02.logit_stats", stats_max_over_future, "future keys"),
    ("ch02.logit_stats", stats_nan_entropy, "0·log 0"),
    ("ch02.logit_stats", stats_bits, "bits"),
    ("ch02.logit_stats", stats_all_heads, "one value per head"),
    ("ch02.distinct_weights", distinct_logits_not_rounded, "round the logits"),
    ("ch02.distinct_weights", distinct_counts_zeros, "nonzero"),
    ("ch02.remove_qk_norm", remove_by_unit_weight, "no normalisation at all"),
    ("ch02.remove_qk_norm", remove_first_layer_only, "every layer"),
    ("ch02.remove_qk_norm", remove_every_norm, "keep every tensor"),
]


@pytest.mark.parametrize(
    "exercise, wrong, idea", WRONG, ids=[f"{e}-{w.__name__}" for e, w, _ in WRONG]
)
def test_wrong_answer_fails_naming_the_idea(exercise, wrong, idea):
    public = run_checks(exercise, wrong)
    assert public.status == "failed", public.line()
    assert idea in public.message, public.message
    assert run_checks(exercise, wrong, hidden=True).status == "failed"


@pytest.mark.parametrize("exercise", sorted({e for e, _, _ in WRONG}))
def test_reference_passes_every_check(exercise):
    from qwen_mini.course.checking import reference

    result = run_checks(exercise, reference(exercise), hidden=True)
    assert result.ok, result.line()


def test_every_exercise_has_wrong_answers():
    from qwen_mini.course.checking import exercises

    assert {e.id for e in exercises("ch02")} == {e for e, _, _ in WRONG}
