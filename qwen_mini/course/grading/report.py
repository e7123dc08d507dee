"""Scores, the CSV and the JSON reports; written only by the grader, each file atomically.

Points are computed here from each exercise's status, never read from a worker: an exercise
scores its points when its status is `passed`, 0 otherwise.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .plan import safe_text

STATUSES = (
    "passed",  # every public and hidden check passed
    "failed",  # a check failed, or the exercise is not implemented yet
    "timeout",  # a cell or the checks ran past the time limit or the notebook's budget
    "crashed",  # a cell raised or exited, the process died, ran out of memory, broke the channel
    "tampered",  # the submission changed what the grader relies on, or left helpers running
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


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with_suppress_unlink(tmp)
        raise


def with_suppress_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def csv_text(ids: list[str], all_grades: list[Grades]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["notebook", *ids, "total", "max_total", *(f"{x} status" for x in ids)])
    for g in all_grades:
        points = [number(g.exercises[x]["points"]) for x in ids]
        statuses = [g.exercises[x]["status"] for x in ids]
        writer.writerow(
            [safe_text(g.notebook), *points, number(g.total), number(g.max_total), *statuses]
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


def write_report(folder: Path, name: str, grades: Grades, chapter: int) -> Path:
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
    path = folder / f"{name}.json"
    write_atomic(path, json.dumps(_clean(report), indent=1, ensure_ascii=False) + "\n")
    return path
