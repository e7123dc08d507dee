"""Loading checkpoint folders: against transformers, and every way a folder can be broken."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers import hf_logits, write_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from qwen_mini import CheckpointError
from qwen_mini.architectures import config_from_dict, config_from_file
from qwen_mini.checkpoint import expected_shapes, load_checkpoint

IDS = torch.tensor([[3, 17, 99, 42, 5, 64, 120, 7], [1, 2, 3, 4, 5, 6, 7, 8]])


def read_all(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}


@pytest.mark.parametrize(
    "model_type, tied, shards", [("qwen3", True, None), ("qwen2", False, "20KB")]
)
def test_logits_match_transformers(tmp_path, model_type, tied, shards):
    hf = write_checkpoint(tmp_path, model_type, tied=tied, max_shard_size=shards)
    if shards:
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_checkpoint(tmp_path)
    want = hf_logits(hf, IDS)
    with torch.no_grad():
        got = ours(IDS)
    assert want.std() > 0.5  # logits far from zero: a wrong model could not pass by accident
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert ours.source == str(tmp_path) and ours.is_standin is False


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_expected_shapes_are_what_transformers_writes(tmp_path, model_type, tied):
    """The names and shapes read off our meta model equal those transformers saves."""
    write_checkpoint(tmp_path, model_type, tied=tied, num_hidden_layers=3, attention_bias=True)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    cfg = config_from_file(tmp_path / "config.json")
    assert expected_shapes(cfg) == saved


@pytest.mark.parametrize("head", ["copy of the embedding", "different"])
def test_stored_head_of_tied_checkpoint_as_transformers_reads_it(tmp_path, head):
    """The real Qwen3-0.6B file stores lm_head.weight although the head is tied: a copy of the
    embedding keeps the head tied; a different head is used untied, as transformers does (it
    warns and does not tie), with a notice."""
    from transformers import AutoModelForCausalLM

    write_checkpoint(tmp_path, "qwen3", tied=True)
    tensors = read_all(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.clone() if head != "different" else torch.randn_like(embed)
    save_file(tensors, tmp_path / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = load_checkpoint(tmp_path)
    tied = head != "different"
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    notices = [w for w in caught if "differs from the embedding" in str(w.message)]
    assert len(notices) == (0 if tied else 1)
    with torch.no_grad():
        want = hf_logits(reference, IDS)
        assert want.std() > 0.5
        torch.testing.assert_close(ours(IDS), want, atol=1e-4, rtol=0)


def test_dtype_kept_or_converted(tmp_path):
    write_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16)
    stored = read_all(tmp_path / "model.safetensors")["model.layers.1.mlp.up_proj.weight"]
    kept = load_checkpoint(tmp_path)
    assert {p.dtype for p in kept.parameters()} == {torch.bfloat16}
    for dtype in (torch.float32, "float32"):
        converted = load_checkpoint(tmp_path, dtype=dtype)
        assert {p.dtype for p in converted.parameters()} == {torch.float32}
        w = converted.model.layers[1].mlp.up_proj.weight
        assert torch.equal(w, stored.float())
    assert converted.lm_head.weight is converted.model.embed_tokens.weight


def test_generation_config_attached(tmp_path):
    write_checkpoint(tmp_path, "qwen2")
    gen = {"do_sample": True, "temperature": 0.7, "eos_token_id": [151645, 151643]}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert load_checkpoint(tmp_path).generation_config == gen
    (tmp_path / "generation_config.json").unlink()
    assert load_checkpoint(tmp_path).generation_config == {}


# --- broken folders -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """One single-file and one sharded checkpoint; each test breaks a copy."""
    root = tmp_path_factory.mktemp("good")
    write_checkpoint(root / "single", "qwen3")
    write_checkpoint(root / "sharded", "qwen3", max_shard_size="20KB")
    return root


def edit_config(folder, **fields):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **fields}))


def edit_tensors(path, edit):
    tensors = read_all(path)
    edit(tensors)
    save_file(tensors, path)


def break_missing(f):
    edit_tensors(f / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    return "model.safetensors", "model.layers.1.mlp.down_proj.weight", "missing"


def break_unexpected(f):
    extra = "model.layers.7.mlp.up_proj.weight"
    edit_tensors(f / "model.safetensors", lambda t: t.update({extra: torch.zeros(64, 32)}))
    return "model.safetensors", extra, "num_hidden_layers"


def break_shape(f):
    edit_config(f, intermediate_size=96)  # weights were written with 64
    return "model.safetensors", "model.layers.0.mlp.", "intermediate_size = 96"


def break_truncated(f):
    data = (f / "model.safetensors").read_bytes()
    (f / "model.safetensors").write_bytes(data[:-100])
    return "model.safetensors", "model.", "truncated"


def break_header(f):
    data = bytearray((f / "model.safetensors").read_bytes())
    data[8:20] = b"not json!!!!"
    (f / "model.safetensors").write_bytes(bytes(data))
    return "model.safetensors", "", "not valid JSON"


def break_missing_config(f):
    (f / "config.json").unlink()
    return "config.json", "", "missing"


def break_model_type(f):
    edit_config(f, model_type="llama")
    return "config.json", "", "qwen3"


def break_pickle_only(f):
    (f / "model.safetensors").rename(f / "pytorch_model.bin")
    return "pytorch_model.bin", "", "safetensors"


def index_of(f):
    return json.loads((f / "model.safetensors.index.json").read_text())


def break_missing_shard(f):
    name, shard = next(iter(index_of(f)["weight_map"].items()))
    (f / shard).unlink()
    return shard, name, "missing shard"


def break_wrong_shard(f):
    index = index_of(f)
    names = list(index["weight_map"])
    a, b = (
        names[0],
        next(n for n in names if index["weight_map"][n] != index["weight_map"][names[0]]),
    )
    index["weight_map"][a] = index["weight_map"][b]  # points at a shard that lacks it
    (f / "model.safetensors.index.json").write_text(json.dumps(index))
    return index["weight_map"][b], a, "does not contain"


BREAKS = {
    "single": [break_missing, break_unexpected, break_shape, break_truncated, break_header,
               break_missing_config, break_model_type, break_pickle_only],
    "sharded": [break_missing_shard, break_wrong_shard],
}  # fmt: skip


@pytest.mark.parametrize(
    "kind, breaker",
    [(k, b) for k, bs in BREAKS.items() for b in bs],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_broken_checkpoint_is_named(good, tmp_path, kind, breaker):
    folder = shutil.copytree(good / kind, tmp_path / kind)
    file, tensor, words = breaker(folder)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    message = str(e.value)
    assert isinstance(e.value, ValueError)
    assert file in message and tensor in message and words in message, message


def test_peak_memory_of_bf16_load_is_about_the_file(tmp_path):
    """Loading bf16 into bf16 maps the file: resident memory grows by the file, not twice."""
    # tied, as the real model: the head reads every row of the embedding, so every page is read
    cfg = dict(model_type="qwen3", vocab_size=151936, hidden_size=768, intermediate_size=1024,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    shapes = expected_shapes(config_from_dict(cfg))
    tensors = {k: torch.empty(s, dtype=torch.bfloat16).uniform_(-0.1, 0.1, generator=g)
               for k, s in shapes.items()}  # fmt: skip
    save_file(tensors, tmp_path / "model.safetensors")
    del tensors
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    script = textwrap.dedent(f"""
        import os, torch
        from qwen_mini.checkpoint import load_checkpoint
        def kib(key):
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
        with torch.no_grad():
            torch.nn.Linear(8, 8)(torch.ones(2, 8, dtype=torch.float32))  # warm up the kernels
        base = kib("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # restart the peak count from here
        model = load_checkpoint({str(tmp_path)!r})
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))  # reads every weight page
        size = os.path.getsize({str(tmp_path / "model.safetensors")!r})
        print((kib("VmHWM") - base) * 1024, size)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    peak, size = map(int, out.stdout.split())
    assert size > 200e6
    assert peak <= 1.2 * size, f"peak {peak / 1e6:.0f} MB for a {size / 1e6:.0f} MB file"


def test_meta_build_skips_the_random_init_of_every_module_type():
    """Conv1d (Gated DeltaNet), Embedding, Linear: all initialise through torch.nn.init, which
    the meta build silences, and restores afterwards."""
    from qwen_mini.checkpoint import without_init

    with without_init():
        layers = [
            torch.nn.Conv1d(4, 4, 3, groups=4),
            torch.nn.Embedding(5, 4),
            torch.nn.Linear(4, 4),
        ]
        for layer in layers:
            with torch.no_grad():
                layer.weight.fill_(7.0)
            layer.reset_parameters()  # what the constructor called: now a no-op
            assert torch.all(layer.weight == 7.0), type(layer).__name__
    layer = torch.nn.Linear(4, 4)
    with torch.no_grad():
        layer.weight.fill_(7.0)
    layer.reset_parameters()
    assert not torch.all(layer.weight == 7.0)  # restored
