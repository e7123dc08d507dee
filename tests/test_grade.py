"""The grader's red-team corpus: submissions of the fixture chapter 98 written to break it.

One `qwen-mini-course grade` run grades every submission (each in a jail of its own, whose
worker imports torch: the slow part, so the corpus is graded once); each test reads that run's
CSV and JSON reports and asserts a property an instructor relies on, whatever mechanism provides it:

1. one student cannot change another student's result;
2. nothing in one notebook stops the run, and every input gets a row;
3. honest notebooks are graded as Jupyter runs them;
4. a blank notebook cannot earn marks.

Submissions are the solution notebook ("solution") or the fresh learner copy ("blank") with some
cells replaced, one file each in tests/fixtures/hostile/ (its README gives the format). The
solution is graded again first and last ("a_first", "z_last"): its row must not change whatever
the submissions graded between them did.
"""

import csv
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from qwen_mini.course import build, checking
from qwen_mini.course import notebooks as nbs
from qwen_mini.course.checking import PATH_ENV
from qwen_mini.course.grading import cli as grade
from qwen_mini.course.grading import jail
from qwen_mini.course.grading.sandbox import PROCESS_OUTPUT_CAP, SUBMISSION_PREFIX

# `pytest -n 2 --dist loadgroup` (the Makefile) runs this file in one worker: its module
# fixtures grade the whole corpus once
pytestmark = pytest.mark.xdist_group("test_grade")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
SOLUTION = FIXTURES / "solutions" / "ch98_grading.ipynb"
IDS = ["ch98.add_one", "ch98.add_two", "ch98.mean_square", "ch98.Scale"]
FULL = ["1", "1", "2", "1"]
# seconds per cell / exercise, and per notebook: the budget is wall time, so it leaves a notebook
# that lost one cell to a timeout room for its jail's restart on a busy machine
TIMEOUT, BUDGET = 6, 30
MARKER = f"qwen-mini-redteam-{os.getpid()}"  # in the command line of processes submissions start

HOSTILE = FIXTURES / "hostile"  # one file per submission; the format is in _submission


def _submission(path: Path) -> tuple[str, dict]:
    """(base notebook, {cell id: new source, None to delete it, a list for several cells}) from
    a file holding `# base: solution` or `# base: blank`, then the new cells, each
    after a `# %% <cell id>` line (`# %% <cell id> deleted` removes the cell, `*N` after the id
    repeats it N times). @ROOT@ and @MARKER@ stand for ROOT and MARKER; @OUT@ for the CSV path,
    @SECRET@ for the course secret's."""
    text = path.read_text().replace("@ROOT@", str(ROOT)).replace("@MARKER@", MARKER)
    head, *cells = re.split(r"^# %% ", text, flags=re.M)
    base = re.search(r"^# base: (solution|blank)$", head, flags=re.M)
    assert base and cells, f"{path}: needs a '# base: ...' line and at least one '# %% <cell id>'"
    changes = {}
    for cell in cells:
        marker, _, source = cell.partition("\n")
        cell_id, _, how = marker.partition(" ")
        if how == "deleted":
            changes[cell_id] = None
            continue
        times = int(how.removeprefix("*")) if how else 1
        changes.setdefault(cell_id, []).extend([source.rstrip("\n")] * times)
    return base.group(1), changes


SUBMISSIONS = {p.stem: _submission(p) for p in sorted(HOSTILE.glob("*.py"))}


def _notebook(base: dict, changes: dict) -> dict:
    nb = json.loads(json.dumps(base))
    cells = []
    for cell in nb["cells"]:
        if cell.get("id") not in changes:
            cells.append(cell)
            continue
        new = changes[cell["id"]]
        if new is None:
            continue
        for n, text in enumerate(new if isinstance(new, list) else [new]):
            cells.append(dict(cell, id=f"{cell['id']}-{n}", source=text, cell_type="code"))
    nb["cells"] = cells
    return nb


def _run(folder: Path, out: Path, extra: list[str] = ()) -> int:
    old = os.environ.get(PATH_ENV)
    os.environ[PATH_ENV] = str(FIXTURES / "checks")
    try:
        return grade.main(
            ["--chapter", "98", "--solutions", str(FIXTURES / "solutions"), "--out", str(out)]
            + ["--timeout", str(TIMEOUT), "--budget", str(BUDGET), "--memory-mb", "1024"]
            + list(extra)
        )
    finally:
        if old is None:
            del os.environ[PATH_ENV]
        else:
            os.environ[PATH_ENV] = old


def _rows(out: Path) -> dict[str, dict]:
    with open(out, newline="", encoding="utf-8") as f:
        return {Path(r["notebook"]).stem: r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade the corpus once: (exit code, rows by name, reports by name, seconds, folder)."""
    folder = tmp_path_factory.mktemp("submissions")
    solution = nbs.load(SOLUTION)
    blank = build.learner_notebook(solution, SOLUTION.name)
    bases = {"solution": solution, "blank": blank}
    for name in ("a_first", "solution", "z_last"):
        (folder / f"{name}.ipynb").write_text(nbs.dumps(solution))
    (folder / "blank.ipynb").write_text(nbs.dumps(blank))
    out = folder / "out" / "grades.csv"
    for name, (base, changes) in SUBMISSIONS.items():
        text = nbs.dumps(_notebook(bases[base], changes)).replace("@OUT@", str(out))
        text = text.replace("@SECRET@", str(grade.home() / grade.SECRET_FILE))
        (folder / f"{name}.ipynb").write_text(text)
    # inputs the grader must survive reading
    (folder / "s2_not_json.ipynb").write_text("this is not JSON {")
    (folder / "s2_not_utf8.ipynb").write_bytes(b'{"cells": ["\xff\xfe"]}')
    odd = dict(solution, cells=[*solution["cells"], None, 7, {"cell_type": "code", "source": None}])
    odd["cells"] += [{"cell_type": "code", "source": 42}, {"cell_type": "code", "source": {"a": 1}}]
    odd["cells"] += [{"cell_type": None}, {"cell_type": "code", "source": ["x = 1\n", 3]}]
    (folder / "s2_odd_cells.ipynb").write_text(json.dumps(odd))
    # megabytes of cell-magic names, 120 skipped magics: warnings a report must bound
    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None}
    magics = [dict(cell, id=f"long-{n}", source=f"%%{'m' * 2_000_000}{n}\npass") for n in range(3)]
    magics += [dict(cell, id=f"many-{n}", source="%lsmagic") for n in range(120)]
    long_names = dict(solution, cells=[*solution["cells"], *magics])
    (folder / "s2_long_magic_names.ipynb").write_text(json.dumps(long_names))
    (folder / os.fsdecode(b"s2_caf\xe9_latin1_name.ipynb")).write_text(nbs.dumps(solution))
    started = time.monotonic()
    code = _run(folder, out, ["--jobs", "2", str(folder)])  # two grading processes at once
    seconds = time.monotonic() - started
    (folder / "secret.txt").write_text(str(checking._SECRET))  # the course's, read in this process
    rows = _rows(out)
    reports = {}
    for p in (folder / "out" / "grades-reports").glob("*.json"):
        report = json.loads(p.read_text(encoding="utf-8"))
        reports[Path(report["notebook"]).stem] = report
    return code, rows, reports, seconds, folder


def statuses(rows, name):
    return [rows[name][f"{x} status"] for x in IDS]


def points(rows, name):
    return [rows[name][x] for x in IDS]


# --- the honest baseline -------------------------------------------------------------------------


def test_solution_full_marks_blank_zero(graded):
    _, rows, reports, _, _ = graded
    assert points(rows, "solution") == FULL and rows["solution"]["total"] == "5"
    assert rows["solution"]["max_total"] == "5" and statuses(rows, "solution") == ["passed"] * 4
    assert points(rows, "blank") == ["0"] * 4 and statuses(rows, "blank") == ["not attempted"] * 4
    assert all("not implemented" in e["message"] for e in reports["blank"]["exercises"].values())


def test_the_csv_carries_each_exercise_maximum_and_wrong_is_not_unattempted(graded):
    _, rows, reports, _, _ = graded
    for name in ("solution", "blank", "s2_not_json"):
        assert [rows[name][f"{x} max"] for x in IDS] == FULL  # the fixture's points, by hand
    entry = reports["s2_raises_after_first_of_two_hangs"]["exercises"]["ch98.add_one"]
    assert entry["max_points"] == 1 and entry["points"] == 0
    # a wrong answer is `failed` (see also the hidden check's test), a stub `not attempted`
    assert reports["s4_tensor_subclass"]["exercises"]["ch98.mean_square"]["status"] == "failed"


# --- 1. one student cannot change another student's result ----------------------------------------


def test_other_students_rows_are_unchanged(graded):
    _, rows, _, _, _ = graded
    for name in ("a_first", "z_last"):
        assert {k: v for k, v in rows[name].items() if k != "notebook"} == {
            k: v for k, v in rows["solution"].items() if k != "notebook"
        }


def test_planted_modules_do_not_reach_the_next_submission(graded):
    _, rows, reports, _, _ = graded
    # two submissions plant torch.py, sitecustomize.py... everywhere they can write: both, and
    # every notebook graded after them, still import the real modules and score as before
    assert rows["s1_plants_modules"]["total"] == rows["s1_plants_too"]["total"] == "5"


def test_each_submission_runs_in_a_fresh_folder_outside_the_repository(graded):
    _, _, reports, _, folder = graded
    cwds = []
    for name in ("s1_plants_modules", "s1_plants_too"):
        line = next(x for x in reports[name]["process_output"].splitlines() if x.startswith("CWD="))
        cwds.append(Path(line[4:]))
    assert cwds[0] != cwds[1]
    for cwd in cwds:
        assert ROOT not in cwd.parents and folder not in cwd.parents
        assert not cwd.exists()  # removed once graded


def test_learner_code_runs_as_an_unprivileged_user_in_its_own_namespaces(graded):
    _, _, reports, _, _ = graded
    for name in ("s1_plants_modules", "s1_plants_too"):
        line = next(x for x in reports[name]["process_output"].splitlines() if x.startswith("UID="))
        assert int(line[4:]) == jail.JAIL_UID != 0  # in the jail's user namespace


def test_no_process_of_a_submission_outlives_its_grading(graded):
    survivors = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if MARKER.encode() in cmd.read_bytes():
                survivors.append(cmd.parent.name)
        except OSError:
            pass
    assert survivors == []
    # this run's groups only: another test's grading may run beside it
    groups = list(Path("/sys/fs/cgroup").glob(f"*/qwen-mini-grading/{SUBMISSION_PREFIX}*"))
    assert not [g for g in groups if (g / "cgroup.procs").read_text().strip()]


def test_the_csv_is_the_graders(graded):
    code, rows, _, _, folder = graded
    expected = {"a_first", "solution", "z_last", "blank", *SUBMISSIONS}
    expected |= {"s2_not_json", "s2_not_utf8", "s2_odd_cells", "s2_caf\\udce9_latin1_name"}
    expected |= {"s2_long_magic_names"}
    assert set(rows) == expected
    time.sleep(1)  # a process left behind would overwrite it now
    assert set(_rows(folder / "out" / "grades.csv")) == expected


def test_killing_its_parent_or_everything_costs_that_submission_only(graded):
    _, rows, _, _, _ = graded
    names = ["s1_kills_its_parent", "s1_kills_everything", "s1_fork_bomb"]
    for name in names:
        # on a busy machine a fork bomb's copies free places for the loop as they end, so its
        # cell may also run out of time; its copies are stopped before the next check
        assert rows[name]["ch98.add_one status"] in ("crashed", "passed", "timeout"), name
        assert rows[name]["ch98.mean_square status"] == "passed", name
        assert rows[name]["ch98.Scale status"] == "passed", name


def test_processes_left_running_are_stopped_before_a_check(graded):
    _, rows, reports, _, _ = graded
    name = "s3_leaves_a_helper"
    assert rows[name]["total"] == "5" and statuses(rows, name) == ["passed"] * 4
    assert _printed(reports, name, "HELPER ") == ["gone gone"]
    # the copy, the shell (and its sleep, once started), stopped before the next check
    [warning] = reports[name]["warnings"]
    assert re.fullmatch(
        r"ch98.add_one: [23] process\(es\) your code started were still running and were "
        r"stopped before it was checked",
        warning,
    ), warning


def test_a_helper_hidden_from_the_stop_is_stopped_all_the_same(graded):
    # hidden from os.listdir, os.kill made a no-op: the stop calls what it bound before any cell
    _, rows, reports, _, _ = graded
    assert _printed(reports, "s4_hides_its_helper", "HIDDEN ") == ["gone"]
    assert rows["s4_hides_its_helper"]["total"] == "5"


def test_a_thread_that_keeps_starting_processes_gets_none_beside_a_check(graded):
    # the processes are stopped once the check has begun, when a thread's fork is refused: none
    # is left, and the honest answers pass
    _, rows, reports, _, _ = graded
    name = "s4_forking_thread"
    assert rows[name]["total"] == "5" and statuses(rows, name) == ["passed"] * 4
    first = reports[name]["warnings"][0]
    assert re.fullmatch(r"ch98.add_one: \d+ process\(es\) .* stopped before it was checked", first)


def test_learner_code_cannot_write_into_the_repository(graded):
    _, rows, _, _, _ = graded
    assert not list(ROOT.rglob(f"pwned_{MARKER}.py"))  # the checkout is read-only in the jail
    for p in ROOT.rglob(f"pwned_{MARKER}.py"):
        p.unlink()
    assert rows["s1_writes_repository"]["total"] == "5"


def _printed(reports, name: str, prefix: str) -> list[str]:
    """What a submission printed on lines starting with `prefix` (the prefix removed)."""
    lines = reports[name]["process_output"].splitlines()
    return [x[len(prefix) :] for x in lines if x.startswith(prefix)]


def test_nothing_a_submission_leaves_survives_it(graded):
    _, rows, reports, _, _ = graded
    # it could write everywhere a program writes scratch files...
    left = _printed(reports, "s1_leaves_files", "LEFT ")
    assert {"/tmp", "/var/tmp", "/dev/shm"} <= set(left) and len(left) == 5, left
    assert int(_printed(reports, "s1_leaves_files", "SHM ")[0]) >= 0  # a segment was made
    assert rows["s1_leaves_files"]["total"] == "5"
    # ...and none of it is on this machine once it is graded, nor seen by another submission
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not (Path(folder) / f"left-{MARKER}").exists(), folder
    key = int(hashlib.sha256(MARKER.encode()).hexdigest()[:7], 16)
    keys = [int(line.split()[0]) for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    assert key not in keys
    assert _printed(reports, "s1_finds_leftovers", "FOUND") == []
    assert rows["s1_finds_leftovers"]["total"] == "5"


def test_the_grader_and_other_submissions_are_invisible(graded):
    _, rows, reports, _, folder = graded
    name = "s1_reads_classmates"
    # in /proc, no process but its own and the jail's first (bwrap's, its parent)
    [saw] = _printed(reports, name, "SAW ")
    assert all(x.startswith("1/") for x in saw.split()), saw
    assert rows[name]["total"] == "5"
    out = folder / "out"
    denied = [x.split()[0] for x in _printed(reports, name, "DENIED ")]
    assert denied == [str(folder), str(folder / "solution.ipynb"), str(out)]
    # of the repository, only the package, its data (assets/, found beside pyproject.toml)
    # and the Python installation are there: no solutions or grades; of tests/, only the
    # fixture chapter's check file, which defines the chapter's references (README: what is
    # not guaranteed)
    [listed] = _printed(reports, name, "LISTED ")
    shown = set(listed.removeprefix(f"{ROOT} ").split())
    assert "qwen_mini" in shown and shown <= {
        "qwen_mini",
        "assets",
        "pyproject.toml",
        "tests",
        Path(sys.prefix).name,
    }
    env = set(_printed(reports, name, "ENV ")[0].split())
    assert PATH_ENV not in env and "PWD" not in env and "HOME" in env
    assert not {v for v in env if v.startswith(("SUDO", "SSH", "PYTEST", "QWEN_MINI_E"))}


def test_no_check_is_loaded_and_solutions_are_out_of_reach(graded):
    _, rows, reports, _, _ = graded
    name = "s4_reads_hidden_checks"
    assert "GOT" not in reports[name]["process_output"], reports[name]["process_output"]
    assert rows[name]["total"] == "0" and "passed" not in statuses(rows, name)


def test_the_package_check_modules_and_the_secret_are_out_of_reach(graded):
    # the hidden cases' generators are in qwen_mini/course/checks/, their inputs drawn with the
    # course secret: neither is importable, readable or listed in the sandbox
    _, rows, reports, _, folder = graded
    name = "s4_imports_package_checks"
    output = reports[name]["process_output"]
    assert "GOT" not in output, output
    assert len(_printed(reports, name, "NOT imported ")) == 6, output
    assert len(_printed(reports, name, "NOT registered ")) == 6, output
    assert len(_printed(reports, name, "NOT read the course secret")) == 2, output
    assert _printed(reports, name, "LISTED ") == ["[]"], output
    secret = _printed(reports, name, "SECRET ")
    assert len(secret) == 1 and secret[0] != (folder / "secret.txt").read_text(), output
    assert rows[name]["total"] == "0" and "passed" not in statuses(rows, name)


FILLS_MEMORY = """
import ctypes
import os

chunk = b'x' * (32 << 20)
written = 0
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
try:
    for folder in ('/dev/shm', '/tmp', '/var/tmp'):  # each within its own cap of 256 MB
        for i in range(7):
            with open(os.path.join(folder, f'fill-{i}'), 'wb') as f:
                f.write(chunk)
            written += len(chunk)
    for i in range(6):
        segment = libc.shmget(0, len(chunk), 0o1600)
        address = libc.shmat(segment, None, 0) if segment >= 0 else None
        if address in (None, 2**64 - 1):
            raise OSError(ctypes.get_errno(), 'shared memory')
        ctypes.memset(address, 1, len(chunk))
        written += len(chunk)
finally:
    print(f'WROTE {written >> 20} MB')


def mean_square(x, dim=-1):
    return x.pow(2).mean(dim) if x.shape[dim] else x.sum(dim)


check('ch98.mean_square', mean_square)
"""


def test_memory_in_files_and_shared_memory_counts_against_the_limit(tmp_path):
    # 864 MB in /dev/shm, /tmp, /var/tmp and System V segments, none over its own 256 MB cap
    nb = _notebook(nbs.load(SOLUTION), {"mean-square": FILLS_MEMORY})
    (tmp_path / "fills.ipynb").write_text(nbs.dumps(nb))
    extra = ["--memory-mb", "256", "--timeout", "60", "--budget", "120"]
    assert _run(tmp_path, tmp_path / "g.csv", [*extra, str(tmp_path / "fills.ipynb")]) == 0
    report = json.loads((tmp_path / "g-reports" / "fills.json").read_text())
    entry = report["exercises"]["ch98.mean_square"]
    if "memory" in jail.controllers():  # a memory cgroup counts them all: killed
        assert entry["status"] == "crashed" and "memory" in entry["message"], entry
        assert report["total"] == 3
    else:  # no cgroup (README): each kind is capped at the limit, not counted with it
        assert entry["status"] == "passed" and "WROTE 864 MB" in report["process_output"]


def test_a_huge_view_is_refused_before_it_costs_the_grader_memory(graded):
    _, rows, reports, _, _ = graded
    entry = reports["s2_huge_view"]["exercises"]["ch98.mean_square"]
    assert entry["status"] == "failed" and "at most 64 MB" in entry["message"], entry
    assert "64000000 elements" in entry["message"] and rows["s2_huge_view"]["total"] == "3"


def test_reports_stay_small_whatever_the_notebook_holds(graded):
    _, rows, reports, _, folder = graded
    report = folder / "out" / "grades-reports" / "s2_long_magic_names.json"
    assert rows["s2_long_magic_names"]["total"] == "5"
    assert report.stat().st_size < 200_000  # 3 names of 2 MB: 6 MB unbounded
    warnings = reports["s2_long_magic_names"]["warnings"]
    assert len(warnings) == 101 and warnings[-1].endswith("more warnings")
    assert all(len(w) <= 1001 for w in warnings) and any(w.endswith("…") for w in warnings)


# --- 2. nothing in one notebook stops the run ----------------------------------------------------


def test_every_input_gets_a_row_and_the_exit_code_says_some_were_unreadable(graded):
    code, rows, reports, _, _ = graded
    assert code == 3  # s2_not_json and s2_not_utf8 could not be read
    for name in ("s2_not_json", "s2_not_utf8"):
        assert statuses(rows, name) == ["unreadable"] * 4 and rows[name]["total"] == "0"
        assert reports[name]["error"]


def test_garbage_on_the_channel_costs_that_submission_only(graded):
    _, rows, reports, _, _ = graded
    entry = reports["s2_garbage_on_channel"]["exercises"]["ch98.add_one"]
    assert entry["status"] == "crashed" and "channel" in entry["message"]
    assert statuses(rows, "s2_garbage_on_channel")[1:] == ["passed"] * 3


def test_a_stopped_worker_is_detected(graded):
    _, rows, reports, _, _ = graded
    entry = reports["s2_stops_itself"]["exercises"]["ch98.mean_square"]
    assert entry["status"] == "timeout" and "stopped" in entry["message"]
    assert rows["s2_stops_itself"]["total"] == "3"


def test_printing_does_not_extend_the_time_limit(graded):
    _, rows, reports, _, _ = graded
    assert reports["s2_prints_forever"]["exercises"]["ch98.mean_square"]["status"] == "timeout"
    assert rows["s2_prints_forever"]["total"] == "3"
    assert len(reports["s2_prints_forever"]["process_output"]) <= PROCESS_OUTPUT_CAP


def test_a_notebook_cannot_run_past_its_budget(graded):
    _, rows, reports, seconds, _ = graded
    entry = reports["s2_over_budget"]["exercises"]["ch98.mean_square"]
    assert entry["status"] == "timeout" and "budget" in entry["message"]
    assert rows["s2_over_budget"]["ch98.add_one"] == "1"


def test_malformed_cells_are_skipped_with_a_warning(graded):
    _, rows, reports, _, _ = graded
    assert rows["s2_odd_cells"]["total"] == "5"
    warnings = " ".join(reports["s2_odd_cells"]["warnings"])
    for kind in ("not a JSON object", "type null", "type int", "type dict", "type list"):
        assert kind in warnings


def test_undecodable_names_and_lone_surrogates_are_written_safely(graded):
    _, rows, reports, _, folder = graded
    assert rows["s2_caf\\udce9_latin1_name"]["total"] == "5"
    assert rows["s2_surrogates"]["ch98.add_one"] == "1"
    entry = reports["s2_surrogates"]["exercises"]["ch98.mean_square"]
    assert entry["status"] == "crashed" and "bad \\udc80 text" in entry["message"]
    for p in (folder / "out").rglob("*"):
        if p.is_file():
            p.read_bytes().decode("utf-8")  # every file written is valid UTF-8


def test_unknown_exercise_ids_are_warnings(graded):
    _, rows, reports, _, _ = graded
    assert rows["s2_unknown_id"]["total"] == "5"
    assert any("ch98.nope" in w for w in reports["s2_unknown_id"]["warnings"])


def test_output_is_capped(graded):
    _, rows, reports, _, _ = graded
    assert rows["s2_megabytes"]["total"] == "5"
    assert len(reports["s2_megabytes"]["process_output"]) <= PROCESS_OUTPUT_CAP
    assert any("bytes of output" in w for w in reports["s2_megabytes"]["warnings"])


@pytest.mark.parametrize(
    "name, status, words",
    [
        ("s2_sys_exit", "crashed", "sys.exit(3)"),
        ("s2_os_exit", "crashed", "exited with code 7"),
        ("s2_memory_hog", "crashed", "memory"),
        ("s2_loops", "timeout", f"within {TIMEOUT} s"),
    ],
)
def test_a_broken_cell_costs_its_exercise_only(graded, name, status, words):
    _, rows, reports, _, _ = graded
    entry = reports[name]["exercises"]["ch98.mean_square"]
    assert entry["status"] == status and words in entry["message"] and entry["points"] == 0
    assert rows[name]["total"] == "3"


def test_a_killed_run_keeps_the_rows_it_wrote(graded, tmp_path):
    _, _, _, _, folder = graded
    for i in range(6):
        (tmp_path / f"n{i}.ipynb").write_text((folder / "solution.ipynb").read_text())
    out = tmp_path / "grades.csv"
    env = dict(os.environ, **{PATH_ENV: str(FIXTURES / "checks")})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    args = [sys.executable, "-m", "qwen_mini.course.grading", "--chapter", "98"]
    args += ["--solutions", str(FIXTURES / "solutions"), "--out", str(out), str(tmp_path)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = 0
    for line in proc.stdout:  # one line per notebook graded
        lines += b": 5/5" in line
        if lines == 2:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    rows = _rows(out)
    assert len(rows) >= 2 and all(r["total"] == "5" for r in rows.values())


@pytest.mark.parametrize(
    "name, status",
    [
        ("s2_hangs_first_of_two", "timeout"),  # an honest infinite loop in the first check
        ("s2_kills_first_of_two", "crashed"),  # the worker dies in the first check
        ("s2_raises_after_first_of_two_hangs", "timeout"),  # and the cell raises after its checks
        ("s2_hangs_then_checks_later", "timeout"),  # and later cells check more
    ],
)
def test_a_dead_worker_costs_the_exercise_it_died_in_only(graded, name, status):
    # the cell checks add_one, then add_two (no later cell checks it again): add_two is graded
    # on this cell's object, run again in a new worker, with the package's add_one under it
    _, rows, reports, _, _ = graded
    assert rows[name]["ch98.add_one status"] == status, reports[name]["exercises"]
    assert statuses(rows, name)[1:] == ["passed"] * 3, reports[name]["exercises"]
    assert rows[name]["total"] == "4"


def test_forged_tensors_are_a_broken_channel_for_that_submission_only(graded):
    _, rows, reports, _, _ = graded
    # each cell answers once with a tensor whose shape torch cannot hold (2**64 long, -3, 2.5,
    # a stride of 2**63 under a dtype given as a list): each costs that cell's exercise
    for x, entry in reports["s2_forged_shapes"]["exercises"].items():
        assert entry["status"] == "crashed" and "channel" in entry["message"], (x, entry)
    entry = reports["s2_forged_sizes"]["exercises"]["ch98.add_one"]  # in a check's answer
    assert entry["status"] == "crashed" and "channel" in entry["message"], entry
    assert statuses(rows, "s2_forged_sizes")[1:] == ["passed"] * 3


# --- one notebook at a time: whatever one does, the next is graded as if alone --------------------

ALONE = ["s1_takes_reports_folder", "s2_hangs_first_of_two", "s2_kills_first_of_two"]
ALONE += ["s2_raises_after_first_of_two_hangs", "s2_forged_shapes", "s2_huge_cell"]


def _shared_folder() -> Path:
    """A fresh folder every user can write (sticky, as /tmp is): where a careless --out points."""
    folder = Path(tempfile.mkdtemp(prefix="qwen-mini-shared-"))
    folder.chmod(0o1777)
    return folder


@pytest.fixture(scope="module")
def one_at_a_time(graded):
    """With --jobs 1, each hostile notebook followed by the solution, the CSV and its reports in
    a folder every user can write: (exit code, rows, reports folder, shared folder)."""
    _, _, _, _, folder = graded
    shared = _shared_folder()
    out = shared / "grades.csv"
    solution = nbs.load(SOLUTION)
    files = []
    for name in ALONE:
        path = shared / f"{name}.ipynb"
        if name == "s2_huge_cell":  # 24 MB of code in one cell: more than one message holds
            nb = json.loads(json.dumps(solution))
            nb["cells"].append({"cell_type": "code", "source": "# " + "é" * 12_000_000})
            path.write_text(json.dumps(nb), encoding="utf-8")
        else:
            base, changes = SUBMISSIONS[name]
            assert base == "solution", name
            nb = _notebook(solution, changes)
            path.write_text(nbs.dumps(nb).replace("@OUT@", str(out)))
        after = shared / f"after_{name}.ipynb"
        after.write_text(nbs.dumps(solution))
        files += [str(path), str(after)]
    code = _run(folder, out, ["--jobs", "1", *files])
    yield code, _rows(out), shared / "grades-reports", shared
    shutil.rmtree(shared, ignore_errors=True)


def test_every_notebook_after_a_hostile_one_is_graded_as_if_alone(graded, one_at_a_time):
    _, solo, _, _, _ = graded
    code, rows, _, _ = one_at_a_time
    assert code == 3  # the too-big notebook could not be read
    alone = {k: v for k, v in solo["solution"].items() if k != "notebook"}
    for name in ALONE:
        assert {k: v for k, v in rows[f"after_{name}"].items() if k != "notebook"} == alone, name
    for name in ALONE[1:5]:  # and each hostile one scores as in the run with --jobs 2
        assert statuses(rows, name) == statuses(solo, name), name


def test_a_notebook_too_big_to_send_gets_its_own_row(one_at_a_time):
    _, rows, reports, _ = one_at_a_time
    assert statuses(rows, "s2_huge_cell") == ["unreadable"] * 4
    report = json.loads((reports / "s2_huge_cell.json").read_text(encoding="utf-8"))
    assert "too big to grade" in report["error"] and "cell 6" in report["error"]


def test_a_submission_cannot_take_the_reports_folder(one_at_a_time):
    _, rows, reports, shared = one_at_a_time
    assert rows["s1_takes_reports_folder"]["total"] == "5"
    assert reports.is_dir() and not reports.is_symlink() and reports.stat().st_uid == os.getuid()
    assert len(list(reports.glob("*.json"))) == 2 * len(ALONE)
    assert not list((shared / "stolen-reports").glob("*"))  # nothing written where it pointed


@pytest.mark.parametrize("kind", ["link", "file", "writable"] + ["foreign"] * (os.geteuid() == 0))
def test_a_reports_folder_someone_else_made_is_refused(tmp_path, capsys, kind):
    shared = _shared_folder()
    try:
        reports, elsewhere = shared / "grades-reports", shared / "elsewhere"
        elsewhere.mkdir()
        if kind == "link":
            reports.symlink_to(elsewhere)
        elif kind == "file":
            reports.write_text("")
        else:
            reports.mkdir()
            reports.chmod(0o777)
            if kind == "foreign":
                reports.chmod(0o755)
                os.chown(reports, 12345, 12345)
        code = _run(tmp_path, shared / "grades.csv", [str(SOLUTION)])
        err = capsys.readouterr().err
        assert code == 1 and "grades-reports" in err and "--reports" in err, err
        assert not list(elsewhere.iterdir()) and not (shared / "grades.csv").exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.skipif("cpu" not in jail.controllers(), reason="no cpu cgroup here (README)")
def test_busy_processes_of_one_notebook_do_not_cost_its_neighbour(tmp_path):
    # with --jobs 2, one notebook keeps twenty busy processes running (each in a session of its
    # own) while the other's add_one does half a second of work in each of its two checks:
    # alone, 1 s of a 6 s limit; each jail's cpu cgroup holds one share of the CPU, however
    # many processes it runs, so the twenty take the neighbour's time no more than one would
    # (and the slack is for the machine's other load, outside the grader's cgroups)
    shared = _shared_folder()
    try:
        solution = nbs.load(SOLUTION)
        for name in ("s1_cpu_hogs", "s3_slow_but_honest"):
            nb = _notebook(solution, SUBMISSIONS[name][1])
            (shared / f"{name}.ipynb").write_text(nbs.dumps(nb))
        out = shared / "grades.csv"
        _run(tmp_path, out, ["--jobs", "2", "--budget", "60", str(shared)])
        rows = _rows(out)
        report = json.loads((shared / "grades-reports" / "s3_slow_but_honest.json").read_text())
        hogs = json.loads((shared / "grades-reports" / "s1_cpu_hogs.json").read_text())
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert "HOGS STARTED" in hogs["process_output"], hogs["warnings"]
    slowdowns = re.findall(r"SLOWDOWN=([0-9.]+)", report["process_output"])
    assert slowdowns, report["process_output"]
    assert statuses(rows, "s3_slow_but_honest") == ["passed"] * 4, report["exercises"]
    # the busy notebook's own exercises: graded, or costed by the processes it left running
    assert set(statuses(rows, "s1_cpu_hogs")) <= {"passed", "tampered", "timeout"}


# --- 3. honest notebooks are graded as Jupyter runs them -----------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "s3_helper_cell",
        "s3_split_cells",
        "s3_renamed",
        "s3_qualified",
        "s3_no_check_call",
        "s3_torch_compile",
        "s3_magics",
        "s3_calls_earlier_package_piece",
        "s3_uses_temp_space",
        "s3_slow_but_honest",
    ],
)
def test_honest_notebooks_get_full_marks(graded, name):
    _, rows, reports, _, _ = graded
    assert statuses(rows, name) == ["passed"] * 4, reports[name]
    assert rows[name]["total"] == "5"


def test_only_torch_compiles_own_wrapper_of_the_seed_is_no_change(graded):
    """The worker leaves torch's compiler to the first notebook that compiles (it costs every
    worker a second); importing it wraps torch.manual_seed, which s3_torch_compile's full marks
    show is accepted. The same wrapper's code around another function is a change."""
    _, rows, reports, _, _ = graded
    assert statuses(rows, "s4_forged_seed") == ["tampered"] * 4, reports["s4_forged_seed"]
    message = reports["s4_forged_seed"]["exercises"]["ch98.add_one"]["message"]
    assert "torch.manual_seed" in message, message


def test_skipped_magics_are_noted(graded):
    warnings = " ".join(graded[2]["s3_magics"]["warnings"])
    assert "%matplotlib" in warnings and "echo hello" in warnings


@pytest.mark.parametrize(
    "name, status",
    [
        ("s3_fallback_after_timeout", "timeout"),
        ("s3_fallback_after_crash", "crashed"),
        ("s3_fallback_after_missing", "missing"),
    ],
)
def test_a_later_exercise_falls_back_to_the_package_piece(graded, name, status):
    _, rows, _, _, _ = graded
    assert rows[name]["ch98.add_one status"] == status and rows[name]["ch98.add_one"] == "0"
    assert statuses(rows, name)[1:] == ["passed"] * 3  # add_two calls add_one
    assert rows[name]["total"] == "4"


# --- 4. a blank notebook cannot earn marks -------------------------------------------------------


@pytest.mark.parametrize(
    "name, exercise",
    [
        ("s4_wrapper", "ch98.add_one"),
        ("s4_registry", "ch98.add_one"),
        ("s4_partial", "ch98.add_one"),
        ("s4_subclass", "ch98.Scale"),
        ("s4_function_copy", "ch98.add_one"),
        ("s4_code_replace", "ch98.add_one"),
        ("s4_code_edited", "ch98.mean_square"),
        ("s4_marshal", "ch98.add_one"),
        ("s4_exec_source", "ch98.add_one"),
        # the package's source laundered: through a cell magic, compiled again with other
        # flags, round-tripped through ast, under a cell's file name, from a reloaded module
        ("s4_magic_source", "ch98.add_one"),
        ("s4_optimize2", "ch98.add_one"),
        ("s4_ast_roundtrip", "ch98.add_one"),
        ("s4_ast_roundtrip", "ch98.Scale"),
        ("s4_linecache", "ch98.add_one"),
        ("s4_reload", "ch98.add_one"),
        ("s4_reload", "ch98.add_two"),
        ("s4_patch_one_call", "ch98.Scale"),
    ],
)
def test_the_package_reference_scores_zero_with_status_reference(graded, name, exercise):
    _, rows, reports, _, _ = graded
    assert rows[name][f"{exercise} status"] == "reference", reports[name]["exercises"][exercise]
    assert rows[name]["total"] == "0"


@pytest.mark.parametrize(
    "name",
    [
        "s4_thread",
        "s4_background_thread",
        "s4_helper_process",
        "s4_unhook",
        "s4_always_equal",
        "s4_tensor_subclass",
        "s4_patches_torch",
        "s4_patches_while_checked",
        "s4_patches_checks",
        "s4_forges_results",
        "s4_patch_one_call",
    ],
)
def test_a_blank_notebook_earns_nothing(graded, name):
    _, rows, reports, _, _ = graded
    assert rows[name]["total"] == "0", reports[name]["exercises"]
    assert "passed" not in statuses(rows, name)


def test_an_error_in_the_learners_code_gives_the_line_of_their_cell(graded):
    _, rows, reports, _, _ = graded
    name = "s3_raises_in_its_checks"
    exercises = reports[name]["exercises"]
    assert rows[name]["ch98.add_two status"] == "passed"  # only the raising pieces cost points
    hidden = exercises["ch98.add_one"]["message"]
    assert hidden.startswith("a hidden check failed: integer input (your code raised TypeError")
    assert 'line 3: raise TypeError("only floats, please")' in hidden, hidden
    public = exercises["ch98.mean_square"]["message"]
    assert "your code raised TypeError" in public and "keepdims_typo" in public, public
    assert "line 3: return squares.mean(dim, keepdims_typo=True))" in public, public
    assert re.search(r"\(cell \d+, line 3: ", public), public


def test_wrong_types_are_named_in_the_message(graded):
    reports = graded[2]
    entry = reports["s4_tensor_subclass"]["exercises"]["ch98.mean_square"]
    assert entry["status"] == "failed" and "subclass of torch.Tensor" in entry["message"]


def test_hidden_checks_report_their_category_not_their_inputs(graded, tmp_path):
    # a submission that passes the public check of add_one but not the hidden one
    float_answer = 'def add_one(x):\n    return x + 1.0\n\n\ncheck("ch98.add_one", add_one)'
    nb = _notebook(nbs.load(SOLUTION), {"add-one": float_answer})
    (tmp_path / "hidden.ipynb").write_text(nbs.dumps(nb))
    assert _run(tmp_path, tmp_path / "g.csv", [str(tmp_path / "hidden.ipynb")]) == 0
    report = json.loads((tmp_path / "g-reports" / "hidden.json").read_text())
    entry = report["exercises"]["ch98.add_one"]
    assert entry["status"] == "failed" and "integer input" in entry["message"]
    assert "[1, 2]" not in entry["message"] and "int64" not in entry["message"]


def test_missing_input_and_missing_reference(tmp_path, capsys):
    code = _run(tmp_path, tmp_path / "g.csv", [str(tmp_path / "nope.ipynb")])
    assert code == 3
    assert _rows(tmp_path / "g.csv")["nope"]["ch98.add_one status"] == "unreadable"
    code = grade.main(
        [
            "--chapter",
            "42",
            "--solutions",
            str(tmp_path),
            "--out",
            str(tmp_path / "x.csv"),
            str(SOLUTION),
        ]
    )
    assert code == 1 and "ch42_*.ipynb" in capsys.readouterr().err
