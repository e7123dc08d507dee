"""The grader on the real chapters: solutions score full marks, fresh learner copies zero, and a
stub in one exercise does not cost the later exercises that build on it."""

import csv
import json
from pathlib import Path

import pytest

from qwen_mini.course import grade
from qwen_mini.course import notebooks as nbs

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = {0: "ch00_foundations.ipynb", 1: "ch01_attention.ipynb", 2: "ch02_qk_norm.ipynb"}


def _mixed(folder: Path, chapter: int, stub_cell: str) -> Path:
    """The solution notebook with one exercise cell taken from the learner copy (a stub)."""
    solved = nbs.load(ROOT / "solutions" / CHAPTERS[chapter])
    learner = {c["id"]: c for c in nbs.load(ROOT / "course" / CHAPTERS[chapter])["cells"]}
    solved["cells"] = [learner[c["id"]] if c["id"] == stub_cell else c for c in solved["cells"]]
    path = folder / f"stub-{stub_cell}.ipynb"
    path.write_text(json.dumps(solved))
    return path


def _grade(tmp_path: Path, chapter: int, files: list[Path]) -> dict[str, dict]:
    out, reports = tmp_path / "grades.csv", tmp_path / "reports"
    argv = ["--chapter", str(chapter), "--out", str(out), "--reports", str(reports)]
    assert grade.cli(argv + [str(f) for f in files]) == 0
    with open(out, newline="") as f:
        rows = {
            Path(r["notebook"]).parent.name + "/" + Path(r["notebook"]).stem: r
            for r in csv.DictReader(f)
        }
    return rows


@pytest.mark.parametrize(
    "chapter, stub_cell, stubbed, dependent",
    [
        (0, "6a366c8d", "ch00.rotate_half", "ch00.apply_rope"),
        (1, "a988864a", "ch01.repeat_kv", "ch01.Attention"),
        (2, "17187467", "ch02.project_qk", "ch02.logit_stats"),
    ],
)
def test_real_chapter_grades(tmp_path, chapter, stub_cell, stubbed, dependent):
    name = CHAPTERS[chapter]
    mixed = _mixed(tmp_path, chapter, stub_cell)
    rows = _grade(tmp_path, chapter, [ROOT / "solutions" / name, ROOT / "course" / name, mixed])
    stem = Path(name).stem
    solved, learner, partial = rows[f"solutions/{stem}"], rows[f"course/{stem}"], None
    partial = rows[f"{tmp_path.name}/{mixed.stem}"]
    ids = [k for k in solved if k not in ("notebook", "total")]
    assert len(ids) >= 6
    full = sum(float(solved[x]) for x in ids)
    assert full > 0 and float(solved["total"]) == full
    assert all(float(learner[x]) == 0 for x in ids) and float(learner["total"]) == 0
    assert float(partial[stubbed]) == 0
    assert float(partial[dependent]) == float(solved[dependent]) > 0
    assert float(partial["total"]) == full - float(solved[stubbed])
