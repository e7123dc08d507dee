"""Running a model needs neither transformers (the test oracle) nor huggingface_hub (downloads
only), and imports nothing from the course room (qwen_mini.course: checks, build, grading)."""

import os
import subprocess
import sys

SCRIPT = """
import sys
sys.modules["transformers"] = None  # any import of it now raises ImportError
sys.modules["huggingface_hub"] = None
import qwen_mini
model = qwen_mini.load_model("Qwen/Qwen3-0.6B")
tok = qwen_mini.load_tokenizer("Qwen/Qwen3-0.6B")
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
    assert "using its stand-in" in done.stderr  # the learner is told, in one line
    assert done.stderr.count("\n") == 1, done.stderr
