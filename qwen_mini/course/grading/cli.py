"""Grade a chapter's exercises in submitted notebooks.

    qwen-mini grade --chapter 1 --out grades.csv --reports reports/ submissions/*.ipynb

For each submission, in a fresh process: the reference notebook's `setup` cells run (never the
submission's), then the submission's exercise cells (those calling `check("chNN.…", …)`), each
followed by the public and hidden checks on the object the reference notebook checks there.
Each exercise has a wall-clock limit, the process a memory limit, and printed output is capped.
Whatever a submission does (raise, loop, exhaust memory, print megabytes, exit), it only costs
that submission points: the run goes on and grades every other notebook.

Fresh processes are forked from a "zygote" that has imported torch and the chapter's checks once,
so a notebook costs milliseconds to start instead of seconds (torch's import).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ..notebooks import NotebookError
from .plan import ROOT, GraderError, load_reference
from .report import _number, write_csv, write_report
from .sandbox import Zygote
from .session import grade_notebook


def submissions(paths: list[Path]) -> list[Path]:
    """Files as given; folders expand to the notebooks inside them (checkpoints skipped)."""
    found = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        else:
            found.append(path)
    return found


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qwen-mini grade",
        description="\n\n".join(__doc__.split("\n\n")[:3]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--chapter", type=int, required=True, help="chapter number, e.g. 1")
    p.add_argument("--out", type=Path, required=True, help="CSV file to write")
    p.add_argument("--reports", type=Path, help="folder for one JSON report per notebook")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per exercise (30)")
    p.add_argument(
        "--memory-mb",
        type=int,
        default=2048,
        help="memory a submission may use beyond the grader's own (2048)",
    )
    p.add_argument(
        "--solutions",
        type=Path,
        default=ROOT / "solutions",
        help="folder of reference notebooks (the repository's solutions/)",
    )
    p.add_argument("files", nargs="+", type=Path, help="submitted notebooks or folders of them")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        options = build_parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error: argparse has printed the message
        return int(e.code or 0)
    try:
        return _grade_all(options)
    except (GraderError, NotebookError) as e:
        print(f"qwen-mini grade: error: {e}", file=sys.stderr)
        return 1


def _grade_all(options) -> int:
    ref = load_reference(options.solutions, options.chapter)
    files = submissions(options.files)
    with tempfile.TemporaryDirectory(prefix="qwen-mini-zygote-") as tmp:
        zygote = Zygote(ref.chapter, Path(tmp))
        try:
            all_grades = [grade_notebook(path, ref, zygote, options) for path in files]
        finally:
            zygote.close()
    ids = [e["id"] for e in zygote.exercises]
    max_total = sum(e["points"] for e in zygote.exercises)
    write_csv(options.out, ids, all_grades)
    used: set[str] = set()
    for grades in all_grades:
        if options.reports:
            write_report(options.reports, grades, options.chapter, max_total, used)
        note = f" — {grades.error}" if grades.error else ""
        warn = f" ({len(grades.warnings)} warnings)" if grades.warnings else ""
        print(f"{grades.notebook}: {_number(grades.total)}/{_number(max_total)}{warn}{note}")
    print(
        f"wrote {options.out}" + (f" and reports in {options.reports}" if options.reports else "")
    )
    return 0
