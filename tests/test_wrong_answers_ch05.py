"""Typical wrong answers to chapter 5's exercises: each must fail its checks, with a message that
names the idea that is wrong (not only a differing number)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwen_mini import deltanet as ref
from qwen_mini import norms
from qwen_mini.course.checking import run_checks


def step_g_as_multiplier(S, q, k, v, g, beta):
    S = S * g[..., None, None]
    u = beta[..., None] * (v - (k[..., None, :] @ S).squeeze(-2))
    S = S + k[..., :, None] * u[..., None, :]
    return (q[..., None, :] @ S).squeeze(-2), S


def step_no_beta(S, q, k, v, g, beta):
    return ref.recurrent_step(S, q, k, v, g, torch.ones_like(beta))


def step_decay_after_write(S, q, k, v, g, beta):
    u = beta[..., None] * (v - (k[..., None, :] @ S).squeeze(-2))
    S = (S + k[..., :, None] * u[..., None, :]) * g.exp()[..., None, None]
    return (q[..., None, :] @ S).squeeze(-2), S


def step_plain_write(S, q, k, v, g, beta):
    S = S * g.exp()[..., None, None]
    S = S + k[..., :, None] * (beta[..., None] * v)[..., None, :]
    return (q[..., None, :] @ S).squeeze(-2), S


def step_read_before_write(S, q, k, v, g, beta):
    _, S_new = ref.recurrent_step(S, q, k, v, g, beta)
    return (q[..., None, :] @ (S * g.exp()[..., None, None])).squeeze(-2), S_new


def mask_ratio_of_exponentials(G):
    E = G.exp()
    return (E[..., :, None] / E[..., None, :]).tril()


def mask_transposed(G):
    return ref.decay_mask(G).transpose(-1, -2)


def mask_strict(G):
    return ref.decay_mask(G).tril(-1)


def mask_exp_then_zero(G):
    diff = G[..., :, None] - G[..., None, :]
    C = G.shape[-1]
    return diff.exp() * torch.ones(C, C).tril()  # exp overflows above the diagonal: inf * 0


def solve_minus(A, rhs):
    return ref.solve_unit_lower(-A, rhs)


def solve_transposed(A, rhs):
    return torch.linalg.solve(torch.eye(A.shape[-1]) + A.transpose(-1, -2), rhs)


def pad_with_ones(x, chunk_size, dim):
    pad = -x.shape[dim] % chunk_size
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_ones(shape)], dim=dim)


def expand_tiled(x, n_value_heads):
    return x.repeat(1, 1, n_value_heads // x.shape[2], 1)


def _loop_variant(restart_each_chunk=False, ignore_initial=False, no_state_correction=False):
    """The chunk loop with one typical mistake."""

    def chunk_loop(U0, W, scores, q_decayed, k_to_end, chunk_decay, S):
        if ignore_initial:
            S = torch.zeros_like(S)
        out = torch.empty_like(U0)
        for n in range(U0.shape[2]):
            if restart_each_chunk:
                S = torch.zeros_like(S)
            U = U0[:, :, n] if no_state_correction else U0[:, :, n] - W[:, :, n] @ S
            out[:, :, n] = q_decayed[:, :, n] @ S + scores[:, :, n] @ U
            S = chunk_decay[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ U
        return out, S

    return chunk_loop


def loop_state_not_decayed(U0, W, scores, q_decayed, k_to_end, chunk_decay, S):
    out = torch.empty_like(U0)
    for n in range(U0.shape[2]):
        U = U0[:, :, n] - W[:, :, n] @ S
        out[:, :, n] = q_decayed[:, :, n] @ S + scores[:, :, n] @ U
        S = S + k_to_end[:, :, n].transpose(-1, -2) @ U  # the old state does not fade
    return out, S


def conv_no_state(x, weight, conv_state):
    return ref.causal_conv1d(x, weight, torch.zeros_like(conv_state))


def conv_symmetric_padding(x, weight, conv_state):
    K = weight.shape[-1]
    y = F.conv1d(x, weight, padding=K // 2, groups=x.shape[1])[..., : x.shape[-1]]
    return y, torch.cat([conv_state, x], -1)[..., -(K - 1) :]


def conv_state_from_x_only(x, weight, conv_state):
    y, _ = ref.causal_conv1d(x, weight, conv_state)
    K = weight.shape[-1]
    return y, F.pad(x, (max(0, K - 1 - x.shape[-1]), 0))[..., -(K - 1) :]


class NormZeroCentred(norms.GatedRMSNorm):
    def forward(self, x, z):
        x = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (1 + self.weight) * F.silu(z.float())


class NormSigmoidGate(norms.GatedRMSNorm):
    def forward(self, x, z):
        x = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight * torch.sigmoid(z.float())


class NormGateFirst(norms.GatedRMSNorm):
    def forward(self, x, z):
        x = x.float() * F.silu(z.float())
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# (exercise, wrong answer, words the failure message must contain)
CORPUS = [
    ("ch05.recurrent_step", step_g_as_multiplier, "exp(g)"),
    ("ch05.recurrent_step", step_no_beta, "beta"),
    ("ch05.recurrent_step", step_decay_after_write, "decay the OLD state first"),
    ("ch05.recurrent_step", step_plain_write, "error"),
    ("ch05.recurrent_step", step_read_before_write, "AFTER"),
    ("ch05.decay_mask", mask_ratio_of_exponentials, "exp(G[t] - G[s])"),
    ("ch05.decay_mask", mask_transposed, "transposed"),
    ("ch05.decay_mask", mask_strict, "diagonal"),
    ("ch05.decay_mask", mask_exp_then_zero, "BEFORE exp"),
    ("ch05.solve_unit_lower", solve_minus, "(I + A)"),
    ("ch05.solve_unit_lower", solve_transposed, "forward substitution"),
    ("ch05.pad_to_chunks", pad_with_ones, "g = 0"),
    ("ch05.expand_key_heads", expand_tiled, "j // ratio"),
    ("ch05.chunk_loop", _loop_variant(restart_each_chunk=True), "empty state"),
    ("ch05.chunk_loop", _loop_variant(ignore_initial=True), "initial_state"),
    ("ch05.chunk_loop", _loop_variant(no_state_correction=True), "U0 - W S"),
    ("ch05.chunk_loop", loop_state_not_decayed, "decay by exp(G_last)"),
    ("ch05.causal_conv1d", conv_no_state, "conv_state"),
    ("ch05.causal_conv1d", conv_symmetric_padding, "future"),
    ("ch05.causal_conv1d", conv_state_from_x_only, "old state"),
    ("ch05.GatedRMSNorm", NormZeroCentred, "zero-centred"),
    ("ch05.GatedRMSNorm", NormSigmoidGate, "silu"),
    ("ch05.GatedRMSNorm", NormGateFirst, "before the norm"),
]


@pytest.mark.parametrize(
    "exercise, wrong, words", CORPUS, ids=[f"{e}-{w.__name__}" for e, w, _ in CORPUS]
)
def test_wrong_answer_fails_publicly_and_names_the_idea(exercise, wrong, words):
    result = run_checks(exercise, wrong, hidden=True)
    assert result.status == "failed", result.line()
    assert words in result.message, result.message
    public_only = run_checks(exercise, wrong)
    assert public_only.status == "failed"  # the learner sees it before grading


def test_the_references_pass():
    for exercise in sorted({e for e, _, _ in CORPUS}):
        from qwen_mini.course.checking import reference

        assert run_checks(exercise, reference(exercise), hidden=True).ok, exercise
