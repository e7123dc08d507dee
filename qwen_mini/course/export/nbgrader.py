"""A chapter as an nbgrader course folder, and the function its autograder test cells call.

    qwen-mini-course export nbgrader --chapter 1 course-folder/

writes `course-folder/nbgrader_config.py` and `course-folder/source/<assignment>/<notebook>.ipynb`:
the chapter's solution notebook with nbgrader's metadata on every cell that holds a solution
region (the notebooks already use nbgrader's `### BEGIN SOLUTION` markers) and, after the cell
that checks each exercise, an autograder test cell worth the exercise's points:

    autograde("ch01.repeat_kv", "repeat_kv", globals())
    ### BEGIN HIDDEN TESTS
    autograde("ch01.repeat_kv", "repeat_kv", globals(), hidden=True)
    ### END HIDDEN TESTS

`autograde` runs the chapter's own checks (`qwen_mini/course/checks/chNN.py`, the ones
`qwen-mini-course grade` runs) on the learner's object and, while nbgrader validates or
autogrades, raises with the message `qwen-mini-course grade` would give, so nbgrader awards the
cell's points exactly when `qwen-mini-course grade` would. In a learner's own session it prints
that line and never raises, so Run All keeps going, as with `check(...)`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from .. import checking
from .. import notebooks as nbs

SCHEMA_VERSION = 3  # nbgrader 0.9's cell metadata
# nbgrader sets this while it runs a notebook: "validate" or "autograde"
EXECUTION_ENV = "NBGRADER_EXECUTION"

CONFIG = '''"""nbgrader settings for qwen-mini chapter {chapter}
(`qwen-mini-course export nbgrader`).

Run nbgrader from this folder:  nbgrader generate_assignment {assignment}
                                nbgrader autograde {assignment}
"""

c = get_config()  # noqa: F821 (nbgrader provides it)
c.CourseDirectory.course_id = "qwen-mini-{assignment}"
# A chapter notebook runs in about a minute on a 2-core CPU; some cells train a tiny model.
c.ExecutePreprocessor.timeout = {timeout}
# The learner copy's stub, as in the course notebooks: the checks report "not implemented yet".
STUB = 'raise NotImplementedError("replace this line with your code")'
c.ClearSolutions.code_stub = {{"python": STUB}}
'''


# --- the course folder ---------------------------------------------------------------------------


def grade_id(exercise_id: str) -> str:
    """nbgrader's ids are letters, digits, `_` and `-`: "ch01.repeat_kv" -> "ch01-repeat_kv"."""
    return exercise_id.replace(".", "-")


def _meta(grade_id: str, *, solution: bool, grade: bool, points: float = 0) -> dict:
    meta = {"grade_id": grade_id, "solution": solution, "grade": grade, "locked": grade}
    meta["schema_version"] = SCHEMA_VERSION
    if grade:
        meta["points"] = points
    return meta


def autograder_source(exercise_id: str, name: str) -> str:
    call = f'autograde("{exercise_id}", "{name}", globals()'
    return "\n".join(
        [
            f"# Autograder test for {exercise_id}: the checks `qwen-mini-course grade` runs.",
            "from qwen_mini.course.export.nbgrader import autograde",
            "",
            call + ")",
            nbs.BEGIN_HIDDEN,
            call + ", hidden=True)",
            nbs.END_HIDDEN,
        ]
    )


def _test_cell(exercise: checking.Exercise, name: str) -> dict:
    return {
        "cell_type": "code",
        "execution_count": None,
        "id": f"test-{grade_id(exercise.id)}"[:64],
        "metadata": {
            "nbgrader": _meta(f"test-{grade_id(exercise.id)}", solution=False, grade=True,
                              points=exercise.points)
        },
        "outputs": [],
        "source": nbs.source_lines(autograder_source(exercise.id, name)),
    }  # fmt: skip


def source_notebook(nb: dict, path: Path, exercises: list, names: dict[str, str]) -> dict:
    """The nbgrader source version of solution notebook `nb`: solution cells marked, hidden test
    regions of ordinary cells dropped (nbgrader hides them only in test cells), one test cell
    after the cell that checks each exercise (at the end for one that no cell checks)."""
    out = copy.deepcopy(nb)
    pending = {e.id: e for e in exercises}
    cells = []
    for i, cell in enumerate(out["cells"]):
        if "solution-only" in nbs.tags(cell):
            continue  # the course's learner copy leaves these out too
        text = nbs.source(cell)
        place = nbs.where(path, i, cell)
        if nbs.has_markers(text):
            text = nbs.without_hidden_tests(text, place)
            cell["source"] = nbs.source_lines(text)
        if nbs.has_markers(text):
            solution_id = f"solution-{cell.get('id') or i}"
            cell.setdefault("metadata", {})["nbgrader"] = _meta(
                solution_id, solution=True, grade=False
            )
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
        cells.append(cell)
        checked = nbs.check_ids(text) if cell.get("cell_type") == "code" else []
        for exercise_id in dict.fromkeys(checked):
            if exercise_id in pending:
                cells.append(_test_cell(pending.pop(exercise_id), names[exercise_id]))
    cells += [_test_cell(e, names[e.id]) for e in pending.values()]
    out["cells"] = cells
    out.setdefault("metadata", {}).pop("widgets", None)
    return out


def write_course(
    chapter: int, folder: Path, solutions: Path, timeout: int = 600, keep_config: bool = False
) -> Path:
    """Write the nbgrader course folder for `chapter` into `folder` (with `keep_config`, leave an
    existing nbgrader_config.py as it is); return the source notebook."""
    from ..grading.plan import load_reference  # not imported by the test cells' `autograde`

    ref = load_reference(solutions, chapter)
    assignment = ref.notebook.stem
    nb = source_notebook(nbs.load(ref.notebook), ref.notebook, ref.exercises, ref.names)
    target = folder / "source" / assignment / ref.notebook.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(nbs.dumps(nb), encoding="utf-8")
    if not keep_config:
        config = CONFIG.format(chapter=chapter, assignment=assignment, timeout=timeout)
        (folder / "nbgrader_config.py").write_text(config, encoding="utf-8")
    return target


# --- what the test cells call --------------------------------------------------------------------


def grading_message(result: checking.Result, entry: checking.Exercise) -> str:
    """The message `qwen-mini-course grade` gives for `result` (hidden checks by their name
    only)."""
    if result.status == "not-implemented":
        return "not implemented yet"
    if result.ok:
        return f"passed {result.total}/{result.total} checks"
    if result.passed < len(entry.public):
        if result.exception is None:
            return result.message
        name = entry.public[result.passed][0]
        e = result.exception
        return f"{name} failed: your code raised {checking.exception_text(e)}"
    name = entry.hidden[result.passed - len(entry.public)][0]
    if result.exception is None:
        return f"a hidden check failed: {name}"
    return f"a hidden check failed: {name} ({type(result.exception).__name__})"


class ExerciseFailed(AssertionError):
    """An exercise failed its checks while nbgrader validates or autogrades: the cell scores 0."""


def autograde(exercise_id: str, name: str, namespace: dict, hidden: bool = False) -> bool:
    """Check `namespace[name]` with the exercise's public checks (and, with `hidden`, its hidden
    ones). While nbgrader runs the notebook a failure raises ExerciseFailed and, as in
    `qwen-mini-course grade`, puts the package's piece in its place for the exercises after it;
    otherwise it only prints the result."""
    entry = checking.get(exercise_id)
    grading = bool(os.environ.get(EXECUTION_ENV))
    if name not in namespace:
        message = f'no cell calls check("{exercise_id}", …) and no `{name}` is defined'
        ok = False
    elif namespace[name] is entry.reference:
        message = f"your `{name}` is the package's own {exercise_id}; write your own"
        ok = False
    else:
        result = checking.run_checks(exercise_id, namespace[name], hidden=hidden)
        message, ok = grading_message(result, entry), result.ok
    print(f"{'✓' if ok else '✗'} {exercise_id}: {message}")
    if not ok and grading:
        namespace[name] = entry.reference
        raise ExerciseFailed(message)
    return ok
