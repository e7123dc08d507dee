"""A reference notebook and a submission into a plan: what runs, in which order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import notebooks as nbs

ROOT = Path(__file__).resolve().parents[3]


class GraderError(RuntimeError):
    """The grader itself cannot run (no reference notebook, broken checks): nothing is graded."""


@dataclass
class Reference:
    chapter: str  # "ch01"
    notebook: Path
    setup: list[str]  # sources of the reference's `setup` cells
    objects: dict[str, str]  # exercise id -> expression the reference passes to check()


@dataclass
class Step:
    cell: int  # index of the submission's cell
    source: str
    ids: list[str]  # exercises graded right after this cell


def load_reference(solutions: Path, chapter: int) -> Reference:
    prefix = f"ch{chapter:02d}"
    found = sorted(solutions.glob(f"{prefix}_*.ipynb"))
    if len(found) != 1:
        what = ", ".join(p.name for p in found) or "none"
        raise GraderError(f"expected one {solutions}/{prefix}_*.ipynb, found {what}")
    nb = nbs.load(found[0])
    setup, objects = [], {}
    for i, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code":
            continue
        text = nbs.export_source(nbs.source(cell), nbs.where(found[0], i, cell))
        if "setup" in nbs.tags(cell):
            setup.append(text)
        objects.update(nbs.check_calls(text))
    return Reference(prefix, found[0], setup, objects)


def plan(nb: dict, chapter: str, known: list[str]) -> tuple[list[Step], list[str]]:
    """The submission's exercise cells to run, and warnings (duplicates, unknown ids)."""
    cells: dict[str, list[int]] = {}
    warnings = []
    for i, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code":
            continue
        for exercise in nbs.check_ids(nbs.source(cell)):
            if not exercise.startswith(chapter + "."):
                continue
            if exercise not in known:
                warnings.append(f"cell {i} checks {exercise!r}, which is not an exercise; ignored")
            elif i not in cells.setdefault(exercise, []):
                cells[exercise].append(i)
    last = {}
    for exercise, where in cells.items():
        if len(where) > 1:
            warnings.append(
                f"{exercise} is checked in cells {', '.join(map(str, where))}: "
                f"graded the later copy (cell {where[-1]})"
            )
        last[exercise] = where[-1]
    steps = []
    for i in sorted(set(last.values())):
        ids = [x for x in known if last.get(x) == i]
        steps.append(Step(i, nbs.source(nb["cells"][i]), ids))
    return steps, warnings
