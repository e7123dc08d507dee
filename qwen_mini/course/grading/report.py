"""Scores, the CSV and the JSON reports; written only by the grader, each file atomically.

Points are computed here from each exercise's status, never read from a worker: an exercise
scores its points when its status is `passed`, 0 otherwise.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .plan import GraderError, display_name, safe_text

STATUSES = (
    "passed",  # every public and hidden check passed
    "failed",  # a check failed: the answer is wrong
    "not attempted",  # the exercise's code still raises NotImplementedError
    "timeout",  # a cell or the checks ran past the time limit or the notebook's budget
    "crashed",  # a cell raised or exited, the process died, ran out of memory, broke the channel
    "tampered",  # the submission changed what the grader relies on
    "reference",  # the exercise was answered by the package's own reference
    "missing",  # no check call and no object of the exercise's name
    "unreadable",  # the notebook could not be found or read
)


@dataclass
class Grades:
    notebook: str
    points: dict[str, float]  # exercise id -> maximum points
    exercises: dict[str, dict] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    error: str = ""
    output: str = ""

    def __post_init__(self):
        for exercise in self.points:
            self.set(exercise, "missing", "no check call and no object of this name")

    def set(self, exercise: str, status: str, message: str = "", **extra) -> None:
        assert status in STATUSES, status
        entry = {
            "status": status,
            "points": self.points[exercise] if status == "passed" else 0,
            "max_points": self.points[exercise],
            "message": message,
        }
        entry.update(extra)
        self.exercises[exercise] = entry

    @property
    def total(self) -> float:
        return sum(e["points"] for e in self.exercises.values())

    @property
    def max_total(self) -> float:
        return sum(self.points.values())


def number(x: float) -> str:
    return f"{x:g}"


def _clean(value):
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class Folder:
    """A folder the grader writes its files into, opened once before any submission runs and
    then written through that descriptor: a name renamed, replaced or linked later (by a
    submission that can write where the folder is) never redirects a write. Every file is
    written whole to a temporary name, then renamed over its own name."""

    def __init__(self, path: Path, own: bool = False):
        """`own`: a folder of the grader's (the reports): created here, or refused if it exists
        and is not a folder of the grader's user that no one else can write."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)  # nothing runs yet that could race it
        if not own:
            path.mkdir(exist_ok=True)
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            return
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path.name, 0o700, dir_fd=parent)
            try:
                self.fd = os.open(
                    path.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent
                )
            except OSError as e:  # a symbolic link (ELOOP) or a file (ENOTDIR)
                kind = "a symbolic link" if os.path.islink(path) else "not a folder"
                raise GraderError(_refused(path, f"is {kind} ({e.strerror})")) from None
        finally:
            os.close(parent)
        st, why = os.fstat(self.fd), ""
        if st.st_uid != os.geteuid():
            why = f"belongs to user {st.st_uid}, not to the grader's ({os.geteuid()})"
        elif st.st_mode & 0o022:
            why = f"can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
        if why:
            os.close(self.fd)
            raise GraderError(_refused(path, why))

    def write(self, name: str, text: str) -> None:
        tmp = f".{name}.{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
                f.write(text)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def close(self) -> None:
        os.close(self.fd)


def _refused(path: Path, why: str) -> str:
    return (
        f"the reports folder {display_name(path)} already exists and {why}; another user (a "
        "submission?) may have made it. Remove it, or name a new folder with --reports"
    )


def csv_text(ids: list[str], all_grades: list[Grades]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(
        ["notebook", *ids, "total", "max_total", *(f"{x} status" for x in ids)]
        + [f"{x} max" for x in ids]
    )
    for g in all_grades:
        points = [number(g.exercises[x]["points"]) for x in ids]
        statuses = [g.exercises[x]["status"] for x in ids]
        maxima = [number(g.points[x]) for x in ids]
        writer.writerow(
            [safe_text(g.notebook), *points, number(g.total), number(g.max_total), *statuses]
            + maxima
        )
    return out.getvalue()


def report_name(notebook: str, used: set[str]) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(notebook).stem)[:100] or "notebook"
    name, n = stem, 1
    while name in used:
        n += 1
        name = f"{stem}-{n}"
    used.add(name)
    return name


MAX_WARNINGS, MAX_WARNING_CHARS = 100, 1000  # a report stays small whatever a notebook holds


def bounded(warnings: list[str]) -> list[str]:
    """At most MAX_WARNINGS warnings of at most MAX_WARNING_CHARS each (a cell magic's name
    can be megabytes long), saying what was left out."""
    kept = [w if len(w) <= MAX_WARNING_CHARS else w[:MAX_WARNING_CHARS] + "…" for w in warnings]
    if len(kept) > MAX_WARNINGS:
        kept = kept[:MAX_WARNINGS] + [f"… and {len(kept) - MAX_WARNINGS} more warnings"]
    return kept


def write_report(folder: Folder, name: str, grades: Grades, chapter: int) -> None:
    report = {
        "notebook": grades.notebook,
        "chapter": chapter,
        "total": grades.total,
        "max_total": grades.max_total,
        "error": grades.error,
        "warnings": bounded(grades.warnings),
        "exercises": grades.exercises,
        "process_output": grades.output,
    }
    folder.write(f"{name}.json", json.dumps(_clean(report), indent=1, ensure_ascii=False) + "\n")
