"""Grading one notebook: run its plan in the sandbox, restarting after a timeout or a crash."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

from .. import notebooks as nbs
from ..notebooks import NotebookError
from .plan import Reference, Step, plan
from .report import OUTPUT_LIMIT, Grades, _blank
from .sandbox import PROCESS_OUTPUT_CAP, WORKER_GONE, Run, Zygote, run_job
from .worker import OUTPUT_CAP


def grade_notebook(path: Path, ref: Reference, zygote: Zygote, options) -> Grades:
    points = {e["id"]: e["points"] for e in zygote.exercises}
    grades = Grades(
        str(path),
        {x: _blank(p, "missing", f'no cell calls check("{x}", …)') for x, p in points.items()},
    )
    try:
        nb = nbs.load(path)
    except NotebookError as e:
        grades.error = str(e)
        for entry in grades.exercises.values():
            entry.update(status="error", message="the notebook could not be read")
        return grades
    steps, grades.warnings = plan(nb, ref.chapter, list(points))
    with tempfile.TemporaryDirectory(prefix="qwen-mini-grade-") as tmp:
        _run_steps(steps, ref, zygote, Path(tmp), options, grades)
    for exercise, entry in grades.exercises.items():
        printed = entry.pop("output_chars", 0)
        if printed > OUTPUT_LIMIT:
            entry.update(
                status="output",
                message=f"printed {printed:,} characters (the limit is {OUTPUT_LIMIT:,}); "
                "remove the debugging prints and submit again",
            )
        elif printed > OUTPUT_CAP:
            grades.warnings.append(
                f"{exercise}: printed a lot of output; kept the first {OUTPUT_CAP} characters"
            )
        if entry["status"] == "passed":
            entry["points"] = points[exercise]
    return grades


def _run_steps(
    steps: list[Step], ref: Reference, zygote: Zygote, tmp: Path, options, grades: Grades
) -> None:
    """Run the steps in as few processes as possible: after a timeout or a crash, a fresh one
    reruns setup and the earlier cells that ran cleanly, then carries on after the bad cell."""
    start, replay = 0, []
    setup_timeout = max(60.0, 2 * options.timeout)
    while start < len(steps):
        job = {
            "setup": ref.setup,
            "replay": replay,
            "objects": ref.objects,
            "cwd": str(ref.notebook.parent),
            "memory_mb": options.memory_mb,
            "steps": [{"cell": s.cell, "source": s.source, "ids": s.ids} for s in steps[start:]],
        }
        run = run_job(zygote, job, tmp, options.timeout, setup_timeout)
        grades.output += run.output.decode(errors="replace")
        if run.output_bytes > PROCESS_OUTPUT_CAP:
            grades.warnings.append(
                f"the process wrote {run.output_bytes} bytes to its output; "
                f"kept the first {PROCESS_OUTPUT_CAP}"
            )
        current, clean = None, set()
        for event in run.events:
            if event["event"] == "cell-start":
                current = event["cell"]
            elif event["event"] == "cell-done" and event["ok"]:
                clean.add(event["cell"])
            elif event["event"] == "result":
                grades.exercises[event["id"]].update(
                    {k: v for k, v in event.items() if k not in ("event", "id")}
                )
            elif event["event"] == "setup-failed":
                _fail_rest(steps[start:], grades, "error", event["message"])
                return
        if any(e["event"] == "finished" for e in run.events):
            return
        if current is None:  # died or hung in setup: no exercise can run
            why = "timed out" if run.timed_out else f"stopped (exit code {run.exit_code})"
            _fail_rest(steps[start:], grades, "error", f"the reference setup cells {why}")
            return
        index = next(i for i, s in enumerate(steps) if s.cell == current)
        status, message = _stopped(run, options)
        _fail_rest([steps[index]], grades, status, message)
        if status == "timeout":
            for exercise in steps[index].ids:
                grades.exercises[exercise]["runtime_s"] = options.timeout
        replay += [(s.cell, s.source) for s in steps[start:index] if s.cell in clean]
        start = index + 1


def _stopped(run: Run, options) -> tuple[str, str]:
    if run.timed_out:
        return "timeout", f"did not finish within {options.timeout:g} s (an endless loop?)"
    code = run.exit_code
    if code == WORKER_GONE:
        return "error", "the grading worker was killed (by the submission?) and had to be restarted"
    if code == -signal.SIGKILL:
        return "memory", "the process was killed, most likely for using too much memory"
    if code is not None and code < 0:
        return "error", f"the process crashed ({signal.Signals(-code).name})"
    return "error", f"the process exited with code {code} (os._exit?); exiting is not allowed"


def _fail_rest(steps: list[Step], grades: Grades, status: str, message: str) -> None:
    for step in steps:
        for exercise in step.ids:
            if grades.exercises[exercise]["status"] == "missing":
                grades.exercises[exercise].update(status=status, message=message)
