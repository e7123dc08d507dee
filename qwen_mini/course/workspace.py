"""The learner's workspace: the notebooks in `course/` of a clone, and starting one over.

    qwen-mini reset ch03        (or 3, ch03_moe, ch03_moe.ipynb, course/ch03_moe.ipynb)

The fresh copy is made from `solutions/` by the build's `learner_notebook`, exactly as
`python -m qwen_mini.course.build` writes it: both folders are in every clone, and the copy
committed in `course/` may already hold the learner's own commits. The learner's old copy is kept
beside it as `course/ch03_moe.backup-<date>-<time>.ipynb`; an earlier backup is never overwritten.
"""

from __future__ import annotations

import os
import re
import shutil
from datetime import datetime
from pathlib import Path

from . import notebooks as nbs
from .build import chapter_label, holds_work, learner_notebook


class WorkspaceError(ValueError):
    """The clone, the chapter or a file cannot be found or written; the message says which."""


def find_clone(start: Path) -> Path:
    """The folder holding `course/` and `solutions/`: `start` or the nearest folder above it
    (a terminal opened in JupyterLab starts in course/)."""
    start = Path(start).expanduser().resolve()
    for folder in (start, *start.parents):
        if (folder / "course").is_dir() and (folder / "solutions").is_dir():
            return folder
    raise WorkspaceError(
        f"no course/ and solutions/ folders in {start} or any folder above it. Run this in the "
        f"course's clone (the folder with README.md, course/ and solutions/), or pass "
        f"--dir CLONE."
    )


def find_chapter(clone: Path, chapter: str) -> Path:
    """The solution notebook a chapter name means: "ch03", "3", "ch03_moe", "ch03_moe.ipynb" or
    "course/ch03_moe.ipynb" all give solutions/ch03_moe.ipynb."""
    solutions = sorted((clone / "solutions").glob("ch*.ipynb"))
    name = Path(chapter.strip()).name.removesuffix(".ipynb").lower()
    if re.fullmatch(r"\d+", name):
        name = f"ch{int(name):02d}"
    found = [p for p in solutions if name in (p.stem.lower(), chapter_label(p.name))]
    if len(found) != 1:
        known = ", ".join(f"{chapter_label(p.name)} ({p.name})" for p in solutions)
        raise WorkspaceError(
            f"no chapter {chapter!r} in {clone / 'solutions'}; the chapters are: {known or 'none'}."
        )
    return found[0]


def backup_path(notebook: Path, now: datetime) -> Path:
    """A name beside `notebook` that no file has yet: ch03_moe.backup-20261201-153000.ipynb
    (then -2, -3, ... within the same second)."""
    stem = f"{notebook.stem}.backup-{now:%Y%m%d-%H%M%S}"
    path, n = notebook.with_name(stem + ".ipynb"), 1
    while path.exists():
        n += 1
        path = notebook.with_name(f"{stem}-{n}.ipynb")
    return path


def reset(clone: Path, chapter: str, now: datetime | None = None) -> tuple[Path, Path | None]:
    """Put the fresh learner copy of `chapter` in clone/course/; return (its path, the backup of
    the learner's old copy or None). A copy with no changes of the learner's is not backed up.
    The fresh copy is complete before anything is moved, so a failure changes nothing."""
    solution = find_chapter(clone, chapter)
    target = clone / "course" / solution.name
    try:
        fresh = learner_notebook(nbs.load(solution), solution.name)
    except nbs.NotebookError as e:
        raise WorkspaceError(f"cannot make the fresh copy: {e}") from None
    backup = None
    if target.exists() and holds_work(target, fresh):
        backup = backup_path(target, now or datetime.now())
        shutil.copy2(target, backup)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(nbs.dumps(fresh), encoding="utf-8")
    os.replace(partial, target)  # atomic: the notebook is the old one or the fresh one
    return target, backup
