"""The `qwen-mini` command (the model's) and `qwen-mini-course` (the course's, which has the
model's commands too), called through their `main(argv)`; everything runs on the stand-ins."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from qwen_mini.cli import main
from qwen_mini.course import build
from qwen_mini.course import notebooks as nbs
from qwen_mini.course.cli import main as course_main

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
    assert course_main(["grade", "submissions/", "--chapter", "1", "--help"]) == 7
    assert seen["argv"] == ["submissions/", "--chapter", "1", "--help"]


def test_help_and_usage_errors_return_codes(capsys):
    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out
    assert main(["generate"]) == 2  # PROMPT missing: argparse's usage message


@pytest.mark.parametrize(
    "command, prog, commands",
    [
        (main, "qwen-mini", ("generate", "chat", "download", "doctor")),
        (course_main, "qwen-mini-course",
         ("generate", "chat", "download", "doctor", "reset", "progress", "grade", "export")),
    ],
)  # fmt: skip
def test_bare_command_lists_the_commands(capsys, monkeypatch, command, prog, commands):
    """`qwen-mini` alone prints the whole help, every command with its line, and exits 2 (no
    command given is a usage error, as for argparse's own); so does `qwen-mini-course`."""
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps the help lines at the terminal's width
    assert command([]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog} ")
    for name in commands:
        assert f"\n    {name} " in out, (name, out)
    assert "multi-turn chat in the terminal" in out  # each command's help line, not only names
    listed = set(re.findall(r"^    (\w+) ", out, re.M))
    assert listed == set(commands), listed


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


# --- misuse: a clear message and an exit code, never a traceback --------------------------------


def assert_readable(err: str, *words: str) -> None:
    assert err.startswith("qwen-mini"), err
    assert "Traceback" not in err
    for word in words:
        assert word in err, err


def test_chat_refuses_negative_max_new_tokens(capsys):
    assert main(["chat", STANDIN, "--max-new-tokens", "-1"]) == 2
    assert_readable(capsys.readouterr().err, "--max-new-tokens")


def test_generate_from_a_closed_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["generate", STANDIN, "-"]) == 1
    assert_readable(capsys.readouterr().err, "stdin is closed")


def test_generate_from_stdin_that_is_not_utf8(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9"), encoding="utf-8"))
    assert main(["generate", STANDIN, "-"]) == 1
    assert_readable(capsys.readouterr().err, "stdin is not valid utf-8", "iconv")


def test_argument_that_is_not_valid_text(capsys):
    # how Python hands over argv bytes that are not valid in the locale's encoding
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")
    assert main(["generate", STANDIN, prompt]) == 1
    assert_readable(capsys.readouterr().err, "not valid text")


def test_output_under_a_latin1_locale_is_replaced_not_a_crash(monkeypatch):
    out = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")
    monkeypatch.setattr(sys, "stdout", out)
    rc = main(["generate", STANDIN, "你好", "--max-new-tokens", "12", "--temperature", "0"])
    out.flush()
    assert rc == 0


def test_grade_out_under_a_regular_file(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    notebook = tmp_path / "ch00_foundations.ipynb"  # the fresh learner copy, not course/'s
    root = Path(__file__).resolve().parents[1]
    notebook.write_text(nbs.dumps(build.learner_copy(root, notebook.name)))
    argv = ["grade", "--chapter", "0", "--out", str(blocker / "grades.csv"), str(notebook)]
    assert course_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("qwen-mini-course grade: error:") and "Traceback" not in err
    assert str(blocker) in err


def test_doctor_scan_names_the_tensor_that_holds_nan(capsys, tmp_path):
    from helpers import write_checkpoint
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path, "qwen3")
    assert main(["doctor", "--scan", str(tmp_path)]) == 0
    assert "OK: every weight is finite" in capsys.readouterr().out
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, :5] = float("nan")
    save_file(tensors, tmp_path / "model.safetensors")
    assert main(["doctor", "--scan", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.up_proj.weight: 5 of 2,048 values are NaN or infinite" in out


def test_ctrl_c_while_starting_is_no_traceback():
    """The package imports torch only when a command needs it, inside the handler of Ctrl-C."""
    script = Path(sys.executable).parent / "qwen-mini"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "QWEN_MINI_WEIGHTS": ""}
    for _ in range(3):  # on a busy machine this process can wake after the command has ended
        started = subprocess.Popen([script, "generate", STANDIN, "Hi"], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        time.sleep(1.0)  # inside `import torch` or the stand-in's start
        if started.poll() is None:
            break
        started.communicate()
    else:
        pytest.fail("the command ended before the 1 s had passed, three times: no Ctrl-C sent")
    started.send_signal(signal.SIGINT)
    out, err = started.communicate(timeout=60)
    assert started.returncode == 130, err
    assert "Traceback" not in err


# --- help, devices, the stand-in's defaults ------------------------------------------------------


def _parsers(parser):
    """`parser` and every parser below it (the commands)."""
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help():
    import argparse

    from qwen_mini.cli import build_parser
    from qwen_mini.course.cli import build_parser as course_parser
    from qwen_mini.course.export import build_parser as export_parser
    from qwen_mini.course.grading.cli import build_parser as grade_parser

    found = 0
    parsers = [build_parser(), course_parser(), grade_parser(), export_parser()]
    for parser in [p for top in parsers for p in _parsers(top)]:
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            found += 1
            name = "/".join(action.option_strings) or action.dest
            assert action.help and action.help.strip(), f"{parser.prog} {name} has no help text"
    assert found > 30  # the walk reached the commands' options


def test_help_describes_the_package(capsys):
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for family in ("Qwen3,", "Qwen3.5", "Qwen2.5", "Qwen3-MoE"):
        assert family in text
    for command in ("generate", "chat", "download", "doctor", "qwen-mini-course"):
        assert command in text


def test_the_course_command_has_the_models_commands_and_its_own(capsys):
    assert course_main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for command in ("generate", "chat", "download", "doctor", "reset", "progress", "grade"):
        assert f"{command} " in text
    assert course_main(["generate", "--help"]) == 0
    assert "--mine" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["reset", "ch03"], ["progress"], ["grade", "x.ipynb"], ["generate", STANDIN, "Hi", "--mine"]],
)
def test_the_models_command_points_to_the_course_for_the_courses(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    named = "--mine" if "--mine" in argv else argv[0]
    assert err.startswith(f"qwen-mini: error: {named} belongs to the course's command"), err
    assert f"qwen-mini-course {' '.join(argv)}" in err and "qwen-mini[course]" in err


@pytest.mark.parametrize("module", ["qwen_mini.cli", "qwen_mini.course.cli"])
def test_python_dash_m_runs_the_command(module):
    done = subprocess.run([sys.executable, "-m", module, "doctor", "--help"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--scan" in done.stdout


def test_generate_on_the_cpu_device(capsys):
    argv = ["generate", STANDIN, "Hi", "--max-new-tokens", "3", "--temperature", "0"]
    assert main([*argv, "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "error" not in err


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(
    "device, problem",
    [("gpu", "unknown device 'gpu'"), ("cuda:-1", "unknown device"), ("meta", "holds no weights")],
)
def test_a_bad_device_is_a_readable_error(capsys, command, device, problem):
    argv = [command, STANDIN] + (["Hi"] if command == "generate" else [])
    assert main([*argv, "--device", device]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qwen-mini: error:") and problem in err and "Traceback" not in err


def test_a_missing_gpu_is_a_readable_error(capsys):
    import torch

    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: on no machine
    assert main(["generate", STANDIN, "Hi", "--device", absent]) == 1
    err = capsys.readouterr().err
    assert f"device '{absent}' is not available on this machine" in err and "Traceback" not in err


def test_generate_on_the_standin_is_short_and_says_why(capsys):
    assert main(["generate", STANDIN, "The capital of France is", "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert "on the stand-in, replies default to 48 tokens" in err
    assert "Looked in:" in err and "qwen-mini download Qwen/Qwen3-0.6B" in err  # the fuller text

    from qwen_mini import generate, load_tokenizer
    from qwen_mini.hub import load_model

    want = generate(load_model(STANDIN), load_tokenizer(STANDIN), "The capital of France is",
                    max_new_tokens=48, seed=3)  # fmt: skip
    assert out == want + "\n"
    capsys.readouterr()
    assert main(["generate", STANDIN, "Hi", "--max-new-tokens", "2"]) == 0
    assert "default to" not in capsys.readouterr().err  # asked for: nothing to explain


def test_generate_with_a_draft_prints_the_greedy_text(capsys):
    """--draft mtp (the Qwen3.5 stand-in's MTP head) and --draft MODEL (a model drafting for
    itself) give the text of plain greedy decoding."""
    name = "Qwen/Qwen3.5-0.8B"
    argv = ["generate", name, "In the beginning", "--max-new-tokens", "8", "--temperature", "0",
            "--dtype", "float32"]  # fmt: skip
    assert main(argv) == 0
    plain = capsys.readouterr().out
    for draft in ("mtp", name):
        assert main([*argv, "--draft", draft, "--draft-tokens", "2"]) == 0
        assert capsys.readouterr().out == plain, draft


def test_generate_draft_mtp_without_a_head_is_a_readable_error(capsys):
    assert main(["generate", STANDIN, "Hi", "--draft", "mtp", "--max-new-tokens", "2"]) == 1
    assert "no multi-token-prediction head" in capsys.readouterr().err
