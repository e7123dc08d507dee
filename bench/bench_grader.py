"""Time `qwen-mini-course grade` on a class: N copies of a chapter's solution notebook, graded
at once.

    python bench/bench_grader.py                      # 20 chapter-1 notebooks, --jobs 2
    python bench/bench_grader.py --repo /path/to/other/checkout   # the same, another version

The grader of `--repo` (default: this checkout) runs in a subprocess with this interpreter; the
time is the whole command, from start to exit (starting the sandbox included). Every notebook
is the solution: one short of full marks ran into a time limit, and the script lists them.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def grade_once(repo: Path, chapter: int, copies: int, jobs: int) -> tuple[float, list[str]]:
    """Seconds the whole run took, and the notebooks that did not score full marks."""
    solution = next((repo / "solutions").glob(f"ch{chapter:02d}_*.ipynb"))
    with tempfile.TemporaryDirectory(prefix="qwen-mini-bench-") as tmp:
        folder = Path(tmp) / "class"
        folder.mkdir()
        for i in range(copies):
            shutil.copyfile(solution, folder / f"student{i:02d}.ipynb")
        out = Path(tmp) / "out" / "grades.csv"
        out.parent.mkdir()
        env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
        args = [sys.executable, "-m", "qwen_mini.course.grading", "--chapter", str(chapter)]
        args += ["--jobs", str(jobs), "--out", str(out), str(folder)]
        started = time.monotonic()
        proc = subprocess.run(args, env=env, cwd=tmp, capture_output=True, text=True)
        seconds = time.monotonic() - started
        if proc.returncode != 0:
            sys.exit(f"the grader failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        with open(out, newline="") as f:
            rows = list(csv.DictReader(f))
        if len(rows) != copies:
            sys.exit(f"{len(rows)} rows for {copies} notebooks:\n{proc.stdout}")
        return seconds, [
            f"{Path(r['notebook']).stem} {r['total']}/{r['max_total']}"
            for r in rows
            if r["total"] != r["max_total"]
        ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=HERE, help="checkout whose grader runs")
    p.add_argument("--chapter", type=int, default=1)
    p.add_argument("--copies", type=int, default=20)
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args()
    seconds, short = grade_once(a.repo.resolve(), a.chapter, a.copies, a.jobs)
    print(f"{a.repo}: {a.copies} chapter-{a.chapter} notebooks, --jobs {a.jobs}: {seconds:.1f} s")
    if short:  # a solution short of full marks ran into a time limit: the machine was busy
        print(f"not full marks ({len(short)}): {', '.join(short)}")


if __name__ == "__main__":
    main()
