"""Grading where universities already grade: a chapter exported to nbgrader or Gradescope.

    qwen-mini-course export nbgrader --chapter 1 course-folder/
    qwen-mini-course export gradescope --chapter 1 ch01-autograder.zip

Both run the chapter's own checks (`qwen_mini/course/checks/chNN.py`) and award each exercise
the points `qwen-mini-course grade` awards: nbgrader in test cells that call them (`nbgrader.py`),
Gradescope by running `qwen-mini-course grade` itself in its container (`gradescope.py`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..grading.plan import ROOT, GraderError
from ..notebooks import NotebookError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qwen-mini-course export",
        description=__doc__.split("\n\n")[0],
        epilog="README.md, 'For instructors', says what each export guarantees.",
    )
    sub = p.add_subparsers(
        dest="target", required=True, metavar="TARGET", help="what to write (TARGET --help)"
    )
    nbg = sub.add_parser("nbgrader", help="an nbgrader course folder (source/ and its config)")
    nbg.add_argument("folder", type=Path, metavar="DIR", help="the course folder to write into")
    gs = sub.add_parser("gradescope", help="a Gradescope autograder zip")
    gs.add_argument("zip", type=Path, metavar="FILE.zip", help="the bundle to write")
    for s in (nbg, gs):
        s.add_argument("--chapter", type=int, required=True, help="chapter number, e.g. 1")
        s.add_argument(
            "--solutions",
            type=Path,
            default=ROOT / "solutions",
            help="folder of reference notebooks (the repository's solutions/)",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error: argparse has printed the message
        return int(e.code or 0)
    try:
        if args.target == "nbgrader":
            from .nbgrader import write_course

            config = args.folder / "nbgrader_config.py"
            kept = config.exists()
            notebook = write_course(args.chapter, args.folder, args.solutions, keep_config=kept)
            print(f"wrote {notebook}")
            if kept:
                print(f"kept your {config} (delete it to get the exported one)")
            else:
                print(f"wrote {config}")
            print(f"next, in {args.folder}: nbgrader generate_assignment {notebook.parent.name}")
        else:
            from .gradescope import write_bundle

            if args.zip.suffix != ".zip":
                print(
                    f"qwen-mini-course export: error: {args.zip}: name the bundle FILE.zip",
                    file=sys.stderr,
                )
                return 2
            names = write_bundle(args.chapter, args.zip, args.solutions)
            print(f"wrote {args.zip} ({len(names)} files): upload it as the autograder")
    except (GraderError, NotebookError, OSError) as e:
        print(f"qwen-mini-course export: error: {e}", file=sys.stderr)
        return 1
    return 0
