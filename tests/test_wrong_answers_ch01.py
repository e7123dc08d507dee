"""Right answers to chapter 1's stateful exercises written differently from the package (QK-Norm
before the transpose, as transformers writes it; keyword arguments; a loader that copies the
header; `model.forward` instead of calling the model): each must pass every check. The typical
wrong answers are catalogued with their cases in qwen_mini/course/checks/ch01.py and proven to
fail by tests/test_wrong_answers.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwen_mini import attention as ref
from qwen_mini import decoder as dec
from qwen_mini import decoding, weights
from qwen_mini.course.checking import run_checks
from qwen_mini.rope import apply_rope

# --- right answers written differently must pass -------------------------------------------------


class AttentionNormBeforeTranspose(ref.Attention):
    """QK-Norm on [B, T, H, D] before the transpose, as transformers writes it."""

    def forward(self, x, cos, sin, cache=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, -1)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, -1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = ref.split_heads(self.v_proj(x), self.n_kv_heads)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        mask = ref.causal_mask(T, k.shape[2], x.device)  # where the layer runs
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(ref.merge_heads(out))


class LayerWithKeywords(dec.DecoderLayer):
    def forward(self, x, cos, sin, cache=None):
        x = x + self.mixer(self.input_layernorm(x), cos=cos, sin=sin, cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def load_with_setattr(model, header, get_tensor, prefix="model."):
    return weights.load_weights(model, dict(header), get_tensor, prefix)


def decode_with_forward(model, prompt_ids, max_new_tokens, choose=decoding.greedy, stop=()):
    cache, ids = model.new_cache(batch_size=1), torch.tensor([prompt_ids])
    for _ in range(max_new_tokens):
        token = choose(model.forward(ids, cache=cache, last_only=True)[0, -1])
        yield token
        if token in stop:
            break
        ids = torch.tensor([[token]])


@pytest.mark.parametrize(
    "exercise, answer",
    [
        ("Attention", AttentionNormBeforeTranspose),
        ("DecoderLayer", LayerWithKeywords),
        ("load_weights", load_with_setattr),
        ("decode", decode_with_forward),
    ],
)
def test_right_answers_written_differently_pass(exercise, answer):
    result = run_checks(f"ch01.{exercise}", answer, hidden=True)
    assert result.status == "passed", result.line()


@pytest.mark.parametrize("n_kv_new", [3, 6, 0])
def test_regroup_kv_heads_refuses_counts_that_do_not_divide(n_kv_new):
    """4 KV heads into 3 or 6 (or none): no regrouping exists; the error names both counts."""
    from qwen_mini.course.lab import ch01 as lab

    with pytest.raises(ValueError, match=f"4 KV heads into {n_kv_new}"):
        lab.regroup_kv_heads(torch.zeros(4 * 8, 16), 8, n_kv_new)
