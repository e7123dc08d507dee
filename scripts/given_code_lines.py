"""Lines of code per chapter: what the learner writes against what the notebook gives them.

    python scripts/given_code_lines.py            # a table, one row per solution notebook
    python scripts/given_code_lines.py --json     # the same numbers as JSON

Counted in each solution notebook's code cells that reach the learner (not those tagged
`solution-only`), non-blank lines only:

- written: lines inside `### BEGIN SOLUTION` … `### END SOLUTION` regions (the learner's answers);
- given: every other line a learner sees in a code cell, split into
  - around exercises: the rest of a cell that holds a solution region or a `check(...)` call
    (signatures, docstrings, the check itself), and
  - other cells: imports, experiments, plots, widget helpers, the finale.

Hidden-test regions and marker lines are not counted (the learner never sees them). Code imported
from a module (`qwen_mini.course.lab`, `qwen_mini.course.experiments`) is not in the notebook and so
is not counted: that is the point of moving given experiment code there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qwen_mini.course import notebooks as nbs  # noqa: E402


def count(path: Path) -> dict[str, int]:
    nb = nbs.load(path)
    written = around = other = 0
    for i, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code" or "solution-only" in nbs.tags(cell):
            continue
        text = nbs.source(cell)
        place = nbs.where(path.name, i, cell)
        exercise = nbs.has_markers(text) or bool(nbs.check_ids(text))
        for kind, _indent, lines in nbs._regions(text, place):
            n = sum(1 for line in lines if line.strip())
            if kind == "solution":
                written += n
            elif kind is None and exercise:
                around += n
            elif kind is None:
                other += n
    return {
        "written": written,
        "given": around + other,
        "given_around_exercises": around,
        "given_other_cells": other,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    args = p.parse_args(argv)
    rows = {path.stem: count(path) for path in sorted(args.solutions.glob("ch*.ipynb"))}
    rows["total"] = {k: sum(r[k] for r in rows.values()) for k in next(iter(rows.values()))}
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'chapter':<20} {'written':>8} {'given':>6} {'around ex.':>11} {'other':>6}")
    for name, r in rows.items():
        print(
            f"{name:<20} {r['written']:>8} {r['given']:>6} "
            f"{r['given_around_exercises']:>11} {r['given_other_cells']:>6}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
