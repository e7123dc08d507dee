"""The gated delta rule: chunkwise = recurrent = transformers' torch reference = a naive loop.

References, independent of the code under test:
- `naive_rule` below: float64, one (batch, head) at a time, the update written as in the paper
  (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", 2024), value head j reading key head
  j // ratio;
- transformers' `torch_recurrent_gated_delta_rule` and `torch_chunk_gated_delta_rule` (the test
  oracle), called with `use_qk_l2norm_in_kernel=False` since our inputs are already normalised;
  both scale q by d_k^-0.5 inside, as ours.
Tolerances are max abs differences in float32 on outputs of magnitude ~1.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from qwen_mini.deltanet import (
    chunk_gated_delta_rule,
    decay_mask,
    l2norm,
    recurrent_gated_delta_rule,
)

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


LENGTHS = [1, 3, 63, 64, 65, 200, 1000]
CHUNKS = [16, 32, 64]

# log-decay g per token (g <= 0; the state is multiplied by exp(g)):
# negligible: exp(g) ~ 0.9999; realistic: Qwen3.5's -exp(A_log) * softplus(a + dt_bias) with
# A_log ~ log U(1, 16) and a ~ N(0, 1); strong: down to -30 (exp(g) ~ 1e-13); extreme: down to
# -2e4 on 15 % of the tokens (exp(g) underflows to 0: the state is wiped) and almost no decay on
# the others, so a chunk's cumulative sum reaches -1e5 while neighbours differ by ~0.05.
DECAYS = ["negligible", "realistic", "strong", "extreme"]


def make_g(kind: str, B: int, T: int, H: int, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(B, T, H, generator=gen)
    if kind == "negligible":
        return -1e-4 * u
    if kind == "realistic":
        A = torch.empty(H).uniform_(1, 16, generator=gen)
        a = torch.randn(B, T, H, generator=gen)
        return -A * torch.nn.functional.softplus(a + 1.0)
    if kind == "strong":
        return -30 * u
    reset = torch.rand(B, T, H, generator=gen) < 0.15
    return torch.where(reset, -1e4 * (1 + u), -0.05 * u)


def make_inputs(T, H_k, ratio, decay, seed=0, d_k=32, d_v=16, B=2, with_state=False):
    gen = torch.Generator().manual_seed(seed)
    H_v = H_k * ratio
    q = l2norm(torch.randn(B, T, H_k, d_k, generator=gen))
    k = l2norm(torch.randn(B, T, H_k, d_k, generator=gen))
    v = torch.randn(B, T, H_v, d_v, generator=gen)
    g = make_g(decay, B, T, H_v, gen)
    beta = torch.rand(B, T, H_v, generator=gen)
    state = torch.randn(B, H_v, d_k, d_v, generator=gen) * 0.5 if with_state else None
    return q, k, v, g, beta, state


def naive_rule(q, k, v, g, beta, state=None):
    """Float64, one (batch, value head) at a time: S <- e^g S; S <- S + k (beta (v - S^T k))^T;
    o = S^T (q / sqrt(d_k))."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    B, T, H_k, d_k = k.shape
    H_v, d_v = v.shape[2:]
    ratio = H_v // H_k
    out = torch.zeros(B, T, H_v, d_v, dtype=torch.float64)
    final = torch.zeros(B, H_v, d_k, d_v, dtype=torch.float64)
    for b in range(B):
        for j in range(H_v):
            h = j // ratio  # the key head of value head j (interleaved groups)
            S = torch.zeros(d_k, d_v, dtype=torch.float64)
            if state is not None:
                S = state[b, j].double()
            for t in range(T):
                S = torch.exp(g[b, t, j]) * S
                err = v[b, t, j] - S.T @ k[b, t, h]
                S = S + torch.outer(k[b, t, h], beta[b, t, j] * err)
                out[b, t, j] = S.T @ (q[b, t, h] / d_k**0.5)
            final[b, j] = S
    return out, final


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("T", [1, 3, 65])
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_equals_naive_float64_loop(T, ratio, with_state):
    inputs = make_inputs(T, 2, ratio, "realistic", d_k=8, d_v=4, with_state=with_state)
    q, k, v, g, beta, s0 = inputs
    expected_out, expected_state = naive_rule(q, k, v, g, beta, s0)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert out.shape == (2, T, 2 * ratio, 4) and state.shape == (2, 2 * ratio, 8, 4)
    assert state.dtype == torch.float32
    assert max_diff(out, expected_out) < 1e-6
    assert max_diff(state, expected_state) < 1e-6


def test_one_step_by_hand():
    """T = 1, one head, d = 2, empty state: S = beta k v^T, o = (q.k) beta v / sqrt(2)."""
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[0.6, 0.8]]]])
    v = torch.tensor([[[[2.0, -1.0]]]])
    g, beta = torch.tensor([[[-0.5]]]), torch.tensor([[[0.25]]])
    for fn in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        out, S = fn(q, k, v, g, beta)
        # the decay acts on the (empty) old state only: the new write is not decayed
        assert torch.allclose(S[0, 0], 0.25 * torch.outer(k[0, 0, 0], v[0, 0, 0]), atol=1e-7)
        assert torch.allclose(out[0, 0, 0], 0.6 * 0.25 * v[0, 0, 0] / 2**0.5, atol=1e-7)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
def test_chunk_equals_recurrent(T, with_state, ratio, decay):
    q, k, v, g, beta, s0 = make_inputs(T, 2, ratio, decay, seed=T, with_state=with_state)
    out_r, state_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert torch.isfinite(out_r).all() and torch.isfinite(state_r).all()
    for C in CHUNKS:
        out_c, state_c = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=C, initial_state=s0)
        assert torch.isfinite(out_c).all() and torch.isfinite(state_c).all(), C
        assert max_diff(out_c, out_r) < TOL, (C, max_diff(out_c, out_r))
        assert max_diff(state_c, state_r) < TOL, (C, max_diff(state_c, state_r))


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_equal_to_transformers_recurrent(T, ratio, decay):
    q, k, v, g, beta, s0 = make_inputs(T, 2, ratio, decay, seed=1, with_state=True)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    ref_out, ref_state = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True
    )
    assert max_diff(out, ref_out) < TOL and max_diff(state, ref_state) < TOL


@pytest.mark.parametrize("decay", ["negligible", "realistic"])
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize("C", CHUNKS)
def test_equal_to_transformers_chunk(C, T, ratio, decay):
    q, k, v, g, beta, s0 = make_inputs(T, 2, ratio, decay, seed=2, with_state=True)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=C, initial_state=s0)
    ref_out, ref_state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=C, initial_state=s0, output_final_state=True
    )
    assert max_diff(out, ref_out) < TOL and max_diff(state, ref_state) < TOL


def test_chunk_form_stays_accurate_where_float32_cumsums_cancel():
    """With extreme decays a chunk's cumulative log-decay reaches -1e5, where float32 resolves
    only ~0.01: differences of two float32 sums then lose the small decays between them.
    Ours sums in float64 and stays at float32 round-off from a float64 run of the recurrence;
    transformers' reference (float32 sums) is measurably off here, which is why the comparison
    with it above uses negligible and realistic decays only."""
    q, k, v, g, beta, s0 = make_inputs(300, 2, 2, "extreme", seed=3, with_state=True)
    exact_out, exact_state = recurrent_gated_delta_rule(
        *(x.double() for x in (q, k, v, g, beta)), initial_state=s0.double()
    )
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert max_diff(out, exact_out) < 1e-6 and max_diff(state, exact_state) < 1e-6
    ref_out, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert max_diff(ref_out, exact_out) > 1e-5  # the loss of precision the float64 sum avoids


def test_decay_mask_is_finite_for_extreme_decays():
    G = torch.tensor([0.0, -50.0, -500.0, -5000.0]).cumsum(0)  # exp(-5550) underflows to 0
    M = decay_mask(G)
    assert torch.isfinite(M).all()
    assert torch.equal(M.diagonal(), torch.ones(4))  # a token's own write is not decayed
    assert (M.triu(1) == 0).all()  # nothing from the future
    # by hand: M[1, 0] = exp(G1 - G0) = exp(-50)
    assert torch.allclose(M[1, 0], torch.exp(torch.tensor(-50.0)))
    # the ratio of exponentials is the same quantity on paper and NaN here (0 / 0)
    ratio = G.exp()[:, None] / G.exp()[None, :]
    assert torch.isnan(ratio).any()


@pytest.mark.parametrize("fn", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_no_overflow_with_zero_and_huge_decays(fn):
    q, k, v, g, beta, s0 = make_inputs(130, 2, 1, "extreme", seed=4, with_state=True)
    g[:, ::7] = -1e6  # a total reset at every 7th token (exp underflows to exactly 0)
    out, state = fn(q, k, v, g, beta, initial_state=s0)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    ref_out, ref_state = naive_rule(q[:1, :20], k[:1, :20], v[:1, :20], g[:1, :20], beta[:1, :20])
    out20, _ = fn(q[:1, :20], k[:1, :20], v[:1, :20], g[:1, :20], beta[:1, :20])
    assert max_diff(out20, ref_out) < 1e-6


@pytest.mark.parametrize("fn", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_padding_tokens_change_nothing(fn):
    """Tokens with g = 0, beta = 0, k = 0 are no-ops: the padding the chunk form adds."""
    q, k, v, g, beta, s0 = make_inputs(40, 2, 2, "realistic", seed=5, with_state=True)
    out, state = fn(q, k, v, g, beta, initial_state=s0)

    def pad(x):
        filler = torch.randn_like(x[:, :9]) if x is q or x is v else torch.zeros_like(x[:, :9])
        return torch.cat([x, filler], dim=1)

    out_p, state_p = fn(*(pad(x) for x in (q, k, v, g, beta)), initial_state=s0)
    assert max_diff(out_p[:, :40], out) < TOL and max_diff(state_p, state) < TOL
    # a nonzero g in the padding would decay the final state: the test can tell
    g_bad = torch.cat([g, torch.full_like(g[:, :9], -1.0)], dim=1)
    _, state_bad = fn(pad(q), pad(k), pad(v), g_bad, pad(beta), initial_state=s0)
    assert max_diff(state_bad, state) > 1e-2


@pytest.mark.parametrize("fn", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
@pytest.mark.parametrize("split", [1, 30, 64, 100])
def test_continuing_from_the_final_state_equals_one_pass(fn, split):
    q, k, v, g, beta, _ = make_inputs(150, 2, 2, "negligible", seed=6)  # a long memory
    out, state = fn(q, k, v, g, beta)
    first, mid = fn(*(x[:, :split] for x in (q, k, v, g, beta)))
    second, end = fn(*(x[:, split:] for x in (q, k, v, g, beta)), initial_state=mid)
    assert max_diff(torch.cat([first, second], 1), out) < TOL and max_diff(end, state) < TOL
    # restarting from an empty state (the bug of several public implementations) differs
    restarted, _ = fn(*(x[:, split:] for x in (q, k, v, g, beta)))
    assert max_diff(restarted, second) > 1e-2


def test_value_heads_read_key_heads_interleaved():
    """With H_v = 2 H_k, value heads 0 and 1 read key head 0 (not heads 0 and H_k)."""
    q, k, v, g, beta, _ = make_inputs(10, 2, 2, "realistic", seed=7)
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    for j in range(4):
        one, _ = recurrent_gated_delta_rule(
            q[:, :, j // 2 : j // 2 + 1],
            k[:, :, j // 2 : j // 2 + 1],
            v[:, :, j : j + 1],
            g[:, :, j : j + 1],
            beta[:, :, j : j + 1],
        )
        assert max_diff(one[:, :, 0], out[:, :, j]) < TOL


def test_bfloat16_inputs_keep_a_float32_state():
    q, k, v, g, beta, _ = make_inputs(70, 2, 1, "realistic", seed=8)
    out32, state32 = chunk_gated_delta_rule(q, k, v, g, beta)
    out, state = chunk_gated_delta_rule(q, k, v.bfloat16(), g, beta)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert max_diff(out, out32) < 0.05


def test_shape_errors_name_the_tensor():
    q, k, v, g, beta, _ = make_inputs(5, 2, 2, "realistic")
    with pytest.raises(ValueError, match="g .* must be \\[B, T, H_v\\]"):
        chunk_gated_delta_rule(q, k, v, g.transpose(1, 2), beta)
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 32, 16))
    with pytest.raises(ValueError, match="H_v a multiple of H_k"):
        chunk_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
