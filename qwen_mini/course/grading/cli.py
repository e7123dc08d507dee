"""Grade a chapter's exercises in submitted notebooks.

    qwen-mini grade --chapter 1 --out grades.csv submissions/*.ipynb

Each submission runs in a sandboxed process of its own, as Jupyter would run it: every code cell
in order (magics and shell commands skipped with a note), each with a time limit, the notebook
within a budget. Each exercise is graded on the object its `check(...)` call names (or the name
it defines) by the public and hidden checks, which run in the grader on plain data the sandbox
sends back. The CSV has one row per named input: points and a status per exercise, the total and
the maximum; a JSON report per notebook says why. Rows are written as the run goes.

Exit status: 0 when every named input was found and read; 3 when some could not be (their rows
say `unreadable`); 1 when the grader cannot run at all; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ..notebooks import NotebookError
from .plan import ROOT, GraderError, display_name, load_reference, read_submission
from .report import csv_text, number, report_name, write_atomic, write_report
from .sandbox import Zygote
from .session import Options, grade_notebook

UNREADABLE = 3


def submissions(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """Files as given; folders expand to the notebooks inside them (checkpoints skipped).
    Also returns the named folders that hold no notebook."""
    found, empty = [], []
    for path in paths:
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            found += inside
            if not inside:
                empty.append(path)
        else:
            found.append(path)
    return found, empty


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qwen-mini grade",
        description="\n\n".join(__doc__.split("\n\n")[:4]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--chapter", type=int, required=True, help="chapter number, e.g. 1")
    p.add_argument("--out", type=Path, required=True, help="CSV file to write")
    p.add_argument(
        "--reports",
        type=Path,
        help="folder for one JSON report per notebook (default: OUT-reports)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds per cell and per exercise's checks (30)",
    )
    p.add_argument(
        "--budget", type=float, default=300.0, help="seconds per notebook, all included (300)"
    )
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


def _say(text: str) -> None:
    print(text.encode("utf-8", "backslashreplace").decode("utf-8", "replace"), flush=True)


def _grade_all(options) -> int:
    ref = load_reference(options.solutions, options.chapter)
    files, empty = submissions(options.files)
    reports = options.reports or options.out.with_name(options.out.stem + "-reports")
    settings = Options(timeout=options.timeout, budget=options.budget, memory_mb=options.memory_mb)
    all_grades, used, unreadable = [], set(), bool(empty)
    for folder in empty:
        _say(f"{display_name(folder)}: no notebooks found in this folder")
    write_atomic(options.out, csv_text(ref.ids, all_grades))
    with tempfile.TemporaryDirectory(prefix="qwen-mini-grader-") as tmp:
        zygote = Zygote(ref.chapter, Path(tmp))
        try:
            if zygote.exercises != ref.ids:
                raise GraderError(
                    f"the sandbox sees exercises {zygote.exercises}, the grader {ref.ids}"
                )
            for path in files:
                sub = read_submission(path, ref.chapter)
                grades = grade_notebook(sub, ref, zygote, settings)
                unreadable |= bool(sub.error)
                all_grades.append(grades)
                write_atomic(options.out, csv_text(ref.ids, all_grades))  # a killed run keeps these
                write_report(reports, report_name(grades.notebook, used), grades, options.chapter)
                note = f" — {grades.error}" if grades.error else ""
                warn = f" ({len(grades.warnings)} warnings)" if grades.warnings else ""
                _say(
                    f"{grades.notebook}: {number(grades.total)}/{number(grades.max_total)}{warn}{note}"
                )
        finally:
            zygote.close()
    _say(f"wrote {display_name(options.out)} and reports in {display_name(reports)}")
    return UNREADABLE if unreadable else 0
