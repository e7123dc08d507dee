"""qwen_mini against transformers at the exact real shapes of Qwen3-0.6B and Qwen2.5-0.5B.

The real weights cannot be downloaded here, so transformers builds each model with random
weights from the real `config.json` (verbatim copies in assets/configs/) and saves it in
bfloat16 as one `model.safetensors`, as the released files are. The folder then gets the verbatim
config.json back (transformers rewrites it in its own newer format), so both loaders read the
file the real download has. Both libraries load that folder; the logits must agree.
"""

from __future__ import annotations

import gc
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import qwen_mini
from qwen_mini.config import ASSETS

pytestmark = pytest.mark.slow

CONFIGS = ASSETS / "configs"
TOL = 1e-4

# The published parameter counts. Both models tie lm_head to the embedding: the unique count has
# the embedding once; the key count is the model's state dict, which lists lm_head.weight too.
FACTS = {
    "qwen3-0.6b": {"params": 596_049_920, "state_dict_keys": 311},
    "qwen2.5-0.5b": {"params": 494_032_768, "state_dict_keys": 291},
}


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a tied Qwen2/Qwen3 checkpoint stores, written out from the config alone."""
    V, H, I = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    Q, KV = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"{p}{norm}.weight"] = (H,)
        for proj, shape in (("q", (Q, H)), ("k", (KV, H)), ("v", (KV, H)), ("o", (H, Q))):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = shape
            if cfg["model_type"] == "qwen2" and proj != "o":  # Qwen2: QKV bias
                shapes[f"{p}self_attn.{proj}_proj.bias"] = shape[:1]
        if cfg["model_type"] == "qwen3":  # Qwen3: QK-Norm over each head
            shapes[f"{p}self_attn.q_norm.weight"] = shapes[f"{p}self_attn.k_norm.weight"] = (D,)
        for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            shapes[f"{p}mlp.{proj}_proj.weight"] = shape
    return shapes


@pytest.fixture(scope="module", params=list(FACTS))
def real(request, tmp_path_factory):
    """(name, folder, prompt, transformers' float32 and bfloat16 logits) for one real config."""
    name = request.param
    src = CONFIGS / name
    folder = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
    assert len(model.state_dict()) == FACTS[name]["state_dict_keys"]
    prompt = torch.randint(0, 151_643, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():  # the writer holds exactly the saved bf16 weights
        logits_bf16 = model(prompt).logits.float()
    model.save_pretrained(folder, max_shard_size="10GB")  # one file, as released
    del model
    gc.collect()  # the next model needs the memory
    for f in src.iterdir():  # the verbatim files, as a download has them
        shutil.copy(f, folder / f.name)

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = ref(prompt).logits
    del ref
    gc.collect()  # the next model needs the memory
    yield name, folder, prompt, logits, logits_bf16
    shutil.rmtree(folder)


def test_file_has_real_names_shapes_dtype(real):
    name, folder, *_ = real
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["tie_word_embeddings"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_slice(k) for k in f.keys()}
        shapes = {k: tuple(s.get_shape()) for k, s in stored.items()}
        dtypes = {s.get_dtype() for s in stored.values()}
    assert not (folder / "model.safetensors.index.json").exists()
    # save_pretrained leaves out the tied head: one key fewer than the state dict
    assert shapes == expected_shapes(cfg)
    assert len(shapes) == FACTS[name]["state_dict_keys"] - 1
    assert dtypes == {"BF16"}
    unique = sum(torch.Size(s).numel() for s in shapes.values())
    assert unique == FACTS[name]["params"]


def test_float32_logits_match_transformers(real):
    _, folder, prompt, expected, _ = real
    ours = qwen_mini.load_model(folder, dtype=torch.float32)
    with torch.inference_mode():
        got = ours(prompt)
    del ours
    gc.collect()  # the next model needs the memory
    # bf16 -> fp32 is exact, so both sides hold bit-identical weights
    assert (got - expected).abs().max().item() <= TOL


def test_bfloat16_runs_and_stays_close(real):
    _, folder, prompt, expected, ref_bf16 = real
    ours = qwen_mini.load_model(folder, dtype=torch.bfloat16)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        got = ours(prompt).float()
    del ours
    gc.collect()  # the next model needs the memory
    # bf16 keeps 8 significant bits, and every matmul output and the residual stream are rounded
    # to them 24-28 layers deep: on these weights the max logit error is ~8 % of the logits'
    # std, whoever computes it. So the yardstick is transformers' own bf16 error: ours may be at
    # most 1.5x as far from the float32 logits (measured: ours and transformers' bf16 logits are
    # identical). An RMSNorm or RoPE done in bf16 instead of float32 would show up here. Every
    # position must also keep a nearly parallel logit vector (cosine > 0.999; measured 0.9998).
    ref_err = (ref_bf16 - expected).abs().max().item()
    err = (got - expected).abs().max().item()
    assert err <= 1.5 * ref_err, f"bf16 error {err:.3g}; transformers' own bf16 error {ref_err:.3g}"
    cos = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cos.min().item() > 0.999


def test_tied_checkpoint_with_stored_head_copy_loads(real, tmp_path):
    """A tied checkpoint may also store lm_head.weight, a copy of the embedding (the released
    Qwen3-0.6B file does): it loads, and the head stays the embedding."""
    name, folder, prompt, expected, _ = real
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    del tensors
    for f in (CONFIGS / name).iterdir():
        shutil.copy(f, tmp_path / f.name)
    try:
        with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
            assert len(f.keys()) == FACTS[name]["state_dict_keys"]  # 311 for 0.6B, as released
        ours = qwen_mini.load_model(tmp_path, dtype=torch.float32)
        assert ours.lm_head.weight is ours.model.embed_tokens.weight  # still one tensor
        with torch.inference_mode():
            got = ours(prompt)
        del ours
        gc.collect()
    finally:  # pytest keeps recent tmp folders: do not leave 1.5 GB behind
        (tmp_path / "model.safetensors").unlink()
    assert (got - expected).abs().max().item() <= TOL
