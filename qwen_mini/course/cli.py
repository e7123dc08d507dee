"""The `qwen-mini-course` command: the model's commands (those of `qwen-mini`: generate, chat,
download, doctor), generate and chat on the learner's own pieces (`--mine`), and the course's.

    qwen-mini-course reset ch03           (start a chapter's notebook over; the old one is kept)
    qwen-mini-course progress             (which exercises are yours)
    qwen-mini-course generate Qwen/Qwen3-0.6B "Hello" --mine
    qwen-mini-course grade ...            (see `qwen-mini-course grade --help`)
    qwen-mini-course export ...           (nbgrader or Gradescope; `qwen-mini-course export --help`)

It comes with the course (`pip install "qwen-mini[course]"`, or `make lab` in a clone); the
model's own command, qwen_mini/cli.py, never imports this one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import cli

DESCRIPTION = (
    "The qwen-mini course's command: start a chapter's notebook over, list which exercises are "
    "yours, generate and chat with the model built from your own pieces (--mine), grade "
    "submitted notebooks, export a chapter for nbgrader or Gradescope; and the model's commands "
    "(those of qwen-mini: generate, chat, download, doctor). Without real weights on disk, a "
    "known model name runs on its stand-in (a tiny model of the same architecture)."
)
MINE_HELP = (
    "build the model from your own pieces (the exercises you passed in the notebooks), the "
    "package's where yours is missing or not passing; prints whose each block is"
)
MINE_DIR_HELP = "with --mine or progress: the folder of your notebooks (default: this one)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-mini-course", description=DESCRIPTION)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="what to do (COMMAND --help)"
    )
    model = cli.add_commands(sub)
    for name in ("generate", "chat"):
        model[name].add_argument("--mine", action="store_true", help=MINE_HELP)
        model[name].add_argument("--dir", type=Path, default=Path("."), help=MINE_DIR_HELP)
    r = sub.add_parser(
        "reset",
        help="start a chapter's notebook over (the old one is kept as a backup)",
        description="Put the fresh learner copy of CHAPTER into course/, made from solutions/ "
        "as the build makes it. Your old copy is kept as "
        "course/.backups/chNN_name-DATE-TIME.ipynb (a hidden folder; an earlier backup is never "
        "overwritten). Your kept pieces of the chapter (see qwen-mini-course progress) stay in "
        "use unless you add --pieces.",
    )
    r.add_argument(
        "--pieces",
        action="store_true",
        help="also set the chapter's kept pieces aside (moved, never deleted): later chapters "
        "and --mine use the package's until your exercises pass again",
    )
    r.add_argument(
        "chapter", metavar="CHAPTER", help="ch03, 3, ch03_moe or the notebook's file name"
    )
    r.add_argument(
        "--dir",
        type=Path,
        default=Path("."),
        help="the course's clone, holding course/ and solutions/ (default: this folder or the "
        "nearest one above it)",
    )
    p = sub.add_parser(
        "progress",
        help="which exercises are yours and which fall back to the package's",
        description="For the notebooks in --dir, list per chapter the exercises whose code is "
        "yours (kept when it passed its checks in the notebook, and passing again now) and "
        "those for which the package's code stands in, with the reason.",
    )
    p.add_argument("--dir", type=Path, default=Path("."), help=MINE_DIR_HELP)
    p.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object: exercise id -> "learner" or "package"',
    )
    sub.add_parser(
        "grade", help="grade submitted notebooks (qwen-mini-course grade --help)", add_help=False
    )
    sub.add_parser(
        "export",
        help="a chapter for nbgrader or Gradescope (qwen-mini-course export --help)",
        add_help=False,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    return cli.guarded(run, argv, "qwen-mini-course")


def run(argv: list[str]) -> int:
    if argv[:1] == ["grade"]:  # grading has its own parser: hand it everything after "grade"
        from .grading.cli import main as grade_cli

        return grade_cli(argv[1:])
    if argv[:1] == ["export"]:  # so does exporting
        from .export import main as export_cli

        return export_cli(argv[1:])
    commands = {
        **cli.COMMANDS,
        "generate": lambda args: cli.cmd_generate(args, arch=your_architecture(args)),
        "chat": lambda args: cli.cmd_chat(args, arch=your_architecture(args)),
        "reset": cmd_reset,
        "progress": cmd_progress,
    }
    return cli.run(argv, build_parser(), commands)


# --- reset ------------------------------------------------------------------------------------


def cmd_reset(args) -> int:
    from .workspace import find_clone, kept_pieces, reset, set_pieces_aside

    clone = find_clone(args.dir)
    notebook, backup = reset(clone, args.chapter)
    print(f"{notebook}: the fresh copy of the chapter")
    print(f"your old copy is kept as {backup}" if backup else "(the old had no changes of yours)")
    if backup:
        print(f"  (backups are in {backup.parent}/, a hidden folder the course never reads)")
    label = notebook.name.split("_")[0]
    if args.pieces:
        folder = set_pieces_aside(clone, args.chapter)
        if folder:
            print(f"your kept pieces of {label} are set aside in {folder}/; later chapters and "
                  f"--mine use the package's until your exercises pass again")  # fmt: skip
        else:
            print(f"(no kept pieces of {label} to set aside)")
    elif pieces := kept_pieces(clone, args.chapter):
        print(f"your {len(pieces)} kept pieces of {label} (in {pieces[0].parent}/) are still "
              f"used by later chapters and --mine; to set them aside too: qwen-mini-course "
              f"reset {label} --pieces")  # fmt: skip
    return 0


# --- your own pieces --------------------------------------------------------------------------


def cmd_progress(args) -> int:
    from . import mine

    pieces = mine.load(args.dir)
    if args.json:
        print(json.dumps({x: p.whose for x, p in pieces.items()}, indent=1))
    else:
        print(f"your pieces for the notebooks in {mine.notebook_folder(args.dir)}:")
        print(mine.progress(pieces))
    return 0


def your_architecture(args):
    """With --mine, the row of MODEL's model_type built from your pieces (the table of whose
    each block is goes to stderr); else None, the package's row."""
    if not args.mine:
        return None
    from ..hub import model_type_of
    from . import mine

    model_type = model_type_of(args.model)
    pieces = mine.load(args.dir, only=list(mine.BLOCKS))
    row, table = mine.architecture(model_type, pieces)
    print(f"qwen-mini-course: {model_type} built from these blocks:", file=sys.stderr)
    print(mine.format_table(table), file=sys.stderr)
    return row


if __name__ == "__main__":  # python -m qwen_mini.course.cli
    sys.exit(main())
