"""The grader on the fixture chapter: good, empty and hostile submissions in one run.

One `qwen-mini grade` run grades every submission below (the slow part is starting the worker
that imports torch, so it happens once); each test then reads that run's CSV and JSON reports.
"""

import csv
import json
import os
from pathlib import Path

import pytest

from qwen_mini.course import build
from qwen_mini.course import notebooks as nbs
from qwen_mini.course.checking import PATH_ENV
from qwen_mini.course.grading import cli as grade
from qwen_mini.course.grading.sandbox import PROCESS_OUTPUT_CAP
from qwen_mini.course.grading.worker import OUTPUT_CAP

FIXTURES = Path(__file__).parent / "fixtures"
SOLUTION = FIXTURES / "solutions" / "ch99_fixture.ipynb"
IDS = ["ch99.add_one", "ch99.mean_square", "ch99.Scale"]
TIMEOUT = 2  # seconds per exercise

ADD_ONE = 'def add_one(x):\n    return x + 1\n\n\ncheck("ch99.add_one", add_one)'
CHECK_MEAN_SQUARE = 'check("ch99.mean_square", mean_square)'
# each submission: the solution notebook with these cells (by id) replaced; None deletes the cell
SUBMISSIONS = {
    "raises": {"add-one": 'raise ValueError("boom")\n' + ADD_ONE},
    "hidden": {"add-one": ADD_ONE.replace("x + 1", "x + 1.0")},  # public checks pass, hidden fail
    "loops": {"mean-square": "while True:\n    pass\n" + CHECK_MEAN_SQUARE},
    "hangs_in_check": {
        "scale": "class Scale:\n    def __init__(self, f):\n        while True:\n"
        "            pass\n\n\ncheck('ch99.Scale', Scale)"
    },
    "hog": {
        "add-one": "import torch\n\nblob = torch.empty(8 * 2**30, dtype=torch.uint8)\n" + ADD_ONE
    },
    "chatty": {
        "add-one": ADD_ONE + "\nfor _ in range(100_000):\n    print('x' * 50)\n"
        "import os\nos.write(1, b'y' * 3_000_000)"
    },
    "sys_exit": {"mean-square": "import sys\n\nsys.exit(3)\n" + CHECK_MEAN_SQUARE},
    "os_exit": {"add-one": "import os\n\nos._exit(7)\n" + ADD_ONE},
    "kills_worker": {
        "mean-square": "import os\nimport signal\n\nos.kill(os.getppid(), signal.SIGKILL)\n"
        + CHECK_MEAN_SQUARE
    },
    "patches_torch": {
        "add-one": "import torch\n\ntorch.allclose = lambda *a, **k: True\n" + ADD_ONE
    },
    "patches_checks": {
        "add-one": "from qwen_mini.course import checking\n\nchecking._EXERCISES['ch99.add_one']"
        ".public.clear()\n" + ADD_ONE.replace("x + 1", "x + 2")
    },
    "missing": {"scale": None},
    "duplicated": {"solution-demo": ADD_ONE.replace("x + 1", "x - 1")},  # a later, wrong copy
    "imports": {"add-one": "import qwen_mini.cli\nimport torch.distributions\n\n" + ADD_ONE},
    "magics": {
        "scale": "%%time\n%matplotlib inline\n!echo hello\nclass Scale:\n"
        "    def __init__(self, f):\n        self.f = f\n\n    def __call__(self, x):\n"
        "        return x * self.f\n\n\ncheck('ch99.Scale', Scale)"
    },
    "borrowed": {
        "add-one": "from qwen_mini_extra_exercises.ch99 import _add_one as add_one\n\n"
        'check("ch99.add_one", add_one)'
    },
}


def _submission(folder: Path, name: str, changes: dict) -> Path:
    nb = nbs.load(SOLUTION)
    cells = []
    for cell in nb["cells"]:
        if cell.get("id") in changes:
            if changes[cell["id"]] is None:
                continue
            cell = dict(cell, source=changes[cell["id"]], cell_type="code")
        cells.append(cell)
    nb["cells"] = cells
    path = folder / f"{name}.ipynb"
    path.write_text(nbs.dumps(nb))
    return path


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade every submission once; return (exit code, CSV rows by name, reports by name)."""
    folder = tmp_path_factory.mktemp("submissions")
    learner = build.learner_notebook(nbs.load(SOLUTION), SOLUTION.name)
    (folder / "learner.ipynb").write_text(nbs.dumps(learner))
    (folder / "solution.ipynb").write_text(SOLUTION.read_text())
    for name, changes in SUBMISSIONS.items():
        _submission(folder, name, changes)
    (folder / "garbage.ipynb").write_text("this is not JSON {")
    out, reports = folder / "out" / "grades.csv", folder / "reports"
    old = os.environ.get(PATH_ENV)
    os.environ[PATH_ENV] = str(FIXTURES / "checks")
    try:
        code = grade.main(
            [
                "--chapter",
                "99",
                "--solutions",
                str(FIXTURES / "solutions"),
                "--out",
                str(out),
                "--reports",
                str(reports),
                "--timeout",
                str(TIMEOUT),
                "--memory-mb",
                "1024",
                str(folder),
            ]
        )
    finally:
        if old is None:
            del os.environ[PATH_ENV]
        else:
            os.environ[PATH_ENV] = old
    with open(out, newline="") as f:
        rows = list(csv.reader(f))
    by_name = {Path(r[0]).stem: r for r in rows[1:]}
    found = {p.stem: json.loads(p.read_text()) for p in reports.glob("*.json")}
    return code, rows[0], by_name, found


def status(report, exercise):
    return report["exercises"][exercise]["status"]


def test_run_finishes_and_writes_every_row(graded):
    code, header, rows, reports = graded
    assert code == 0
    assert header == ["notebook", *IDS, "total"]
    expected = {"learner", "solution", "garbage", *SUBMISSIONS}
    assert set(rows) == expected and set(reports) == expected


def test_solution_gets_full_marks(graded):
    _, _, rows, reports = graded
    assert rows["solution"][1:] == ["1", "2", "1", "4"]
    assert reports["solution"]["total"] == 4 == reports["solution"]["max_total"]
    assert all(e["status"] == "passed" for e in reports["solution"]["exercises"].values())
    assert reports["solution"]["warnings"] == []


def test_learner_copy_gets_zero(graded):
    _, _, rows, reports = graded
    assert rows["learner"][1:] == ["0", "0", "0", "0"]
    assert {status(reports["learner"], x) for x in IDS} == {"not-implemented"}


@pytest.mark.parametrize(
    "name, exercise, expected, message, total",
    [
        ("raises", "ch99.add_one", "error", "ValueError: boom (line 1 of the cell)", "3"),
        ("hidden", "ch99.add_one", "failed", "keeps integers integer", "3"),
        ("loops", "ch99.mean_square", "timeout", f"within {TIMEOUT} s", "2"),
        ("hangs_in_check", "ch99.Scale", "timeout", "within", "3"),
        ("hog", "ch99.add_one", "memory", "more than the 1024 MB memory limit", "3"),
        ("sys_exit", "ch99.mean_square", "error", "sys.exit(3)", "2"),
        ("os_exit", "ch99.add_one", "error", "exited with code 7", "3"),
        ("missing", "ch99.Scale", "missing", 'no cell calls check("ch99.Scale", …)', "3"),
        ("duplicated", "ch99.add_one", "failed", "expected 2", "3"),
        ("borrowed", "ch99.add_one", "failed", "the package's own implementation", "3"),
    ],
)
def test_bad_submission_costs_only_that_exercise(graded, name, exercise, expected, message, total):
    _, _, rows, reports = graded
    entry = reports[name]["exercises"][exercise]
    assert entry["status"] == expected
    assert message in entry["message"]
    assert entry["points"] == 0
    assert rows[name][-1] == total
    others = [x for x in IDS if x != exercise]
    assert all(status(reports[name], x) == "passed" for x in others), reports[name]


def test_killing_the_grading_worker_costs_points_not_the_run(graded):
    # The submission's process outlives the worker it killed for a moment; how far it gets
    # before it is stopped depends on timing, so only what must hold is asserted here. The
    # notebooks graded after it (every other test) show that the run went on.
    _, _, rows, reports = graded
    entry = reports["kills_worker"]["exercises"]["ch99.mean_square"]
    assert entry["status"] == "error" and entry["points"] == 0
    assert status(reports["kills_worker"], "ch99.add_one") == "passed"
    assert rows["kills_worker"][-1] in ("1", "2")
    scale = reports["kills_worker"]["exercises"]["ch99.Scale"]
    assert scale["status"] == "passed" or "worker was killed" in scale["message"]


def test_later_copy_of_a_duplicate_is_graded_with_a_warning(graded):
    report = graded[3]["duplicated"]
    assert any(
        "ch99.add_one is checked in cells" in w and "later copy" in w for w in report["warnings"]
    )


def test_printing_megabytes_scores_zero_and_is_capped(graded):
    _, _, rows, reports = graded
    report = reports["chatty"]
    entry = report["exercises"]["ch99.add_one"]
    assert entry["status"] == "output" and entry["points"] == 0
    assert "5,100,000 characters" in entry["message"]
    assert rows["chatty"][-1] == "3"  # the other exercises still count
    assert len(entry["output"]) <= OUTPUT_CAP
    assert len(report["process_output"]) <= PROCESS_OUTPUT_CAP
    assert any("3000000 bytes" in w for w in report["warnings"])


def test_importing_modules_is_not_tampering(graded):
    _, _, rows, reports = graded
    assert rows["imports"][-1] == "4", reports["imports"]


def test_magics_do_not_break_grading(graded):
    _, _, rows, reports = graded
    assert rows["magics"][-1] == "4", reports["magics"]


def test_unreadable_notebook_is_recorded(graded):
    _, _, rows, reports = graded
    assert rows["garbage"][1:] == ["0", "0", "0", "0"]
    assert "not a readable notebook" in reports["garbage"]["error"]


def test_missing_reference_is_a_clear_error(tmp_path, capsys):
    code = grade.main(
        [
            "--chapter",
            "42",
            "--solutions",
            str(tmp_path),
            "--out",
            str(tmp_path / "g.csv"),
            str(SOLUTION),
        ]
    )
    assert code == 1
    assert "ch42_*.ipynb" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, replaced",
    [("patches_torch", "`torch.allclose`"), ("patches_checks", "`the checks of ch99.add_one`")],
)
def test_patching_what_the_checks_rely_on_scores_zero(graded, name, replaced):
    _, _, rows, reports = graded
    entry = reports[name]["exercises"]["ch99.add_one"]
    assert entry["status"] == "tampered" and entry["points"] == 0
    assert replaced in entry["message"]
    # the patch stays in the process, so the later exercises cannot be trusted either
    assert {status(reports[name], x) for x in IDS} == {"tampered"}
    assert rows[name][-1] == "0"
