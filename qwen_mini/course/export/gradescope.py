"""A chapter as a Gradescope autograder bundle, and what its `run_autograder` runs.

    qwen-mini-course export gradescope --chapter 1 ch01-autograder.zip

The zip holds Gradescope's two entry points and what they need:

- `setup.sh`: run once when Gradescope builds the image: a virtual environment with the CPU build
  of torch (the version this bundle was written with) and this package, installed from
- `qwen-mini/`: the package, its assets and the chapter's solution notebook (the reference);
- `run_autograder`: run once per submission, in a fresh container: grades the notebook in
  `/autograder/submission/` with `qwen-mini-course grade` and writes
  `/autograder/results/results.json` in Gradescope's format, one test per exercise with its
  points and the grader's message.

`QWEN_MINI_AUTOGRADER_ROOT` replaces `/autograder` (and `QWEN_MINI_AUTOGRADER_PYTHON` the
environment's Python), so the same script runs in a scratch folder in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from .. import notebooks as nbs
from ..grading import main as grade
from ..grading.plan import ROOT, GraderError, load_reference

PACKAGE = "qwen-mini"  # the folder of the bundle (and of /autograder/source/) holding the package
CPU_WHEELS = "https://download.pytorch.org/whl/cpu"

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image (Ubuntu).
set -euo pipefail
apt-get update
apt-get install -y python3 python3-venv python3-pip
python3 -m venv /autograder/venv
# The CPU build of torch: PyPI's default wheel on Linux is the multi-GB CUDA build.
/autograder/venv/bin/pip install "torch=={torch}" --extra-index-url {wheels}
/autograder/venv/bin/pip install -e "/autograder/source/{package}[course]"
"""

RUN = """#!/usr/bin/env bash
# Gradescope runs this once per submission, as root, in a fresh container.
set -uo pipefail
ROOT="${{QWEN_MINI_AUTOGRADER_ROOT:-/autograder}}"
PYTHON="${{QWEN_MINI_AUTOGRADER_PYTHON:-$ROOT/venv/bin/python}}"
export HF_HUB_OFFLINE=1  # the stand-in weights, as in the course notebooks
exec "$PYTHON" -m qwen_mini.course.export.gradescope --chapter {chapter} --root "$ROOT" \\
    --solutions "$ROOT/source/{package}/solutions"
"""


# --- the bundle ----------------------------------------------------------------------------------


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]  # "2.13.0+cpu" -> "2.13.0"


def package_files(root: Path) -> list[Path]:
    """The files `pip install -e` needs: the package, its assets (in the package, or beside it in
    an older layout), its metadata."""
    found = [root / "pyproject.toml", root / "README.md"]
    for folder in ("qwen_mini", "assets"):
        if not (root / folder).is_dir():
            continue
        found += sorted(
            p
            for p in (root / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        )
    return found


def _add(bundle: zipfile.ZipFile, name: str, text: str, executable: bool = False) -> None:
    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
    info.external_attr = (0o755 if executable else 0o644) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    bundle.writestr(info, text)


def write_bundle(chapter: int, out: Path, solutions: Path, root: Path = ROOT) -> list[str]:
    """Write the autograder zip for `chapter` to `out` (atomically); return its file names."""
    ref = load_reference(solutions, chapter)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w") as bundle:
            _add(bundle, "setup.sh", SETUP.format(torch=torch_version(), wheels=CPU_WHEELS,
                                                  package=PACKAGE), executable=True)  # fmt: skip
            _add(bundle, "run_autograder", RUN.format(chapter=chapter, package=PACKAGE), True)
            for path in package_files(root):
                name = f"{PACKAGE}/{path.relative_to(root).as_posix()}"
                bundle.write(path, name, compress_type=zipfile.ZIP_DEFLATED)
            bundle.write(ref.notebook, f"{PACKAGE}/solutions/{ref.notebook.name}")
            names = bundle.namelist()
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the bundle is an ordinary file
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return names


# --- grading one submission ----------------------------------------------------------------------


def find_notebook(folder: Path, expected: str) -> tuple[Path | None, str]:
    """The submitted notebook: the one named like the chapter's, else the only one; or why not."""
    found = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    named = [p for p in found if p.name == expected]
    if named:
        return named[0], ""
    if len(found) == 1:
        return found[0], ""
    if not found:
        return None, f"no notebook was submitted: upload your {expected}"
    names = ", ".join(p.relative_to(folder).as_posix() for p in found)
    return None, f"several notebooks were submitted ({names}) and none is named {expected}"


def results(report: dict, titles: dict[str, str], output: str = "") -> dict:
    """Gradescope's results.json from a `qwen-mini-course grade` report: one test per exercise."""
    tests = []
    for exercise_id, entry in report["exercises"].items():
        title = titles.get(exercise_id, "")
        tests.append(
            {
                "name": f"{exercise_id}: {title}" if title else exercise_id,
                "score": entry["points"],
                "max_score": entry["max_points"],
                "status": "passed" if entry["status"] == "passed" else "failed",
                "output": f"{entry['status']}: {entry['message']}",
                "visibility": "visible",
            }
        )
    notes = [report.get("error") or "", *report.get("warnings", []), output]
    return {
        "score": report["total"],
        "tests": tests,
        "output": "\n".join(n for n in notes if n),
        "visibility": "visible",
        "stdout_visibility": "hidden",
    }


def _nothing_graded(ref, why: str) -> dict:
    exercises = {
        e.id: {"status": "missing", "points": 0, "max_points": e.points, "message": why}
        for e in ref.exercises
    }
    return {"total": 0, "exercises": exercises, "error": why, "warnings": []}


def run(chapter: int, root: Path, solutions: Path) -> int:
    """Grade the notebook in root/submission/ into root/results/results.json."""
    ref = load_reference(solutions, chapter)
    titles = {e.id: e.title for e in ref.exercises}
    notebook, why = find_notebook(root / "submission", ref.notebook.name)
    status = 0
    if notebook is None:
        report = _nothing_graded(ref, why)
    else:
        with tempfile.TemporaryDirectory(prefix="qwen-mini-gradescope-") as tmp:
            csv, reports = Path(tmp) / "grades.csv", Path(tmp) / "reports"
            args = ["--chapter", str(chapter), "--out", str(csv), "--reports", str(reports)]
            status = grade([*args, "--solutions", str(solutions), str(notebook)])
            found = sorted(reports.glob("*.json"))
            if found:
                report = json.loads(found[0].read_text(encoding="utf-8"))
            else:
                report = _nothing_graded(ref, "the grader could not run; see the output")
    out = root / "results" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results(report, titles), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}: {report['total']:g} points")
    return 1 if status == 1 else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m qwen_mini.course.export.gradescope",
        description="Grade root/submission/*.ipynb into root/results/results.json (Gradescope).",
    )
    p.add_argument("--chapter", type=int, required=True)
    p.add_argument("--root", type=Path, default=Path("/autograder"))
    p.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    args = p.parse_args(argv)
    try:
        return run(args.chapter, args.root, args.solutions)
    except (GraderError, nbs.NotebookError) as e:
        print(f"run_autograder: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
