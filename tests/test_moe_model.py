"""qwen3_moe models: which layers are sparse, the checkpoint layout transformers writes, and the
real Qwen3-30B-A3B built on the meta device (names, shapes, parameter counts) without memory.

The logits of whole tiny qwen3_moe checkpoints against transformers are in test_oracle.py (its
qwen3_moe cases: several expert counts, k, sparse steps, dense-only layers, renormalisation on
and off; with cached decode and a prompt fed in pieces)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import stored_layout, tiny_config
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeSparseMoeBlock,
)

import qwen_mini
from qwen_mini import moe
from qwen_mini.architectures import config_from_dict, config_from_file
from qwen_mini.checkpoint import CheckpointError, expected_shapes, meta_model
from qwen_mini.config import ASSETS

CONFIG_30B = ASSETS / "configs" / "qwen3-30b-a3b"
# the tiny Qwen3-MoE of tests/helpers.py with a dense layer among the sparse ones: every second
# layer sparse, the last one dense by mlp_only_layers, six experts
TINY_MOE = tiny_config(
    "qwen3_moe",
    vocab_size=64,
    intermediate_size=48,
    num_hidden_layers=4,
    head_dim=8,
    num_experts=6,
    decoder_sparse_step=2,
    mlp_only_layers=[3],
    tie_word_embeddings=False,
    max_position_embeddings=64,
)
del TINY_MOE["model_type"]  # the transformers config class says it


def test_stored_layout_is_what_transformers_writes(tmp_path):
    hf = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**TINY_MOE))
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert "model.layers.1.mlp.experts.5.down_proj.weight" in written  # one by one
    assert stored_layout({k: tuple(v.shape) for k, v in hf.state_dict().items()}) == written
    # and the package expects exactly those tensors for that config
    cfg = config_from_dict({"model_type": "qwen3_moe", **TINY_MOE})
    assert expected_shapes(cfg) == written


@pytest.mark.parametrize(
    "sparse_step, mlp_only, E",
    [(1, [], 4), (2, [], 4), (1, [0, 2], 4), (3, [1], 8), (1, [], 0)],
)
def test_sparse_layers_are_those_of_transformers(sparse_step, mlp_only, E):
    fields = dict(TINY_MOE, num_hidden_layers=6, num_experts=E, decoder_sparse_step=sparse_step)
    fields.update(mlp_only_layers=mlp_only, num_experts_per_tok=min(2, max(E, 1)))
    hf_cfg = Qwen3MoeConfig(**fields)
    ours = config_from_dict({"model_type": "qwen3_moe", **fields})
    model = meta_model(ours)
    for i in range(6):
        hf_sparse = isinstance(Qwen3MoeDecoderLayer(hf_cfg, i).mlp, Qwen3MoeSparseMoeBlock)
        assert isinstance(model.model.layers[i].mlp, moe.SparseMoeBlock) == hf_sparse, i
        assert ours.is_sparse_layer(i) == hf_sparse, i


# --- the real Qwen3-30B-A3B, on the meta device --------------------------------------------------


@pytest.fixture(scope="module")
def real_30b():
    """(our meta model, transformers' meta model) of the verbatim Qwen3-30B-A3B config."""
    cfg = config_from_file(CONFIG_30B / "config.json")
    ours = meta_model(cfg)
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG_30B))
    return cfg, ours, theirs


def _split(model) -> tuple[int, int]:
    """(parameters outside the routed experts, parameters in them)."""
    total, expert = 0, 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            expert += p.numel()
        else:
            total += p.numel()
    return total, expert


def test_30b_names_and_shapes_equal_the_checkpoint(real_30b):
    _, ours, theirs = real_30b
    want = stored_layout({k: tuple(v.shape) for k, v in theirs.state_dict().items()})
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want
    assert len(got) == 18_867
    assert all(p.is_meta for p in ours.parameters())  # nothing was allocated


def test_30b_total_and_active_parameters(real_30b):
    cfg, ours, theirs = real_30b
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    dense_ours, experts_ours = _split(ours)
    dense_theirs, experts_theirs = _split(theirs)
    assert (dense_ours, experts_ours) == (dense_theirs, experts_theirs)
    total = dense_ours + experts_ours
    active = dense_ours + experts_ours * k // E  # every sparse layer has E equal experts
    assert total == sum(p.numel() for p in theirs.parameters())
    # the model card's "30.5B" and "3.3B activated" are these counts cut to one decimal:
    # 30.53 B and 3.35 B (all weights a token touches, the embedding and the head included)
    assert int(total / 1e8) == 305
    assert int(active / 1e8) == 33


def test_30b_without_weights_says_what_is_missing_and_the_memory(tmp_path, real_30b):
    _, _, theirs = real_30b
    shutil.copy(CONFIG_30B / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError) as err:
        qwen_mini.load_model(tmp_path)
    message = str(err.value)
    assert "no weights found" in message and "model.safetensors" in message
    # counted from transformers' model; 2 bytes a parameter (config.json: torch_dtype bfloat16)
    assert json.loads((CONFIG_30B / "config.json").read_text())["torch_dtype"] == "bfloat16"
    total = sum(p.numel() for p in theirs.parameters())
    assert f"{18_867:,} tensors, {total / 1e9:.1f} B parameters" in message
    assert f"{2 * total / 1e9:.1f} GB in bfloat16" in message
