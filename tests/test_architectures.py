"""The architecture table: the one source of per-architecture facts, and the one way to build a
model from other blocks; the frozen config it reads."""

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from helpers import hf_config, hf_logits, tiny_config, write_checkpoint

import qwen_mini
from qwen_mini import ARCHITECTURES, CausalLM, Config
from qwen_mini.architectures import check_config, config_from_dict
from qwen_mini.attention import Attention, GatedAttention
from qwen_mini.checkpoint import meta_model
from qwen_mini.families import FAMILIES, family_of

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"


# --- the config -----------------------------------------------------------------------------


def test_a_tiny_config_is_one_short_line_and_derives_the_rest():
    cfg = Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    assert cfg.head_dim == 16  # hidden_size // num_attention_heads when not given
    assert cfg.layer_types == ("full_attention",) * 3
    assert Config(head_dim=128).head_dim == 128  # a stated head_dim wins (Qwen3-0.6B: 128 != 64)


def test_the_config_is_frozen():
    cfg = Config(hidden_size=64, num_attention_heads=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_key_value_heads = 1
    changed = dataclasses.replace(cfg, num_key_value_heads=1)
    assert changed.num_key_value_heads == 1 and cfg.num_key_value_heads == 8


def test_config_and_table_have_no_import_circle():
    source = (Path(qwen_mini.__file__).parent / "config.py").read_text()
    assert "architectures" not in re.sub(r'"""[\s\S]*?"""', "", source)  # docstrings aside


# --- the row decides the blocks' flags --------------------------------------------------------


def _hf_keys(model_type: str, **overrides) -> set[str]:
    config = hf_config(model_type, **overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return set(model.state_dict())


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        pytest.param("qwen3", {}, id="qwen3-qk-norm"),
        pytest.param("qwen3", {"attention_bias": True}, id="qwen3-attention-bias"),
        pytest.param("qwen2", {}, id="qwen2-qkv-bias"),
        pytest.param("qwen2", {"attention_bias": True}, id="qwen2-ignores-attention-bias"),
    ],
)
def test_biases_and_qk_norm_come_from_the_row(model_type, overrides):
    """The tensors a model_type has are transformers' (the oracle), whatever the config says:
    a qwen3 config cannot describe a qwen3 without QK-Norm."""
    cfg = config_from_dict(tiny_config(model_type, **overrides))
    assert set(meta_model(cfg).state_dict()) == _hf_keys(model_type, **overrides)


def test_a_qwen3_config_always_builds_qk_norm():
    model = CausalLM(Config(num_hidden_layers=1, hidden_size=32, num_attention_heads=2))
    assert model.model.layers[0].self_attn.q_norm is not None


@pytest.mark.parametrize(
    "model_type, field, hf_config_class",
    [
        pytest.param("qwen3_moe", "norm_topk_prob", "Qwen3MoeConfig", id="qwen3_moe"),
        pytest.param("qwen3_5_text", "partial_rotary_factor", "Qwen3_5TextConfig", id="qwen3_5"),
    ],
)
def test_per_type_defaults_are_transformers_defaults(model_type, field, hf_config_class):
    """A config.json that leaves the field out means transformers' default for that type."""
    d = copy.deepcopy(tiny_config(model_type))
    d.pop(field, None)
    d.get("rope_parameters", {}).pop(field, None)
    hf = getattr(transformers, hf_config_class)()
    expected = getattr(hf, field, None)
    if expected is None:  # transformers 5 keeps RoPE settings in rope_parameters
        expected = hf.rope_parameters[field]
    assert getattr(config_from_dict(d), field) == expected


# --- one check of a config against its row ----------------------------------------------------


def test_check_config_names_the_field():
    with pytest.raises(ValueError, match="layer_types must name one mixer per layer"):
        check_config(
            Config(num_hidden_layers=2, layer_types=("full_attention",)), ARCHITECTURES["qwen3"]
        )
    with pytest.raises(ValueError, match="'sliding_attention'"):
        check_config(
            Config(num_hidden_layers=1, layer_types=("sliding_attention",)), ARCHITECTURES["qwen3"]
        )
    no_deltanet = Config(
        model_type="qwen3_5_text", num_hidden_layers=1, layer_types=("linear_attention",)
    )
    with pytest.raises(
        ValueError, match=r"linear_attention layers \(GatedDeltaNet\) need linear_num_key_heads"
    ):
        CausalLM(no_deltanet)  # the model checks it too, before building anything
    with pytest.raises(ValueError, match="model_type 'llama'"):
        CausalLM(Config(model_type="llama"))


# --- building from given blocks ----------------------------------------------------------------


class DoubledAttention(Attention):
    """A learner's block: attention whose output is doubled (to see that it ran)."""

    def forward(self, x, cos, sin, cache=None):
        return 2 * super().forward(x, cos, sin, cache)


def test_with_blocks_replaces_only_the_named_blocks():
    row = ARCHITECTURES["qwen3"].with_blocks(mixers={"full_attention": DoubledAttention})
    assert row.mixers["full_attention"] is DoubledAttention and row.qk_norm
    assert ARCHITECTURES["qwen3"].mixers["full_attention"] is Attention  # the table unchanged
    qwen35 = ARCHITECTURES["qwen3_5"].with_blocks(mixers={"full_attention": DoubledAttention})
    assert set(qwen35.mixers) == {"full_attention", "linear_attention"}  # the other one kept
    with pytest.raises(TypeError, match="qk_norm"):
        ARCHITECTURES["qwen3"].with_blocks(qk_norm=False)  # a flag, not a block: use replace


def test_real_weights_load_into_given_blocks(tmp_path):
    """load_model(folder, arch=row): the checkpoint's weights in the learner's blocks. Doubled
    attention must change the logits; the plain Attention subclass must equal transformers."""
    hf = write_checkpoint(tmp_path, "qwen3", tied=False)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])

    class Same(Attention):
        pass

    same = qwen_mini.load_model(
        tmp_path, arch=ARCHITECTURES["qwen3"].with_blocks(mixers={"full_attention": Same})
    )
    assert type(same.model.layers[1].self_attn) is Same
    with torch.no_grad():
        torch.testing.assert_close(same(ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
        doubled = qwen_mini.load_model(
            tmp_path,
            arch=ARCHITECTURES["qwen3"].with_blocks(mixers={"full_attention": DoubledAttention}),
        )
        assert (doubled(ids) - hf_logits(hf, ids)).abs().max() > 1e-2


class DoubledGatedAttention(GatedAttention):
    def forward(self, x, cos, sin, cache=None):
        return 2 * super().forward(x, cos, sin, cache)


def test_the_standin_builds_from_given_blocks():
    row = ARCHITECTURES["qwen3_5"].with_blocks(mixers={"full_attention": DoubledGatedAttention})
    model = qwen_mini.load_model("Qwen/Qwen3.5-0.8B", arch=row)
    assert model.is_standin
    kinds = {type(layer.mixer) for layer in model.model.layers}
    assert DoubledGatedAttention in kinds and len(kinds) == 2
    plain = qwen_mini.load_model("Qwen/Qwen3.5-0.8B")  # the same stand-in weights
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert (model(ids) - plain(ids)).abs().max() > 1e-3  # the given block ran


# --- notebooks build their models through the table, never by patching -----------------------

PATCHING = {
    r"\.__class__\s*=(?!=)": "assigns __class__",
    r"__globals__": "rewrites a function's globals",
    r"^\s*qwen_mini(\.\w+)+\s*=(?!=)": "assigns an attribute of qwen_mini",
    r"setattr\(\s*qwen_mini": "sets an attribute of qwen_mini",
    # (a module's own __init__ assigns self.mlp = ...: that is building, not patching)
    r"(?<!self)\.(mlp|self_attn|linear_attn|layers|mixer)\s*=(?!=)": "replaces a built block",
    r"\.config\.\w+\s*=(?!=)": "changes a model's config after it is built",
}


@pytest.mark.parametrize("notebook", sorted(SOLUTIONS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_no_notebook_patches_a_model(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        text = "".join(cell["source"])
        for pattern, what in PATCHING.items():
            found = re.search(pattern, text, re.M)
            assert found is None, f"{notebook.name}, cell {i}: {what}: {found.group(0)!r}"


def test_the_scan_finds_the_patches_it_forbids():
    assert not any(re.search(p, "        self.mlp = mlp", re.M) for p in PATCHING)
    for line in (
        "layer.self_attn.__class__ = RopeThenNorm",
        "names = f.__globals__",
        "qwen_mini.attention.repeat_kv = tiled",
        "    layer.mlp = make(mlp)",
        "m.model.layers = nn.ModuleList(layers)",
        "model.config.num_key_value_heads = 1",
    ):
        assert any(re.search(p, line, re.M) for p in PATCHING), line


# --- families ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "repo, family",
    [
        pytest.param("Qwen/Qwen3-0.6B", "qwen3", id="qwen3"),
        pytest.param("qwen2.5-7b-instruct", "qwen3", id="qwen2.5-no-org"),
        pytest.param("Qwen/Qwen2-1.5B", "qwen3", id="qwen2"),
        pytest.param("Qwen/Qwen1.5-MoE-A2.7B", "qwen3", id="qwen1.5-moe"),
        pytest.param("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3", id="qwen3-next"),
        pytest.param("Qwen/Qwen3.5-35B-A3B", "qwen3_5", id="qwen3.5-moe"),
        pytest.param("Qwen/Qwen3.5-0.8B", "qwen3_5", id="qwen3.5"),
        pytest.param("Qwen/Qwen3.6-27B", "qwen3_5", id="qwen3.6"),
        pytest.param("Qwen/Qwen3.50-X", None, id="not-a-version"),
        pytest.param("meta-llama/Llama-3-8B", None, id="other"),
    ],
)
def test_family_of_a_repository_name(repo, family):
    found = family_of(repo)
    assert (found.name if found else None) == family


def test_every_row_names_a_known_family():
    assert {row.family.name for row in ARCHITECTURES.values()} == set(FAMILIES)
