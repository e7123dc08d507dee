"""Qwen3.5's blocks against transformers' own modules (the oracle), same weights, float32.

Weights are random with std 0.2 (norm weights near their neutral value) so that the outputs are
of order 1 and a wrong implementation cannot hide under the tolerance (max abs 1e-5).
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_config, randomize
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from qwen_mini.architectures import ARCHITECTURES, config_from_dict
from qwen_mini.attention import GatedAttention
from qwen_mini.config import Config
from qwen_mini.deltanet import DeltaNetState, GatedDeltaNet
from qwen_mini.norms import GatedRMSNorm, ZeroCentredRMSNorm
from qwen_mini.rope import rope_cos_sin

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_config(value_heads: int = 4, **overrides) -> Qwen3_5TextConfig:
    """The tests' tiny Qwen3.5 text config (tests/helpers.py), with `value_heads` value heads."""
    return hf_config("qwen3_5_text", linear_num_value_heads=value_heads, **overrides)


def randomize_block(module: torch.nn.Module, seed: int = 0) -> None:
    """helpers.randomize with exp(A_log) from 0.01 to 2: weak to strong decays (up to 16 at
    initialisation; there transformers' float32 cumulative sums drift by ~5e-5 over a chunk, see
    tests/test_deltanet.py, while ours stay at ~1e-6)."""
    randomize(module, seed, a_log=(0.01, 2.0))


def ours_config(cfg: Qwen3_5TextConfig) -> Config:
    """The same config as qwen_mini reads it from config.json."""
    return config_from_dict(cfg.to_dict())


def deltanet_pair(value_heads: int = 4, seed: int = 0):
    cfg = tiny_config(value_heads)
    ref = hf.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    randomize_block(ref, seed)
    ours = GatedDeltaNet(ours_config(cfg), 0).eval()
    ours.load_state_dict(ref.state_dict())  # strict: every checkpoint key has its parameter
    return ours, ref


def x_input(T: int, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, 32, generator=torch.Generator().manual_seed(seed))


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_deltanet_parameter_names_and_shapes_follow_the_checkpoint():
    ours, ref = deltanet_pair()
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert set(shapes) == {
        "in_proj_qkv.weight",
        "in_proj_z.weight",
        "in_proj_b.weight",
        "in_proj_a.weight",
        "conv1d.weight",
        "dt_bias",
        "A_log",
        "norm.weight",
        "out_proj.weight",
    }


@pytest.mark.parametrize("value_heads", [2, 4])  # H_v = H_k and H_v = 2 H_k
@pytest.mark.parametrize("T", [1, 5, 64, 70, 150])
def test_gated_deltanet_equals_transformers(T, value_heads):
    ours, ref = deltanet_pair(value_heads)
    x = x_input(T)
    with torch.no_grad():
        expected = ref(x)
        assert expected.abs().max() > 0.5  # not a near-zero output a wrong model could match
        assert max_diff(ours(x), expected) < TOL


PIECES = {
    "3+2+1": [3, 2, 1],
    "2+3+1": [2, 3, 1],
    "one at a time": [1] * 8,
    "longer than a chunk": [70, 5, 1],
    "crossing chunk boundaries": [60, 10, 1, 60, 3],
    "one token then a chunk": [1, 64, 2],
}


@pytest.mark.parametrize("pieces", list(PIECES))
def test_deltanet_pieces_with_state_equal_the_whole(pieces):
    ours, ref = deltanet_pair(4)
    sizes = PIECES[pieces]
    x = x_input(sum(sizes))
    state = ours.new_state(2, torch.float32)
    outs, start = [], 0
    with torch.no_grad():
        for n in sizes:
            outs.append(ours(x[:, start : start + n], cache=state))
            state.commit(n)
            start += n
        whole = ref(x)
    assert state.length == sum(sizes)
    assert max_diff(torch.cat(outs, 1), whole) < TOL


def test_restarting_from_an_empty_state_would_differ():
    """The check above can fail: dropping either state changes the continuation."""
    ours, _ = deltanet_pair(4)
    x = x_input(12)
    with torch.no_grad():
        whole = ours(x)
        state = ours.new_state(2, torch.float32)
        ours(x[:, :6], cache=state)
        state.commit(6)
        no_conv = ours.new_state(2, torch.float32)
        no_conv.recurrent = state.recurrent
        no_recurrent = ours.new_state(2, torch.float32)
        no_recurrent.conv = state.conv
        assert max_diff(ours(x[:, 6:], cache=state), whole[:, 6:]) < TOL
        assert max_diff(ours(x[:, 6:], cache=no_conv), whole[:, 6:]) > 1e-2
        assert max_diff(ours(x[:, 6:], cache=no_recurrent), whole[:, 6:]) > 1e-2


def test_deltanet_state_stages_until_commit_and_discard_keeps_it():
    ours, _ = deltanet_pair(4)
    x = x_input(9)
    state = ours.new_state(2, torch.float32)
    with torch.no_grad():
        ours(x[:, :5], cache=state)
        state.commit(5)
        conv, recurrent = state.conv.clone(), state.recurrent.clone()
        ours(x[:, 5:], cache=state)  # staged only
        assert state.length == 5
        assert torch.equal(state.conv, conv) and torch.equal(state.recurrent, recurrent)
        state.discard()  # a later layer failed: this pass never happened
        assert state.length == 5 and torch.equal(state.recurrent, recurrent)
        # and the pass after the failure continues from the 5 committed tokens
        after = ours(x[:, 5:], cache=state)
        assert max_diff(after, ours(x)[:, 5:]) < TOL
    state.truncate(5)  # a no-op is allowed
    with pytest.raises(ValueError, match="cannot be truncated to 3 tokens"):
        state.truncate(3)


def test_deltanet_state_size_is_fixed():
    """conv: K-1 inputs of every conv channel; recurrent: one d_k x d_v float32 matrix per
    value head, whatever the length."""
    ours, _ = deltanet_pair(4)
    state = ours.new_state(1, torch.bfloat16)
    conv_dim = 2 * 2 * 8 + 4 * 8
    assert state.nbytes() == conv_dim * 3 * 2 + 4 * 8 * 8 * 4
    assert state.recurrent.dtype == torch.float32 and state.conv.dtype == torch.bfloat16
    real = DeltaNetState(1, 6144, 4, 16, 128, 128, torch.bfloat16, "meta")
    assert real.recurrent.nbytes == 2**20  # 1 MiB per layer (FACTS.md)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_equal_transformers(dtype):
    x, z = x_input(5).to(dtype), x_input(5, seed=2).to(dtype)
    zero_ref, gated_ref = hf.Qwen3_5RMSNorm(32, eps=1e-6), hf.Qwen3_5RMSNormGated(32, eps=1e-6)
    zero_ref.weight.data.copy_(0.1 * torch.randn(32))  # `weight` alone: no "norm" in the name
    gated_ref.weight.data.copy_(1 + 0.1 * torch.randn(32))
    zero, gated = ZeroCentredRMSNorm(32), GatedRMSNorm(32)
    zero.load_state_dict(zero_ref.state_dict())
    gated.load_state_dict(gated_ref.state_dict())
    zero, gated, zero_ref, gated_ref = (m.to(dtype) for m in (zero, gated, zero_ref, gated_ref))
    with torch.no_grad():
        assert torch.equal(zero(x), zero_ref(x))
        assert torch.equal(gated(x, z), gated_ref(x, z))
        # zero-centred: a weight of 0 is the identity scale; read as a plain norm it zeroes x
        assert torch.equal(ZeroCentredRMSNorm(32).to(dtype)(x), hf.Qwen3_5RMSNorm(32).to(dtype)(x))


def attention_pair(seed: int = 0):
    cfg = tiny_config()
    cfg._attn_implementation = "eager"
    ref = hf.Qwen3_5Attention(cfg, 3).eval()
    randomize_block(ref, seed)
    ours = GatedAttention(ours_config(cfg), 3, ARCHITECTURES["qwen3_5_text"]).eval()
    ours.load_state_dict(ref.state_dict())
    return ours, ref, cfg


def hf_attention(ref, cfg, x, start: int = 0):
    """transformers' attention on x at positions start.., with its own RoPE and a causal mask."""
    T = x.shape[1]
    positions = torch.arange(start, start + T)[None]
    cos, sin = hf.Qwen3_5TextRotaryEmbedding(cfg)(x, positions)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    return ref(x, (cos, sin), mask)[0]


@pytest.mark.parametrize("T", [1, 7])
def test_gated_attention_equals_transformers(T):
    ours, ref, cfg = attention_pair()
    x = x_input(T)
    cos, sin = rope_cos_sin(torch.arange(T), 4, 10000.0)  # rotary width 16 * 0.25 = 4
    with torch.no_grad():
        expected = hf_attention(ref, cfg, x)
        assert expected.abs().max() > 0.5
        assert max_diff(ours(x, cos, sin), expected) < TOL


def test_gated_attention_with_a_kv_state_in_pieces():
    ours, ref, cfg = attention_pair()
    x = x_input(9)
    cos, sin = rope_cos_sin(torch.arange(9), 4, 10000.0)
    kv = ours.new_state(2, torch.float32)
    outs = []
    with torch.no_grad():
        for a, b in [(0, 3), (3, 5), (5, 6), (6, 9)]:
            outs.append(ours(x[:, a:b], cos[a:b], sin[a:b], kv))
            kv.commit(b - a)
        assert max_diff(torch.cat(outs, 1), hf_attention(ref, cfg, x)) < TOL


def test_partial_rope_angles_equal_transformers_at_the_real_shape():
    """Qwen3.5-0.8B: head_dim 256, rotary width 64, theta 1e7, M-RoPE sections [11, 11, 10];
    the frequencies' denominator is the rotary width (64), not head_dim, and with the three
    position streams equal (text) M-RoPE is plain 1-D RoPE."""
    cfg = tiny_config(
        head_dim=256,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    positions = torch.tensor([0, 1, 7, 4095, 200000])
    cos, sin = hf.Qwen3_5TextRotaryEmbedding(cfg)(torch.zeros(1), positions[None])
    ours_cos, ours_sin = rope_cos_sin(positions, 64, 10000000.0)
    assert cos.shape[-1] == 64
    assert max_diff(ours_cos, cos[0]) < 1e-6 and max_diff(ours_sin, sin[0]) < 1e-6
    wrong_cos, _ = rope_cos_sin(positions, 256, 10000000.0)  # denominator head_dim
    assert max_diff(wrong_cos[:, :32], cos[0, :, :32]) > 0.1
