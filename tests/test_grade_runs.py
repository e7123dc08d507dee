"""The grader run after run: the course secret (the same notebook gets the same grade every
run), the names it prints and writes, the inputs it refuses to follow, and honest code that
starts the compiler or threads inside a check."""

import csv
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from qwen_mini.course import checking
from qwen_mini.course import notebooks as nbs
from qwen_mini.course.checking import PATH_ENV
from qwen_mini.course.grading import cli as grade
from qwen_mini.course.grading.plan import GraderError

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "solutions" / "ch98_grading.ipynb"


def _with_cells(source: Path, replace: dict[str, str], before: dict[str, str] | None = None):
    """The notebook with the cells of the ids in `replace` given new code, and a new code cell
    put before the cells of the ids in `before`."""
    nb, before = nbs.load(source), before or {}
    cells = []
    for cell in nb["cells"]:
        if cell.get("id") in before:
            new = dict(cell, id=f"{cell['id']}-before", source=before[cell["id"]])
            cells.append(dict(new, cell_type="code", outputs=[], execution_count=None))
        cells.append(dict(cell, source=replace[cell["id"]]) if cell.get("id") in replace else cell)
    return dict(nb, cells=cells)


def _grade(argv: list[str], fixture: bool = False) -> int:
    if not fixture:
        return grade.main(argv)
    old = os.environ.get(PATH_ENV)
    os.environ[PATH_ENV] = str(FIXTURES / "checks")
    try:
        return grade.main(["--solutions", str(FIXTURES / "solutions")] + argv)
    finally:
        if old is None:
            del os.environ[PATH_ENV]
        else:
            os.environ[PATH_ENV] = old


def _rows(out: Path) -> list[dict]:
    with open(out, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


# --- the course secret ---------------------------------------------------------------------------

# chapter 0's RMSNorm, wrong in two ways only hidden cases see: a default eps of 1e-5 (one case,
# whatever the secret), and no normalising at widths 20, 28, 36, ... (the hidden case of "other
# widths" draws its width with the secret: caught with some secrets, not with others)
WRONG_EPS = ("eps: float = 1e-6):", "eps: float = 1e-5):")
WRONG_WIDTHS = (
    "        x = x.float()\n",
    "        x = x.float()\n        if x.shape[-1] > 16 and x.shape[-1] % 8 == 4:\n"
    "            return x\n",
)


def _rms_norm_notebook(folder: Path, name: str, old: str, new: str) -> None:
    nb = nbs.load(ROOT / "solutions" / "ch00_foundations.ipynb")
    cell = next(c for c in nb["cells"] if c.get("id") == "c1301374")  # the RMSNorm exercise
    source = nbs.source(cell)
    assert old in source
    cell["source"] = source.replace(old, new)
    (folder / name).write_text(json.dumps(nb))


def test_the_same_folder_gets_the_same_grades_every_run(tmp_path):
    folder = tmp_path / "submissions"
    folder.mkdir()
    _rms_norm_notebook(folder, "wrong_eps.ipynb", *WRONG_EPS)
    _rms_norm_notebook(folder, "wrong_widths.ipynb", *WRONG_WIDTHS)
    secret = tmp_path / "course" / "grading-secret"
    csvs, reports = [], []
    for run in range(2):
        out = tmp_path / f"run{run}" / "grades.csv"
        argv = ["--chapter", "0", "--secret-file", str(secret), "--out", str(out), str(folder)]
        assert _grade(argv) == 0
        csvs.append(out.read_text())
        for p in sorted((out.parent / "grades-reports").glob("*.json")):
            for exercise in json.loads(p.read_text())["exercises"].values():
                reports.append((run, p.name, exercise["status"], exercise["message"]))
    assert csvs[0] == csvs[1]
    assert [r[1:] for r in reports if r[0] == 0] == [r[1:] for r in reports if r[0] == 1]
    rows = {Path(r["notebook"]).name: r for r in _rows(out)}
    assert rows["wrong_eps.ipynb"]["ch00.rms_norm status"] == "failed"
    assert any(r[1] == "wrong_eps.json" and "hidden check" in r[3] for r in reports), reports
    # made on first use, private to the grader's user, kept by the second run
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700


def test_the_course_secret_is_made_once_kept_and_replaced_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN_MINI_HOME", str(tmp_path / "home"))
    first = grade.course_secret(None)
    assert (tmp_path / "home" / "grading-secret").is_file()
    assert grade.course_secret(None) == first
    assert grade.course_secret(None, new=True) != first
    given = tmp_path / "given"
    assert grade.course_secret(given) == int(given.read_text(), 16)
    # a hidden case's inputs follow the secret, and only it
    hidden = checking.Case("ch00.x", "h", None, None, None, 0, 0, 0, True)
    seeds = []
    for secret in (first, first + 1, first):
        checking.new_secret(secret)
        seeds.append(checking._seed(hidden))
    checking.new_secret()
    assert seeds[0] == seeds[2] != seeds[1]


def test_a_course_secret_others_can_read_or_that_is_not_one_is_refused(tmp_path):
    secret = tmp_path / "grading-secret"
    grade.course_secret(secret)
    secret.chmod(0o644)
    with pytest.raises(GraderError, match="only you can read"):
        grade.course_secret(secret)
    secret.chmod(0o600)
    secret.write_text("12345\n")
    with pytest.raises(GraderError, match="not a course secret"):
        grade.course_secret(secret)
    link = tmp_path / "link"
    link.symlink_to(secret)
    with pytest.raises(GraderError, match="is a symbolic link"):
        grade.course_secret(link)


# --- names and paths -----------------------------------------------------------------------------


def test_names_are_escaped_and_links_and_folders_are_never_followed(tmp_path, capsys):
    folder = tmp_path / "submissions"
    folder.mkdir()
    shutil.copy(FIXTURE, folder / "honest.ipynb")
    # a name that would print a forged progress line and a forged CSV row
    forged = "zoe.ipynb: 5\u22155\nmallory,1,1,2,1,5,5\n\x1b[2Kalice.ipynb"
    (folder / forged).write_text(json.dumps(_with_cells(FIXTURE, {"add-one": "x = 1"})))
    (folder / "folder.ipynb").mkdir()
    (folder / "link.ipynb").symlink_to(FIXTURE)
    os.mkfifo(folder / "pipe.ipynb")
    out = tmp_path / "grades.csv"
    code = _grade(["--chapter", "98", "--out", str(out), str(folder)], fixture=True)
    assert code == grade.UNREADABLE
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 6 and not any("\x1b" in line for line in printed), printed
    assert printed[-1].startswith("wrote ")
    assert any(line.startswith(f"{folder}/honest.ipynb: 5/5") for line in printed), printed
    assert not any(line.startswith(("zoe", "mallory", "alice")) for line in printed), printed
    rows = {Path(r["notebook"]).name: r for r in _rows(out)}
    assert len(rows) == 5 and len(out.read_text().splitlines()) == 6
    escaped = "zoe.ipynb: 5\u22155\\nmallory,1,1,2,1,5,5\\n\\x1b[2Kalice.ipynb"
    assert rows[escaped]["ch98.add_one status"] == "missing", rows[escaped]
    reports = {}
    for p in (tmp_path / "grades-reports").glob("*.json"):
        report = json.loads(p.read_text())
        reports[Path(report["notebook"]).name] = report
    for name, why in [
        ("folder.ipynb", "is a folder, not a notebook"),
        ("link.ipynb", "is a symbolic link, not followed"),
        ("pipe.ipynb", "is not a file"),
    ]:
        assert rows[name]["total"] == "0" and rows[name]["ch98.add_one status"] == "unreadable"
        assert why in reports[name]["error"], reports[name]


def test_a_named_link_is_not_followed(tmp_path):
    (tmp_path / "link.ipynb").symlink_to(FIXTURE)
    (tmp_path / "linked").symlink_to(FIXTURE.parent, target_is_directory=True)
    out = tmp_path / "grades.csv"
    files = [str(tmp_path / "link.ipynb"), str(tmp_path / "linked")]
    assert _grade(["--chapter", "98", "--out", str(out), *files], fixture=True) == 3
    assert [r["ch98.Scale status"] for r in _rows(out)] == ["unreadable"] * 2


# --- honest code inside a check ------------------------------------------------------------------

COMPILED_HELPER = """import threading


def _plus(t):
    return t + 1


plus = torch.compile(_plus)  # compiled on its first call: inside the check


def in_thread(f, *args):
    out = []
    thread = threading.Thread(target=lambda: out.append(f(*args)))
    thread.start()
    thread.join()
    return out[0]"""

USES_THEM = {
    "add-one": 'def add_one(x):\n    return plus(x)\n\n\ncheck("ch98.add_one", add_one)',
    "scale": "class Scale:\n    def __init__(self, factor):\n        self.factor = factor\n\n"
    "    def __call__(self, x):\n        return in_thread(torch.mul, x, self.factor)\n\n\n"
    'check("ch98.Scale", Scale)',
}


def test_a_helper_compiled_in_another_cell_and_threads_work_in_a_check(tmp_path):
    nb = _with_cells(FIXTURE, USES_THEM, before={"add-one": COMPILED_HELPER})
    (tmp_path / "compiled.ipynb").write_text(json.dumps(nb))
    out = tmp_path / "grades.csv"
    # inductor compiles C++ on the first call: seconds of CPU, more on a busy machine
    argv = ["--chapter", "98", "--timeout", "300", "--budget", "900", "--out", str(out)]
    assert _grade([*argv, str(tmp_path / "compiled.ipynb")], fixture=True) == 0
    report = json.loads((tmp_path / "grades-reports" / "compiled.json").read_text())
    (row,) = _rows(out)
    assert row["total"] == "5", report["exercises"]
    assert report["warnings"] == [], report["warnings"]
