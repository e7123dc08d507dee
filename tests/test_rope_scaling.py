"""RoPE scaling (config.json's `rope_scaling` / `rope_parameters`): linear and YaRN against
transformers, on its own frequency functions and on whole checkpoints it wrote; every other kind
refused, naming the field and the file."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import HF_CLASSES, hf_config, write_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import qwen_mini
from qwen_mini import CheckpointError
from qwen_mini.architectures import config_from_dict
from qwen_mini.config import RopeScaling
from qwen_mini.rope_scaling import rotary_cos_sin, yarn_attention_factor, yarn_inv_freq

TOL = 1e-4  # max abs logit difference, float32 both sides (as tests/test_oracle.py)

YARN_CASES = [
    pytest.param(dict(head_dim=128, rope_theta=1e6, max_position_embeddings=131072,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 32768}),
                 id="qwen3-model-card"),
    pytest.param(dict(head_dim=64, rope_theta=1e4, max_position_embeddings=8192,
                      rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 16,
                                    "original_max_position_embeddings": 1024}),
                 id="beta-fast-16"),
    pytest.param(dict(head_dim=32, rope_theta=1e5, max_position_embeddings=2048,
                      rope_scaling={"type": "yarn", "factor": 2.0, "truncate": False,
                                    "original_max_position_embeddings": 512}),
                 id="legacy-type-key-no-truncate"),
    pytest.param(dict(head_dim=16, rope_theta=1e4, max_position_embeddings=4096,
                      rope_scaling={"rope_type": "yarn", "factor": 16.0, "mscale": 0.707,
                                    "mscale_all_dim": 1.0,
                                    "original_max_position_embeddings": 256}),
                 id="mscale"),
    pytest.param(dict(head_dim=16, rope_theta=1e4, max_position_embeddings=1024,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.9,
                                    "original_max_position_embeddings": 256}),
                 id="explicit-attention-factor"),
]  # fmt: skip


@pytest.mark.parametrize(
    "fields", [c.values[0] for c in YARN_CASES], ids=[c.id for c in YARN_CASES]
)
def test_yarn_frequencies_and_factor_are_transformers(fields):
    hf = hf_config("qwen3", **fields)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = config_from_dict(json.loads(hf.to_json_string()))
    s = cfg.rope_scaling
    assert s is not None and s.rope_type == "yarn"
    assert torch.allclose(yarn_inv_freq(cfg.rotary_dim, cfg.rope_theta, s), inv_freq, rtol=1e-6)
    assert math.isclose(yarn_attention_factor(s), factor, rel_tol=1e-9)
    plain = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2) / cfg.rotary_dim)
    assert not torch.allclose(inv_freq, plain)  # the case really scales something


def test_linear_frequencies_are_transformers():
    hf = hf_config("qwen3", rope_scaling={"rope_type": "linear", "factor": 3.0})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](hf, "cpu")
    cfg = config_from_dict(json.loads(hf.to_json_string()))
    positions = torch.arange(40)
    cos, sin = rotary_cos_sin(cfg, positions)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], -1)
    assert torch.allclose(cos, angles.cos(), atol=1e-6) and torch.allclose(
        sin, angles.sin(), atol=1e-6
    )


def test_yarn_angles_apply_the_factor():
    """cos and sin carry the attention factor (their squares sum to factor², not 1)."""
    s = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64)
    cfg = qwen_mini.Config(head_dim=16, rope_theta=1e4, rope_scaling=s)
    cos, sin = rotary_cos_sin(cfg, torch.arange(10))
    expected = torch.full_like(cos, yarn_attention_factor(s) ** 2)
    assert torch.allclose(cos**2 + sin**2, expected, atol=1e-6)
    assert yarn_attention_factor(s) == pytest.approx(0.1 * math.log(4.0) + 1.0)


# whole checkpoints: scaling changes the logits at every position, so the plain model differs
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
MODELS = [
    pytest.param("qwen3", dict(head_dim=16, rope_scaling=YARN), id="qwen3-yarn"),
    pytest.param("qwen3", dict(head_dim=16, rope_scaling={"rope_type": "linear", "factor": 4.0}),
                 id="qwen3-linear"),
    pytest.param("qwen2", dict(rope_scaling={**YARN, "factor": 2.0}), id="qwen2-yarn"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "fields"), [c.values for c in MODELS], ids=[c.id for c in MODELS]
)
@torch.inference_mode()
def test_scaled_checkpoint_matches_transformers(tmp_path, model_type, fields):
    write_checkpoint(tmp_path, model_type, tied=False, eos_token_id=None, **fields)
    ours = qwen_mini.load_model(tmp_path, dtype=torch.float32).eval()
    ref = HF_CLASSES[model_type][1].from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert ours.config.rope_scaling is not None
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = ref(ids).logits
    assert (ours(ids) - expected).abs().max() <= TOL
    cache = ours.new_cache(2)  # the cached positions carry the scaling too
    pieces = torch.cat([ours(ids[:, :30], cache=cache), ours(ids[:, 30:], cache=cache)], 1)
    assert (pieces - expected).abs().max() <= TOL
    # the plain-RoPE model of the same weights is far from it: the comparison can fail
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": config["rope_parameters"]["rope_theta"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    plain = qwen_mini.load_model(tmp_path, dtype=torch.float32).eval()
    assert (plain(ids) - expected).abs().max() > 100 * TOL


@pytest.mark.parametrize(
    "table",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
        {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
        {"type": "su"},
        {"rope_type": "linear"},  # no factor
    ],
)
def test_other_scalings_are_refused_naming_field_and_file(tmp_path, table):
    write_checkpoint(tmp_path, "qwen3", head_dim=16)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["rope_scaling"] = table
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        qwen_mini.load_model(tmp_path)
    message = str(e.value)
    assert str(path) in message and "rope" in message
