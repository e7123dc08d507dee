"""A learner's environment, and a notebook run in a kernel of its own with it: for the tests of
the learner's pieces (test_mine.py, test_mine_kernels.py)."""

from __future__ import annotations

import os
from pathlib import Path

from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
# the test run's own settings, which a learner's kernel or command does not have
DROPPED = ("QWEN_MINI_WEIGHTS", "QWEN_MINI_CHECKS", "QWEN_MINI_MINE", "QWEN_MINI_DOWNLOAD")


def learner_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment (PATH, the locale, the one torch thread `make test` gives each
    test process) with a learner's settings: pieces kept under `home`, offline, no real weights."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env.update(QWEN_MINI_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    env.update(HF_HUB_CACHE=str(home / "empty-hf-cache"), **extra)
    return env


def run_in_kernel(nb, folder: Path, home: Path, timeout: int = 900):
    """Every cell of `nb` in a fresh kernel started in `folder` (as JupyterLab starts one), with
    `learner_env(home)` as its whole environment; a cell that raises fails the test."""
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(folder)}})  # fmt: skip
    client.execute(env=learner_env(home))
    return nb
