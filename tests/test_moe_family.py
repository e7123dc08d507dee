"""Qwen2-MoE, Qwen3-Next and Qwen3.5-MoE beyond the logits of test_oracle.py (whose cases for
these types vary expert counts, k, renormalisation, shared-expert widths, sparse steps and dense
layers, layer patterns, KV and value-head ratios and partial RoPE, each on a full batch, cached
decode and a prompt fed in pieces, tied, untied and sharded): Qwen3-Next's fused DeltaNet
projections against transformers' own split, both stored layouts of the experts, the config
fields each type reads or refuses, and the real configurations on the meta device."""

from __future__ import annotations

import json
import re
import resource
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers import HF_CLASSES, randomize, stored_layout, tiny_config, write_checkpoint
from safetensors.torch import load_file, save_file
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3_next import modeling_qwen3_next

import qwen_mini
from qwen_mini.architectures import config_from_dict, config_from_file
from qwen_mini.checkpoint import CheckpointError, expected_shapes, meta_model
from qwen_mini.deltanet import GatedDeltaNet
from qwen_mini.fused_deltanet import FusedGatedDeltaNet, fused_projection_order
from qwen_mini.moe import SharedExpertMoeBlock
from qwen_mini.validation import ConfigError

TOL = 1e-4  # as test_oracle.py: max abs logit difference, float32 both sides
REAL = qwen_mini.ASSETS / "configs"  # the reconstructed ones: see each folder's PROVENANCE.md

# --- Qwen3-Next's fused projections: a fixed permutation of Qwen3.5's four ---------------------


def test_fused_order_by_hand():
    """Two key heads, four value heads, every head one dimension wide. Qwen3.5's rows: q 0-1,
    k 2-3, v 4-7 (in_proj_qkv), z 8-11, b 12-15, a 16-19. Qwen3-Next groups by key head:
    head 0 is q0 k0 v0 v1 z0 z1, head 1 is q1 k1 v2 v3 z2 z3; then b0 b1 a0 a1, b2 b3 a2 a3."""
    qkvz = [0, 2, 4, 5, 8, 9] + [1, 3, 6, 7, 10, 11]
    ba = [12, 13, 16, 17] + [14, 15, 18, 19]
    assert fused_projection_order(2, 1, 4, 1).tolist() == qkvz + ba
    # one key head: the fused projections are the four stacked, in order
    assert fused_projection_order(1, 3, 2, 2).tolist() == list(range(2 * 3 + 2 * 4 + 2 * 2))


# (key heads, key dim, value heads, value dim): value heads per key head 1, 2, 4; d_k != d_v
SHAPES = [(2, 8, 2, 8), (2, 8, 4, 6), (1, 4, 4, 8), (4, 6, 8, 4)]


def hf_gated_deltanet(n_k, d_k, n_v, d_v, hidden=24):
    config = transformers.Qwen3NextConfig(
        hidden_size=hidden, num_hidden_layers=1, layer_types=["linear_attention"],
        linear_num_key_heads=n_k, linear_key_head_dim=d_k, linear_num_value_heads=n_v,
        linear_value_head_dim=d_v, linear_conv_kernel_dim=4,
    )  # fmt: skip
    return randomize(
        modeling_qwen3_next.Qwen3NextGatedDeltaNet(config, 0), seed=n_k + n_v
    ).eval(), config


@pytest.mark.parametrize("n_k, d_k, n_v, d_v", SHAPES)
def test_fused_order_is_transformers_split(n_k, d_k, n_v, d_v):
    """Qwen3.5's projections taken out of the fused weights by the permutation give exactly
    the q, k, v, z, b, a that transformers' Qwen3-Next splits its fused outputs into."""
    hf, _ = hf_gated_deltanet(n_k, d_k, n_v, d_v)
    x = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, k, v, z, b, a = hf.fix_query_key_value_ordering(hf.in_proj_qkvz(x), hf.in_proj_ba(x))
        fused = torch.cat([hf.in_proj_qkvz.weight, hf.in_proj_ba.weight])
        qwen3_5 = fused[fused_projection_order(n_k, d_k, n_v, d_v).argsort()]
        key, value = n_k * d_k, n_v * d_v
        rows = x @ qwen3_5.T  # [2, 5, rows] in Qwen3.5's order: q | k | v | z | b | a
        ours = rows.split([key, key, value, value, n_v, n_v], dim=-1)
    theirs = [t.reshape(2, 5, -1) for t in (q, k, v, z, b, a)]
    for name, got, want in zip("qkvzba", ours, theirs, strict=True):
        assert torch.allclose(got, want, atol=1e-6), name


@pytest.mark.parametrize("n_k, d_k, n_v, d_v", SHAPES)
def test_fused_layer_equals_qwen3_5_layer_and_transformers(n_k, d_k, n_v, d_v):
    """The same weights, fused (Qwen3-Next) or permuted into four projections (Qwen3.5): one
    function; and the fused layer is transformers' Qwen3-Next layer."""
    hf, config = hf_gated_deltanet(n_k, d_k, n_v, d_v)
    cfg = qwen_mini.Config(
        hidden_size=24, num_hidden_layers=1, layer_types=("linear_attention",),
        linear_num_key_heads=n_k, linear_key_head_dim=d_k, linear_num_value_heads=n_v,
        linear_value_head_dim=d_v, linear_conv_kernel_dim=4,
    )  # fmt: skip
    fused, plain = FusedGatedDeltaNet(cfg).eval(), GatedDeltaNet(cfg).eval()
    fused.load_state_dict(hf.state_dict())
    state = dict(hf.state_dict())
    rows = torch.cat([state.pop("in_proj_qkvz.weight"), state.pop("in_proj_ba.weight")])
    rows = rows[fused_projection_order(n_k, d_k, n_v, d_v).argsort()]
    conv, value = fused.conv_dim, n_v * d_v
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    for name, w in zip(names, rows.split([conv, value, n_v, n_v]), strict=True):
        state[f"{name}.weight"] = w
    plain.load_state_dict(state)
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x)
        assert (fused(x) - expected).abs().max() <= 1e-5
        assert (plain(x) - expected).abs().max() <= 1e-5


# --- the two stored layouts of the experts -------------------------------------------------------

ONE_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(src: Path, dst: Path) -> None:
    """A copy of checkpoint folder `src` with its experts stored as the released Qwen3.5-MoE
    files store them: per layer experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and
    experts.down_proj [E, H, I]."""
    tensors, experts = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        m = ONE_EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {})[int(m.group(2)), m.group(3)] = t
        else:
            tensors[name] = t
    for prefix, parts in experts.items():
        E = 1 + max(e for e, _ in parts)
        gate_up = [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(E)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(E)])
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


MOE_TYPES = ["qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"]


@pytest.fixture(scope="module", params=MOE_TYPES)
def layouts(request, tmp_path_factory):
    """(model_type, transformers' model, its per-expert folder, the same weights fused)."""
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    hf = write_checkpoint(root / "per-expert", model_type, tied=False, num_experts=6)
    fuse_experts(root / "per-expert", root / "fused")
    return model_type, hf, root / "per-expert", root / "fused"


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(seed))


def test_files_are_the_two_layouts(layouts):
    """What transformers writes is one by one; the fused copy is what transformers reads as the
    same model (so it is the released layout as transformers understands it)."""
    model_type, hf, per_expert, fused = layouts
    written = {k: tuple(v.shape) for k, v in load_file(per_expert / "model.safetensors").items()}
    assert written == stored_layout({k: tuple(v.shape) for k, v in hf.state_dict().items()})
    assert any(k.endswith("experts.5.down_proj.weight") for k in written)
    reread = HF_CLASSES[model_type][1].from_pretrained(fused, dtype=torch.float32).eval()
    ids = prompt(9)
    with torch.no_grad():
        assert (reread(ids).logits - hf(ids).logits).abs().max() <= 1e-5


def test_model_holds_the_layout_of_transformers_state_dict(layouts):
    """qwen3_next and qwen3_5_moe hold their experts fused, as transformers' modules do (the
    layout of the Qwen3.5-MoE releases); qwen2_moe one by one, as its checkpoints store them."""
    model_type, hf, per_expert, _ = layouts
    cfg = config_from_file(per_expert / "config.json")
    ours = expected_shapes(cfg)
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items() if "visual" not in k}
    assert ours == (stored_layout(theirs) if model_type == "qwen2_moe" else theirs)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_both_layouts_give_transformers_logits(layouts, layout):
    model_type, hf, per_expert, fused = layouts
    ours = qwen_mini.load_model(per_expert if layout == "per-expert" else fused)
    ids = prompt(12)
    with torch.inference_mode():
        expected = hf(ids).logits
        assert (ours(ids) - expected).abs().max() <= TOL
        cache = ours.new_cache(batch_size=2)  # the prompt in pieces, then token by token
        pieces = [ids[:, :5], ids[:, 5:6], ids[:, 6:7], ids[:, 7:]]
        got = torch.cat([ours(p, cache=cache) for p in pieces], dim=1)
    assert (got - expected).abs().max() <= TOL


def test_a_fused_tensor_of_the_wrong_shape_is_named(layouts, tmp_path):
    model_type, _, _, fused = layouts
    tensors = load_file(fused / "model.safetensors")
    name = next(k for k in tensors if k.endswith("layers.0.mlp.experts.gate_up_proj"))
    tensors[name] = tensors[name][:5]  # one expert short
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(fused / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=re.escape(name)) as err:
        qwen_mini.load_model(tmp_path)
    assert "[5, 32, 32]" in str(err.value) and "num_experts" in str(err.value)


# --- the config fields each type reads, with transformers' defaults, or refuses ----------------

DEFAULTS = [
    ("qwen2_moe", "norm_topk_prob"), ("qwen2_moe", "qkv_bias"), ("qwen2_moe", "num_experts"),
    ("qwen2_moe", "num_experts_per_tok"), ("qwen2_moe", "moe_intermediate_size"),
    ("qwen2_moe", "shared_expert_intermediate_size"),
    ("qwen3_next", "norm_topk_prob"), ("qwen3_next", "partial_rotary_factor"),
    ("qwen3_next", "num_experts"), ("qwen3_next", "shared_expert_intermediate_size"),
    ("qwen3_next", "linear_num_value_heads"), ("qwen3_next", "linear_conv_kernel_dim"),
    ("qwen3_5_moe_text", "num_experts"), ("qwen3_5_moe_text", "num_experts_per_tok"),
    ("qwen3_5_moe_text", "moe_intermediate_size"), ("qwen3_5_moe_text", "partial_rotary_factor"),
]  # fmt: skip


@pytest.mark.parametrize("model_type, field", DEFAULTS, ids=[f"{t}-{f}" for t, f in DEFAULTS])
def test_a_field_left_out_means_transformers_default(model_type, field):
    d = tiny_config(model_type, num_experts=16)  # as many as any default k routes to
    d.pop(field, None)
    d.get("rope_parameters", {}).pop(field, None)
    hf = HF_CLASSES[model_type][0]()
    expected = getattr(hf, field, None)
    if expected is None:  # transformers 5 keeps RoPE settings in rope_parameters
        expected = hf.rope_parameters[field]
    assert getattr(config_from_dict(d), field) == expected


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text", "qwen3_5_text"])
@pytest.mark.parametrize("interval", [None, 1, 2, 3])
def test_layer_types_left_out_follow_full_attention_interval(model_type, interval):
    d = tiny_config(model_type, num_hidden_layers=6)
    del d["layer_types"]
    if interval is not None:
        d["full_attention_interval"] = interval
    fields = {k: v for k, v in d.items() if k != "model_type"}
    assert config_from_dict(d).layer_types == tuple(HF_CLASSES[model_type][0](**fields).layer_types)


# model_type -> transformers' decoder layer and sparse block classes
HF_LAYERS = {
    "qwen2_moe": (
        modeling_qwen2_moe.Qwen2MoeDecoderLayer,
        modeling_qwen2_moe.Qwen2MoeSparseMoeBlock,
    ),
    "qwen3_next": (
        modeling_qwen3_next.Qwen3NextDecoderLayer,
        modeling_qwen3_next.Qwen3NextSparseMoeBlock,
    ),
}


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_next"])
@pytest.mark.parametrize("step, mlp_only", [(1, []), (2, []), (1, [0, 2]), (3, [1])])
def test_sparse_layers_are_those_of_transformers(model_type, step, mlp_only):
    d = tiny_config(model_type, num_hidden_layers=6, decoder_sparse_step=step)
    d.update(mlp_only_layers=mlp_only, layer_types=["linear_attention", "full_attention"] * 3)
    if model_type == "qwen2_moe":
        d["layer_types"] = ["full_attention"] * 6
    fields = {k: v for k, v in d.items() if k != "model_type"}
    hf_config = HF_CLASSES[model_type][0](**fields)
    layer, sparse = HF_LAYERS[model_type]
    model = meta_model(config_from_dict(d))
    for i in range(6):
        theirs = isinstance(layer(hf_config, i).mlp, sparse)
        assert isinstance(model.model.layers[i].mlp, SharedExpertMoeBlock) == theirs, i


@pytest.mark.parametrize(
    "field, value",
    [("norm_topk_prob", False), ("decoder_sparse_step", 2), ("mlp_only_layers", [1])],
)
@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_5_moe_text"])
def test_qwen3_5_moe_refuses_what_it_does_not_read(model_type, field, value):
    """Qwen3.5-MoE has experts in every layer and always renormalises: transformers ignores
    these fields, so a file that sets them otherwise describes another model, and is refused."""
    d = tiny_config(model_type)
    (d.get("text_config") or d)[field] = value
    with pytest.raises(ConfigError, match=f"{field} is .*this model type always has") as err:
        config_from_dict(d, "a/config.json")
    assert str(err.value).startswith("a/config.json")
    ok = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}[field]
    (d.get("text_config") or d)[field] = ok  # the value it always has is accepted
    assert config_from_dict(d).num_experts == 4


def test_qwen3_5_moe_needs_experts():
    with pytest.raises(ValueError, match="every layer.*num_experts"):
        config_from_dict(tiny_config("qwen3_5_moe_text", num_experts=0))


@pytest.mark.parametrize("max_window_layers", [0, 1, 3, 28])
def test_qwen2_moe_sliding_windows_refused_where_transformers_windows(max_window_layers):
    """Qwen2-MoE windows layers 0, 2, 4, ... below max_window_layers: refused exactly there."""
    d = tiny_config("qwen2_moe", num_hidden_layers=4, use_sliding_window=True, sliding_window=8)
    d["max_window_layers"] = max_window_layers
    fields = {k: v for k, v in d.items() if k != "model_type"}
    windowed = "sliding_attention" in HF_CLASSES["qwen2_moe"][0](**fields).layer_types
    if windowed:
        with pytest.raises(ConfigError, match="use_sliding_window.*layers 0"):
            config_from_dict(d)
    else:
        assert config_from_dict(d).layer_types == ("full_attention",) * 4


# --- the real configurations, on the meta device ------------------------------------------------

# folder -> the published sizes: total (billions, rounded) and active per token (the "A3B" of
# the name: billions, cut). These configs are reconstructions (each folder's PROVENANCE.md).
PUBLISHED = {
    "qwen3-next-80b-a3b-instruct": (80, 3),
    "qwen3.5-35b-a3b": (35, 3),
    "qwen3.6-35b-a3b": (35, 3),
    "qwen3.5-397b-a17b": (397, 17),
}


@pytest.fixture(scope="module", params=list(PUBLISHED))
def real(request):
    """(folder, our config, our meta model, transformers' meta model) of a real config."""
    folder = REAL / request.param
    cfg = config_from_file(folder / "config.json")
    ours = meta_model(cfg)
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        theirs = HF_CLASSES[cfg.model_type][1](hf_config)
    return folder, cfg, ours, theirs


def _text(model) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if ".visual." not in k}


def test_real_names_and_shapes_equal_transformers(real):
    folder, cfg, ours, theirs = real
    got = expected_shapes(cfg, ours)
    # the MTP head a config.json describes (mtp_num_hidden_layers: 1): transformers has none
    assert ("mtp.fc.weight" in got) == (cfg.mtp_num_hidden_layers == 1)
    got = {n: shape for n, shape in got.items() if not n.startswith("mtp.")}
    assert got == _text(theirs)  # both hold the experts fused
    assert all(p.is_meta for p in ours.parameters())  # nothing was allocated


def test_real_parameter_counts_are_the_published_sizes(real):
    folder, cfg, ours, theirs = real
    main = [(n, p) for n, p in ours.named_parameters() if not n.startswith("mtp.")]  # as theirs
    total = sum(p.numel() for _, p in main)
    experts = sum(p.numel() for n, p in main if ".mlp.experts." in n)
    assert total == sum(p.numel() for n, p in theirs.named_parameters() if ".visual." not in n)
    # every sparse layer has E equal experts of which a token uses k
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    with_vision = sum(p.numel() for p in theirs.parameters())
    billions, active_billions = PUBLISHED[folder.name]
    assert round(with_vision / 1e9) == billions
    assert int(active / 1e9) == active_billions


def test_real_config_without_weights_says_what_is_missing_and_the_memory(real, tmp_path):
    folder, cfg, ours, theirs = real
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(CheckpointError) as err:
        qwen_mini.load_model(tmp_path)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 2**20, f"{grown} KiB allocated"  # far from the tens of GB described
    message = str(err.value)
    assert "no weights found" in message and "model.safetensors" in message
    text = _text(theirs)
    # and the MTP head the config describes (transformers has none): the release carries it
    text |= {n: s for n, s in expected_shapes(cfg, ours).items() if n.startswith("mtp.")}
    total = sum(torch.Size(s).numel() for s in text.values())
    stated = json.loads((folder / "config.json").read_text())
    assert (stated.get("text_config") or stated).get("dtype", stated.get("torch_dtype")) == (
        "bfloat16"
    )
    # counted on the meta model, every one exactly (the 397B one too: its experts held fused)
    assert f"{len(text):,} tensors, {total / 1e9:.1f} B parameters" in message
    assert f"{2 * total / 1e9:.1f} GB in bfloat16" in message
