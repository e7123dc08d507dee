"""Scores, the CSV and the JSON reports."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

OUTPUT_LIMIT = 1_000_000  # an exercise that prints more than this scores 0


@dataclass
class Grades:
    notebook: str
    exercises: dict[str, dict]
    warnings: list[str] = field(default_factory=list)
    error: str = ""
    output: str = ""

    @property
    def total(self) -> float:
        return sum(e["points"] for e in self.exercises.values())


def _blank(points: float, status: str, message: str = "") -> dict:
    return {
        "status": status,
        "points": 0,
        "max_points": points,
        "message": message,
        "runtime_s": 0.0,
        "output": "",
    }


def _number(x: float) -> str:
    return f"{x:g}"


def write_csv(path: Path, ids: list[str], all_grades: list[Grades]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", *ids, "total"])
        for g in all_grades:
            row = [_number(g.exercises[x]["points"]) for x in ids]
            writer.writerow([g.notebook, *row, _number(g.total)])


def write_report(folder: Path, grades: Grades, chapter: int, max_total: float, used: set) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    stem, n = Path(grades.notebook).stem, 1
    while (name := stem if n == 1 else f"{stem}-{n}") in used:
        n += 1
    used.add(name)
    report = {
        "notebook": grades.notebook,
        "chapter": chapter,
        "total": grades.total,
        "max_total": max_total,
        "error": grades.error,
        "warnings": grades.warnings,
        "exercises": grades.exercises,
        "process_output": grades.output,
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
