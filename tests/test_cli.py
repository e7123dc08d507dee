"""The `qwen-mini` command, called through `main(argv)`; everything runs on the stand-ins."""

import json
import sys
import types

import pytest

from qwen_mini.cli import main

STANDIN = "Qwen/Qwen3-0.6B"


@pytest.fixture(autouse=True)
def no_real_weights(monkeypatch, tmp_path):
    """Make sure no variable or cache leads to real weights: the tests need the stand-in."""
    for var in (
        "QWEN_MINI_WEIGHTS",
        "QWEN_MINI_DOWNLOAD",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "TRANSFORMERS_CACHE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_generate_streams_the_same_text_as_the_library(capsys):
    rc = main(["generate", STANDIN, "The capital of France is", "--max-new-tokens", "8",
               "--seed", "3"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "stand-in" in err  # the learner is told this is not the real model
    assert "temperature 0.6, top_k 20, top_p 0.95" in err  # from generation_config.json

    from qwen_mini import generate, load_tokenizer
    from qwen_mini.hub import load_model

    model = load_model(STANDIN)
    want = generate(model, load_tokenizer(STANDIN), "The capital of France is",
                    max_new_tokens=8, seed=3)  # fmt: skip
    assert out == want + "\n" and want


def test_generate_chat_greedy(capsys):
    argv = ["generate", STANDIN, "Hi", "--chat", "--no-thinking", "--max-new-tokens", "4"]
    assert main([*argv, "--temperature", "0", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    assert "sampling: greedy" in err and out.endswith("\n")


def test_no_thinking_needs_chat(capsys):
    assert main(["generate", STANDIN, "Hi", "--no-thinking"]) == 2
    assert "--chat" in capsys.readouterr().err


def test_unknown_model_is_a_readable_error(capsys):
    assert main(["generate", "Nobody/NoSuchModel-1B", "Hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qwen-mini: error:") and "Traceback" not in err
    assert "NoSuchModel" in err


def test_bad_checkpoint_is_a_readable_error(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["generate", str(tmp_path), "Hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qwen-mini: error:") and "llama" in err and "Traceback" not in err


def test_context_overflow_is_a_readable_error(capsys):
    assert main(["generate", STANDIN, "Hi", "--max-new-tokens", "50000"]) == 1
    out, err = capsys.readouterr()
    assert "max_position_embeddings" in err and "40960" in err and out == ""


def test_doctor(capsys):
    rc = main(["doctor"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for word in ("python", "torch", "safetensors", "tokenizers", "jinja2", "qwen-mini"):
        assert word in out
    assert f"{STANDIN}: OK" in out and "FAIL" not in out


def test_grade_gets_the_rest_of_the_arguments(monkeypatch):
    seen = {}

    def fake_cli(argv):
        seen["argv"] = argv
        return 7

    monkeypatch.setitem(
        sys.modules, "qwen_mini.course.grading.cli", types.SimpleNamespace(main=fake_cli)
    )
    assert main(["grade", "submissions/", "--chapter", "1", "--help"]) == 7
    assert seen["argv"] == ["submissions/", "--chapter", "1", "--help"]


def test_help_and_usage_errors_return_codes(capsys):
    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out
    assert main(["generate"]) == 2  # PROMPT missing: argparse's usage message


def test_download_fetches_once_then_finds_it_locally(monkeypatch, tmp_path, capsys):
    import huggingface_hub
    from test_hub import FakeHub

    fake = FakeHub(tmp_path / "downloads")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert main(["download", STANDIN]) == 0
    assert "downloaded to" in capsys.readouterr().out
    assert fake.calls[0][0] == STANDIN
    folder = tmp_path / "downloads" / "Qwen--Qwen3-0.6B"
    assert main(["download", str(folder)]) == 0
    assert f"already on this machine: {folder}" in capsys.readouterr().out
    assert len(fake.calls) == 1


def test_download_failure_is_a_readable_error(monkeypatch, tmp_path, capsys):
    import huggingface_hub
    from test_hub import FakeHub

    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", FakeHub(tmp_path, OSError("no route"))
    )
    assert main(["download", STANDIN]) == 1
    err = capsys.readouterr().err
    assert "qwen-mini: error:" in err and "online" in err and "Traceback" not in err
