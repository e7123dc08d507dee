"""Model names: where they resolve, downloads on request, and the stand-in."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from safetensors.torch import save_file

from qwen_mini import CheckpointError, load_model
from qwen_mini.architectures import config_from_dict, config_from_file
from qwen_mini.checkpoint import expected_shapes
from qwen_mini.config import ASSETS
from qwen_mini.hub import DownloadError, describe, resolve, standin_help, standin_notice
from qwen_mini.locate import KNOWN_MODELS, find_local, hf_cache_dir
from qwen_mini.standin import STANDINS, load_standin

CONFIGS = ASSETS / "configs"
REAL = {
    "Qwen/Qwen3-0.6B": CONFIGS / "qwen3-0.6b",
    "Qwen/Qwen2.5-0.5B": CONFIGS / "qwen2.5-0.5b",
    "Qwen/Qwen3.5-0.8B": CONFIGS / "qwen3.5-0.8b",
}
QWEN3 = "Qwen/Qwen3-0.6B"
# what the stand-ins share with the real models (everything but the sizes)
SAME_AS_REAL = ("model_type", "vocab_size", "rope_theta", "max_position_embeddings",
                "tie_word_embeddings", "attention_bias", "dtype", "rms_norm_eps")  # fmt: skip


def write_tiny(folder: Path, value: float = 0.01) -> Path:
    """A valid tiny qwen3 checkpoint whose weights are all `value` (to tell folders apart)."""
    cfg = tiny_config(num_hidden_layers=1, tie_word_embeddings=True)
    folder.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(config_from_dict(cfg))
    save_file({k: torch.full(s, value) for k, s in shapes.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture
def env(tmp_path, monkeypatch):
    """No weights anywhere: an empty HF cache, no QWEN_MINI_* variables."""
    for var in ("QWEN_MINI_WEIGHTS", "QWEN_MINI_DOWNLOAD", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    return tmp_path


def add_to_hf_cache(root: Path, name: str, rev: str, complete: bool = True) -> Path:
    repo = root / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    if complete:
        write_tiny(snapshot)
    else:
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")  # config but no weights yet
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return snapshot


def test_resolution_order(env, monkeypatch):
    assert resolve(QWEN3).source == "stand-in" and resolve(QWEN3).path is None
    old = add_to_hf_cache(env / "hf", QWEN3, "aaaa")
    assert resolve(QWEN3).source == "hf-cache" and resolve(QWEN3).path == old
    new = add_to_hf_cache(env / "hf", QWEN3, "bbbb")  # refs/main now points here
    assert resolve(QWEN3).path == new
    monkeypatch.setenv("QWEN_MINI_WEIGHTS", str(env / "weights"))
    assert resolve(QWEN3).source == "hf-cache"  # the env folder has no such model yet
    mine = write_tiny(env / "weights" / "Qwen3-0.6B")
    assert (resolve(QWEN3).source, resolve(QWEN3).path) == ("env", mine)
    explicit = write_tiny(env / "elsewhere")
    assert (resolve(explicit).source, resolve(str(explicit)).path) == ("path", explicit)
    assert find_local(QWEN3) == mine and find_local(explicit) == explicit


def test_env_folder_with_org_and_short_names(env, monkeypatch):
    monkeypatch.setenv("QWEN_MINI_WEIGHTS", str(env / "weights"))
    folder = write_tiny(env / "weights" / "Qwen" / "Qwen2.5-0.5B")
    for name in ("Qwen/Qwen2.5-0.5B", "qwen2.5-0.5b", "Qwen2.5-0.5B"):
        assert resolve(name).path == folder and resolve(name).source == "env"


def test_incomplete_hf_snapshot_is_skipped(env):
    add_to_hf_cache(env / "hf", QWEN3, "cccc", complete=False)
    assert resolve(QWEN3).source == "stand-in"
    assert find_local(QWEN3) is None


def test_hf_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"


def test_load_model_reads_the_resolved_folder(env, monkeypatch, capsys):
    monkeypatch.setenv("QWEN_MINI_WEIGHTS", str(env / "weights"))
    folder = write_tiny(env / "weights" / "Qwen3-0.6B", value=0.25)
    model = load_model(QWEN3)
    assert not model.is_standin and model.source == str(folder)
    assert torch.all(model.model.layers[0].mlp.up_proj.weight == 0.25)
    out, err = capsys.readouterr()
    assert "stand-in" not in out + err  # real weights: no notice
    # a broken folder found by name fails loudly; it never falls back to the stand-in
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(QWEN3)


class FakeHub:
    """Stands in for huggingface_hub.snapshot_download: no network."""

    def __init__(self, root: Path, fail: Exception | None = None):
        self.root, self.fail, self.calls = root, fail, []

    def __call__(self, repo_id, allow_patterns=None, **kwargs):
        self.calls.append((repo_id, allow_patterns))
        if self.fail:
            raise self.fail
        return str(write_tiny(self.root / repo_id.replace("/", "--")))


def test_download_only_when_asked(env, monkeypatch):
    import huggingface_hub

    fake = FakeHub(env / "downloads")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve(QWEN3).source == "stand-in" and fake.calls == []
    found = resolve(QWEN3, download=True)
    assert found.source == "download" and found.path == env / "downloads" / "Qwen--Qwen3-0.6B"
    repo_id, patterns = fake.calls[0]
    assert repo_id == QWEN3 and "*.safetensors" in patterns and "*.bin" not in patterns
    monkeypatch.setenv("QWEN_MINI_DOWNLOAD", "1")
    model = load_model("qwen3-0.6b")
    assert not model.is_standin and model.source == str(found.path) and len(fake.calls) == 2


def test_download_errors_are_clear(env, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub(env, OSError("no route")))
    with pytest.raises(DownloadError, match="online"):
        resolve(QWEN3, download=True)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    with pytest.raises(DownloadError, match="pip install"):
        load_model(QWEN3, download=True)


def test_standin_with_notice(env, capsys):
    model = load_model(QWEN3)
    out, err = capsys.readouterr()
    assert model.is_standin and model.source == "stand-in" and out == ""
    assert (
        err == f"qwen_mini: no weights found for {QWEN3}; using its stand-in (tiny: simple "
        "English).\n"
    )
    more = standin_help(QWEN3)  # what the command line adds
    for words in ("Looked in", "QWEN_MINI_WEIGHTS", str(env / "hf"), "download=True",
                  "qwen-mini download Qwen/Qwen3-0.6B"):  # fmt: skip
        assert words in more, more


NOTEBOOK_CELL = """
import qwen_mini
model = qwen_mini.load_model("Qwen/Qwen3-0.6B")
"""


def test_in_a_notebook_the_standin_notice_is_one_plain_line(env):
    """Run in a real kernel: stderr would be shown in red, as an error."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK_CELL)])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert [(o.output_type, o.get("name")) for o in outputs] == [("stream", "stdout")], outputs
    assert outputs[0].text == standin_notice(QWEN3) + "\n"
    assert outputs[0].text.count("\n") == 1 and len(outputs[0].text) < 100


def test_load_model_on_a_device(env, tmp_path, capsys):
    folder = write_tiny(tmp_path / "w")
    for model in (load_model(folder, device="cpu"), load_model(QWEN3, device=torch.device("cpu"))):
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert model(torch.tensor([[1, 2, 3]])).shape[:2] == (1, 3)
    for device, problem in [("gpu", "unknown device 'gpu'"), ("meta", "holds no weights"),
                            (f"cuda:{torch.cuda.device_count()}", "not available")]:  # fmt: skip
        with pytest.raises(ValueError, match=problem):
            load_model(folder, device=device)
        with pytest.raises(ValueError, match=problem):
            load_model(QWEN3, device=device)
    capsys.readouterr()


@pytest.mark.parametrize("name", list(KNOWN_MODELS))
def test_standin_has_the_real_architecture(name):
    model = load_standin(name)
    ours, real = model.config, config_from_file(REAL[name] / "config.json")
    for field in SAME_AS_REAL:
        assert getattr(ours, field) == getattr(real, field), field
    assert ours.num_key_value_heads < ours.num_attention_heads  # grouped, like the real ones
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert KNOWN_MODELS[name] == ours.model_type and set(STANDINS) == set(KNOWN_MODELS)
    if name == QWEN3:
        assert ours.head_dim * ours.num_attention_heads != ours.hidden_size
        real_gen = json.loads((REAL[name] / "generation_config.json").read_text())
        real_gen.pop("transformers_version")
        assert model.generation_config == real_gen


def test_standin_is_deterministic_and_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[151644, 872, 198, 9707, 151645, 151643]])
    a, b = load_standin(QWEN3, torch.float32), load_standin(QWEN3, torch.float32)
    with torch.no_grad():
        logits = a(ids)
        assert torch.equal(logits, b(ids))
    assert logits.std() > 0.1  # not a model that says the same about every token
    # the stand-in is a valid checkpoint of the real architecture: transformers agrees
    state = {k: v for k, v in a.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(STANDINS[QWEN3]["config"]))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(ids).logits, atol=1e-4, rtol=0)


def test_unknown_names_are_rejected(env):
    for name in ("Qwen/Qwen9-1B", "llama", "./no/such/folder"):
        with pytest.raises(ValueError, match="Qwen/Qwen3-0.6B, Qwen/Qwen2.5-0.5B"):
            load_model(name)


def test_describe(env, monkeypatch):
    assert "stand-in" in describe(QWEN3) and str(env / "hf") in describe(QWEN3)
    monkeypatch.setenv("QWEN_MINI_WEIGHTS", str(env / "weights"))
    folder = write_tiny(env / "weights" / "Qwen3-0.6B")
    assert describe(QWEN3) == f"{QWEN3}: {folder} [env]"
    assert "not a known model name" in describe("Qwen/Qwen9-1B")
