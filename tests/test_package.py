"""Running a model needs neither transformers (the test oracle) nor huggingface_hub (downloads
only), and imports nothing from the course room (qwen_mini.course: checks, build, grading, the
chapters' experiments in qwen_mini.course.lab)."""

import os
import subprocess
import sys

SCRIPT = """
import sys
sys.modules["transformers"] = None  # any import of it now raises ImportError
sys.modules["huggingface_hub"] = None
import qwen_mini
import qwen_mini.cli  # the command line too
for name in ("Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B"):  # every kind of block: attention, DeltaNet
    model = qwen_mini.load_model(name)
    tok = qwen_mini.load_tokenizer(name)
    text = qwen_mini.generate(model, tok, "Hello", max_new_tokens=4, temperature=0)
    assert isinstance(text, str) and model.is_standin
course = sorted(m for m in sys.modules if m.split(".")[:2] == ["qwen_mini", "course"])
assert not course, course
print("ok")
"""


def test_runs_without_transformers_and_huggingface_hub(tmp_path):
    env = {
        k: v for k, v in os.environ.items() if k not in ("QWEN_MINI_WEIGHTS", "QWEN_MINI_DOWNLOAD")
    }
    env["HF_HUB_CACHE"] = str(tmp_path)  # an empty cache: the stand-in, whatever this machine has
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    lines = done.stderr.splitlines()  # the learner is told, in one line per model
    assert len(lines) == 2 and all("using its stand-in" in line for line in lines), done.stderr


def test_no_model_module_names_a_chapter():
    """Notes for learners belong in the notebooks; the model's modules speak of the model (the
    generated header, which names the source notebooks, aside), the command line too: the
    course's commands are qwen-mini-course's (qwen_mini/course/cli.py)."""
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "qwen_mini"
    for module in sorted(package.glob("*.py")):
        lines = module.read_text(encoding="utf-8").splitlines()
        header = next((i for i, line in enumerate(lines) if not line.startswith("#")), 0)
        body = lines[header:] if lines and lines[0].startswith("# Generated from") else lines
        found = [line for line in body if re.search(r"\bchapters?\b|\bch0\d", line, re.I)]
        assert not found, f"{module.name}: {found[0].strip()}"
