"""The learner's workspace: the notebooks in `course/` of a clone, and starting one over.

    qwen-mini-course reset ch03        (or 3, ch03_moe, ch03_moe.ipynb, course/ch03_moe.ipynb)

The fresh copy is made from `solutions/` by the build's `learner_notebook`, exactly as
`python -m qwen_mini.course.build` writes it: both folders are in every clone, and the copy
committed in `course/` may already hold the learner's own commits. The learner's old copy is kept
as `course/.backups/ch03_moe-<date>-<time>.ipynb` (a hidden folder: out of the file browser's way,
and never read by the build or the tests); an earlier backup is never overwritten. With
`--pieces` the chapter's kept pieces (qwen_mini/course/mine.py) are set aside too, into a folder
beside them, so that later chapters and `--mine` use the package's until the exercises pass again.
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


BACKUPS = ".backups"  # in course/: hidden in JupyterLab's file browser, skipped by the tests


def backup_path(notebook: Path, now: datetime) -> Path:
    """A name in course/.backups/ that no file has yet: ch03_moe-20261201-153000.ipynb (then
    -2, -3, ... within the same second)."""
    folder = notebook.parent / BACKUPS
    stem = f"{notebook.stem}-{now:%Y%m%d-%H%M%S}"
    path, n = folder / f"{stem}.ipynb", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.ipynb"
    return path


def kept_pieces(clone: Path, chapter: str) -> list[Path]:
    """The pieces kept from `chapter`'s notebook (its exercises that passed, and those set aside
    when they stopped passing), for the notebooks in clone/course."""
    from . import mine

    label = chapter_label(find_chapter(clone, chapter).name)
    folder = mine.pieces_folder(clone / "course")
    return sorted(folder.glob(f"{label}.*.py")) if folder.is_dir() else []


def set_pieces_aside(clone: Path, chapter: str, now: datetime | None = None) -> Path | None:
    """Move `chapter`'s kept pieces into a folder beside them (set-aside-<chNN>-<date>-<time>/,
    never deleted); later chapters and --mine then use the package's until the exercises pass
    again. The folder, or None when there was nothing to set aside."""
    pieces = kept_pieces(clone, chapter)
    if not pieces:
        return None
    label = chapter_label(find_chapter(clone, chapter).name)
    stem = f"set-aside-{label}-{(now or datetime.now()):%Y%m%d-%H%M%S}"
    folder, n = pieces[0].parent / stem, 1
    while folder.exists():
        n += 1
        folder = pieces[0].parent / f"{stem}-{n}"
    folder.mkdir(mode=0o700)
    for piece in pieces:
        os.replace(piece, folder / piece.name)
    return folder


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
        backup.parent.mkdir(exist_ok=True)
        shutil.copy2(target, backup)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(nbs.dumps(fresh), encoding="utf-8")
    os.replace(partial, target)  # atomic: the notebook is the old one or the fresh one
    return target, backup
