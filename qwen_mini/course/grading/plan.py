"""A reference notebook and a submission into a plan: the exercises, and the cells to run.

A submission is read as Jupyter would run it: every code cell, in order. Whatever its bytes
(not UTF-8, not JSON, cells of the wrong type), reading it never raises: an unreadable file is a
`Submission` with an `error`, a malformed cell is skipped with a warning.
"""

from __future__ import annotations

import json
import os
import stat
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from .. import notebooks as nbs
from ..checking import Exercise, exercises

ROOT = Path(__file__).resolve().parents[3]
MAX_NOTEBOOK_BYTES = 100 * 2**20  # a bigger file is not read (outputs included)
MAX_CELL_CHARS = 4 * 2**20  # a cell's code is sent to the sandbox in one message (protocol.py)


class GraderError(RuntimeError):
    """The grader itself cannot run (no reference notebook, broken checks): nothing is graded."""


@dataclass
class Reference:
    chapter: str  # "ch01"
    notebook: Path
    exercises: list[Exercise]
    names: dict[str, str]  # exercise id -> the name the exercise defines (what check() gets)
    order: list[str]  # the exercise ids in the order the reference notebook checks them

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.exercises]

    def points(self, exercise: str) -> float:
        return next(e.points for e in self.exercises if e.id == exercise)


def load_reference(solutions: Path, chapter: int) -> Reference:
    prefix = f"ch{chapter:02d}"
    found = sorted(solutions.glob(f"{prefix}_*.ipynb"))
    if len(found) != 1:
        what = ", ".join(p.name for p in found) or "none"
        raise GraderError(f"expected one {solutions}/{prefix}_*.ipynb, found {what}")
    nb = nbs.load(found[0])
    objects = {}
    for i, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") == "code":
            text = nbs.export_source(nbs.source(cell), nbs.where(found[0], i, cell))
            objects.update(nbs.check_calls(text))
    try:
        registered = exercises(prefix)
    except Exception as e:
        raise GraderError(f"could not load the checks of {prefix}: {type(e).__name__}: {e}") from e
    if not registered:
        raise GraderError(f"no exercises are registered for {prefix} (qwen_mini/course/checks)")
    names = {}
    for e in registered:
        expression = objects.get(e.id) or ""
        names[e.id] = expression if expression.isidentifier() else e.id.split(".", 1)[1]
    order = [x for x in objects if x in names] + [x for x in names if x not in objects]
    return Reference(prefix, found[0], registered, names, order)


def display_name(path: Path) -> str:
    """The path as text that can always be written and printed: undecodable bytes and control
    characters (a newline, an escape sequence, a direction override) shown escaped, so that a
    file's name cannot forge a progress line, a CSV row or what a terminal shows."""
    text = safe_text(os.fsdecode(path))
    return "".join(_escaped(c) for c in text)


def _escaped(c: str) -> str:
    if c == " " or unicodedata.category(c)[0] not in "CZ":  # control, format, separator
        return c
    return c.encode("unicode_escape").decode("ascii")


def safe_text(text: str) -> str:
    """`text` with lone surrogates (undecodable file names, learner output) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class Cell:
    index: int
    source: str
    mentions: list[str]  # exercise ids named in a `check("…")` call in the cell's text


@dataclass
class Submission:
    path: Path
    name: str
    cells: list[Cell] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str = ""  # why it could not be read ("" if it was)


def read_submission(path: Path, chapter: str) -> Submission:
    sub = Submission(path, display_name(path))
    try:  # never through a symbolic link; a FIFO does not block
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        sub.error = "not found"
        return sub
    except OSError as e:
        if os.path.islink(path):
            sub.error = "is a symbolic link, not followed (submit the notebook itself)"
        else:
            sub.error = f"could not be read ({e.strerror or type(e).__name__})"
        return sub
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        sub.error = "is a folder, not a notebook" if stat.S_ISDIR(mode) else "is not a file"
        return sub
    with open(fd, "rb") as f:
        try:
            data = f.read(MAX_NOTEBOOK_BYTES + 1)
        except OSError as e:
            sub.error = f"could not be read ({e.strerror or type(e).__name__})"
            return sub
    if len(data) > MAX_NOTEBOOK_BYTES:
        sub.error = f"too big to grade (over {_mb(MAX_NOTEBOOK_BYTES)}; clear its outputs)"
        return sub
    try:
        nb = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        sub.error = "not a readable notebook (not UTF-8)"
        return sub
    except (json.JSONDecodeError, RecursionError) as e:
        sub.error = f"not a readable notebook (not JSON: {e})"
        return sub
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        sub.error = "not a Jupyter notebook (no list of cells)"
        return sub
    for i, cell in enumerate(nb["cells"]):
        if not isinstance(cell, dict):
            sub.warnings.append(f"cell {i} is not a JSON object; skipped")
            continue
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            source = "".join(source)
        if not isinstance(source, str):
            kind = type(source).__name__ if source is not None else "null"
            sub.warnings.append(f"cell {i} has a source of type {kind}; skipped")
            continue
        if len(source) > MAX_CELL_CHARS:
            sub.error = (
                f"too big to grade: cell {i} holds {_mb(len(source))} of code (the limit is "
                f"{_mb(MAX_CELL_CHARS)} a cell)"
            )
            sub.cells = []
            return sub
        mentions = [x for x in nbs.check_ids(source) if x.startswith(chapter + ".")]
        sub.cells.append(Cell(i, source, list(dict.fromkeys(mentions))))
    return sub


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"
