"""Grade a chapter's exercises in submitted notebooks.

    qwen-mini grade --chapter 1 --out grades.csv --reports reports/ submissions/*.ipynb

For each submission, in a fresh process: the reference notebook's `setup` cells run (never the
submission's), then the submission's exercise cells (those calling `check("chNN.…", …)`), each
followed by the public and hidden checks on the object the reference notebook checks there.
Each exercise has a wall-clock limit, the process a memory limit, and printed output is capped.
Whatever a submission does (raise, loop, exhaust memory, print megabytes, exit), it only costs
that submission points: the run goes on and grades every other notebook.

Fresh processes are forked from a "zygote" that has imported torch and the chapter's checks once,
so a notebook costs milliseconds to start instead of seconds (torch's import).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from . import notebooks as nbs
from .notebooks import NotebookError

ROOT = Path(__file__).resolve().parents[2]
OUTPUT_CAP = 10_000  # characters of printed output kept per exercise
OUTPUT_LIMIT = 1_000_000  # an exercise that prints more than this scores 0
PROCESS_OUTPUT_CAP = 20_000  # bytes kept of what the process wrote to its stdout / stderr fds
FILE_SIZE_LIMIT = 64 * 2**20  # bytes: a submission may write files, but not fill the disk


class GraderError(RuntimeError):
    """The grader itself cannot run (no reference notebook, broken checks): nothing is graded."""


# --- what to run ---------------------------------------------------------------------------------


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


# --- inside the forked process -------------------------------------------------------------------


class _CappedText(io.TextIOBase):
    """A stdout that keeps the first `cap` characters and counts the rest."""

    def __init__(self, cap: int):
        self.cap, self.kept, self.count = cap, [], 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        room = self.cap - min(self.count, self.cap)
        if room:
            self.kept.append(s[:room])
        self.count += len(s)
        return len(s)

    def text(self) -> str:
        return "".join(self.kept)


class _Shell:
    """Just enough of IPython's `get_ipython()` for magics in a cell to run headless."""

    def __init__(self, namespace: dict):
        self.namespace = namespace

    def run_line_magic(self, name, line, *args, **kwargs):
        return None  # %matplotlib, %load_ext, %timeit x… change nothing that is graded

    def run_cell_magic(self, name, line, cell, *args, **kwargs):
        if name in ("time", "timeit", "capture"):  # these run their body as Python
            _exec(cell, self.namespace, "<cell magic>")

    def system(self, *args, **kwargs):
        return None  # `!pip install …` does not run when grading

    getoutput = system


def _exec(text: str, namespace: dict, name: str) -> None:
    from IPython.core.inputtransformer2 import TransformerManager

    code = TransformerManager().transform_cell(text)  # magics -> get_ipython() calls
    exec(compile(code, name, "exec"), namespace)


def _is_memory(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)
    )


def _describe(e: BaseException, filename: str) -> str:
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r}); exiting is not allowed in an exercise"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == filename]
    at = f" (line {lines[-1]} of the cell)" if lines else ""
    return f"raised {type(e).__name__}: {e}{at}"


def _status(e: BaseException) -> str:
    if isinstance(e, NotImplementedError):
        return "not-implemented"
    return "memory" if _is_memory(e) else "error"


def _limit_memory(memory_mb: int) -> None:
    """Allow `memory_mb` of address space beyond what the process already has (torch alone
    maps hundreds of megabytes), so the limit means the same whatever was imported."""
    try:
        with open("/proc/self/status") as f:
            size_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        size_kb = 0
    limit = size_kb * 1024 + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


def _run_plan(job: dict, events: int) -> None:
    """Run setup, replayed cells and exercise steps; report each result as a JSON line on fd
    `events` (a pipe of its own, so nothing the learner prints can be mistaken for a result)."""
    from .checking import get, run_checks

    def emit(**event) -> None:
        os.write(events, (json.dumps(event) + "\n").encode())

    namespace: dict = {"__name__": "__main__"}
    namespace["get_ipython"] = lambda: _Shell(namespace)
    _limit_memory(job["memory_mb"])
    memory_note = f"used more than the {job['memory_mb']} MB memory limit"
    emit(event="setup-start")
    for n, text in enumerate(job["setup"]):
        try:
            _exec(text, namespace, f"<setup {n}>")
        except BaseException as e:
            emit(event="setup-failed", message=f"setup cell {n} {_describe(e, f'<setup {n}>')}")
            return
    # the learner's own check()/use() calls are not graded: skip their work and their output
    namespace["check"] = lambda exercise_id, obj: None
    namespace["use"] = lambda exercise_id, obj: obj
    pristine = _fingerprint()  # before any learner code, replayed cells included
    for cell, text in job["replay"]:  # earlier cells, rerun after a restart for their names
        with contextlib.suppress(BaseException):
            with _captured(OUTPUT_CAP):
                _exec(text, namespace, f"<cell {cell}>")
    emit(event="setup-done")
    for step in job["steps"]:
        emit(event="cell-start", cell=step["cell"])
        name, started = f"<cell {step['cell']}>", time.monotonic()
        with _captured(OUTPUT_CAP) as out:
            try:
                _exec(step["source"], namespace, name)
                failure = None
            except BaseException as e:
                failure = e
        emit(event="cell-done", cell=step["cell"], ok=failure is None)
        tampered = _tampered(pristine)
        for exercise in step["ids"]:
            emit(event="check-start", id=exercise)
            if tampered:
                result = {
                    "status": "tampered",
                    "message": f"your code replaced {tampered}, which the checks rely on; "
                    "an exercise must not change torch, the builtins or qwen_mini",
                }
            elif failure is not None:
                result = {
                    "status": _status(failure),
                    "message": f"your cell {_describe(failure, name)}",
                }
            else:
                with _captured(OUTPUT_CAP) as check_out:
                    result = _grade_object(
                        exercise, job["objects"].get(exercise), namespace, get, run_checks
                    )
                out.count += check_out.count
                if len(out.text()) < OUTPUT_CAP:
                    out.kept.append(check_out.text()[: OUTPUT_CAP - len(out.text())])
            if result["status"] != "passed":
                _fall_back(exercise, job["objects"].get(exercise), namespace, get)
            if result["status"] == "memory":
                result["message"] = f"{memory_note}: {result['message']}"
            result.update(
                runtime_s=round(time.monotonic() - started, 3),
                output=out.text(),
                output_chars=out.count,
            )
            emit(event="result", id=exercise, **result)
            started = time.monotonic()
    emit(event="finished")


def _fingerprint() -> dict:
    """What every name that the checks rely on refers to: qwen_mini's modules (the checks
    included), torch's main namespaces and the builtins, and each exercise's registered checks.
    Learner code runs in the checks' process; this is how patching them is caught."""
    import builtins

    import torch
    import torch.nn.functional

    from .checking import _EXERCISES

    spaces = {name: m for name, m in sys.modules.items() if name.split(".")[0] == "qwen_mini"}
    spaces.update(torch=torch, F=torch.nn.functional, Tensor=torch.Tensor, Module=torch.nn.Module)
    spaces["builtins"] = builtins
    seen = {f"{where}.{k}": v for where, m in spaces.items() for k, v in list(vars(m).items())}
    seen = {k: id(v) for k, v in seen.items() if not isinstance(v, type(sys))}  # submodules come
    for e in _EXERCISES.values():
        seen[f"the checks of {e.id}"] = (id(e.reference), *(id(f) for _, f in e.public + e.hidden))
    return seen


def _tampered(pristine: dict) -> str:
    """The first name that now refers to something else (or is gone), as `torch.allclose`."""
    now = _fingerprint()
    for name, value in pristine.items():
        if now.get(name) != value:
            return f"`{name}`"
    spaces = {name.rsplit(".", 1)[0] for name in pristine}
    for name in now.keys() - pristine.keys():  # a new global can shadow a builtin in qwen_mini
        where = name.rsplit(".", 1)[0]  # (a module imported since is new, not tampered with)
        if where in spaces and where.split(".")[0] in ("qwen_mini", "Tensor", "Module"):
            return f"`{name}`"
    return ""


@contextlib.contextmanager
def _captured(cap: int):
    out = _CappedText(cap)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        yield out


def _fall_back(exercise: str, expression: str | None, namespace: dict, get) -> None:
    """Put the package's piece where the learner's failed, as `use` does in the notebook, so
    that a stub in one exercise does not also cost the later exercises built on it."""
    expression = expression or exercise.split(".", 1)[1]
    if expression.isidentifier():
        namespace[expression] = get(exercise).reference


def _grade_object(exercise: str, expression: str | None, namespace: dict, get, run_checks) -> dict:
    expression = expression or exercise.split(".", 1)[1]
    try:
        obj = eval(expression, namespace)
    except BaseException as e:
        return {
            "status": "error",
            "message": f"could not find `{expression}` after running your "
            f"cell: {type(e).__name__}: {e}",
        }
    if obj is get(exercise).reference:
        return {
            "status": "failed",
            "message": f"`{expression}` is the package's own implementation, not yours",
        }
    try:
        result = run_checks(exercise, obj, hidden=True)
    except BaseException as e:  # SystemExit, KeyboardInterrupt: run_checks lets them through
        return {"status": _status(e), "message": _describe(e, "")}
    if result.exception is not None and _is_memory(result.exception):
        return {"status": "memory", "message": result.message}
    message = result.message or ("" if result.ok else "not implemented yet")
    return {
        "status": result.status,
        "message": message,
        "checks": f"{result.passed}/{result.total}",
    }


def _grandchild(job: dict, fds: list[int]) -> None:
    events, output = fds
    os.setsid()  # its own process group: a timeout kills it and anything it started
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.chdir(job["cwd"])
    _run_plan(job, events)


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def serve_zygote(sock_fd: int, chapter: str) -> None:
    """Import torch and the chapter's checks once, then fork one process per request."""
    sock = socket.socket(fileno=sock_fd)
    try:
        from IPython.core.inputtransformer2 import TransformerManager  # noqa: F401

        from .checking import exercises

        found = [{"id": e.id, "points": e.points, "title": e.title} for e in exercises(chapter)]
        _send(sock, {"ready": True, "exercises": found})
    except BaseException:
        _send(sock, {"ready": False, "error": traceback.format_exc()})
        return
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 4096, 2)
        if not message:
            return  # the grader closed its end
        job = json.loads(Path(message.decode()).read_text())
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                sock.close()
                _grandchild(job, fds)
            except BaseException:
                code = 70
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        _send(sock, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(sock, {"exit": os.waitstatus_to_exitcode(status)})


# --- in the grader -------------------------------------------------------------------------------


class Zygote:
    def __init__(self, chapter: str, workdir: Path):
        self.chapter, self.workdir = chapter, workdir
        self._spawn()

    def _spawn(self) -> None:
        chapter, workdir = self.chapter, self.workdir
        self.sock, theirs = socket.socketpair()
        env = dict(os.environ, QWEN_MINI_CHECKS="learner")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.log = workdir / "zygote.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "qwen_mini.course.grade",
                    "--zygote",
                    str(theirs.fileno()),
                    chapter,
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env=env,
            )
        theirs.close()
        self.buffer = b""
        ready = self.receive(timeout=600)
        if not ready or not ready.get("ready"):
            detail = (ready or {}).get("error") or self.log.read_text(errors="replace")
            self.close()
            raise GraderError(f"could not load the checks of {chapter}:\n{detail}")
        self.exercises = ready["exercises"]
        if not self.exercises:
            self.close()
            raise GraderError(
                f"no exercises are registered for {chapter} (qwen_mini/course/checks)"
            )

    def receive(self, timeout: float) -> dict | None:
        """The next message, or None at EOF or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def start(self, job_file: Path, fds: list[int]) -> int:
        """Hand a job to the worker and return the pid of the process it forked for it. A
        submission may have killed the worker (its parent): then start a new worker, once."""
        for attempt in range(2):
            reply = None
            if self.proc.poll() is None:
                with contextlib.suppress(OSError):
                    socket.send_fds(self.sock, [str(job_file).encode()], fds)
                    reply = self.receive(timeout=60)
            if reply and "pid" in reply:
                return reply["pid"]
            if attempt == 0:
                self.close()
                self._spawn()
        raise GraderError(f"the grading worker stopped: {self.log.read_text(errors='replace')}")

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


WORKER_GONE = 1 << 16  # an exit code no process has: the worker died before reporting one


@dataclass
class Run:
    """What one forked process reported before it finished or was stopped."""

    events: list[dict] = field(default_factory=list)
    output: bytearray = field(default_factory=bytearray)
    output_bytes: int = 0
    exit_code: int | None = None
    timed_out: bool = False


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_job(zygote: Zygote, job: dict, workdir: Path, timeout: float, setup_timeout: float) -> Run:
    """Fork a process for `job`; collect its events and output; kill it when a step overruns."""
    job_file = workdir / "job.json"
    job_file.write_text(json.dumps(job))
    events_r, events_w = os.pipe()
    output_r, output_w = os.pipe()
    pid = zygote.start(job_file, [events_w, output_w])
    os.close(events_w)
    os.close(output_w)
    run, pending = Run(), b""
    open_fds = {events_r, output_r}
    deadline, drain_until = time.monotonic() + setup_timeout, float("inf")
    while open_fds or run.exit_code is None:
        if run.exit_code is None and time.monotonic() > deadline:
            run.timed_out = True
            _kill(pid)
            deadline = float("inf")
        if run.exit_code is None and b"\n" in zygote.buffer:  # already read with the pid
            run.exit_code = zygote.receive(0)["exit"]
            drain_until = time.monotonic() + 5
        if run.exit_code is not None and time.monotonic() > drain_until:
            break  # something the submission started still holds the pipes; stop listening
        watch = list(open_fds) + ([zygote.sock] if run.exit_code is None else [])
        wait = 0.2 if run.exit_code is not None else min(deadline - time.monotonic(), 1.0)
        wait = max(0.0, wait)
        for fd in select.select(watch, [], [], wait)[0]:
            if fd is zygote.sock:
                reply = zygote.receive(5)
                run.exit_code = reply["exit"] if reply else WORKER_GONE
                drain_until = time.monotonic() + 5
                _kill(pid)  # anything the submission left running holds our pipes open
                continue
            data = os.read(fd, 65536)
            if not data:
                open_fds.discard(fd)
                os.close(fd)
            elif fd == output_r:
                run.output_bytes += len(data)
                run.output += data[: max(0, PROCESS_OUTPUT_CAP - len(run.output))]
            else:
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    event = json.loads(line)
                    run.events.append(event)
                    limit = setup_timeout if event["event"] == "setup-start" else timeout
                    deadline = time.monotonic() + limit
    for fd in open_fds:
        os.close(fd)
    return run


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


# --- output --------------------------------------------------------------------------------------


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


def submissions(paths: list[Path]) -> list[Path]:
    """Files as given; folders expand to the notebooks inside them (checkpoints skipped)."""
    found = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        else:
            found.append(path)
    return found


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qwen-mini grade",
        description="\n\n".join(__doc__.split("\n\n")[:3]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--chapter", type=int, required=True, help="chapter number, e.g. 1")
    p.add_argument("--out", type=Path, required=True, help="CSV file to write")
    p.add_argument("--reports", type=Path, help="folder for one JSON report per notebook")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per exercise (30)")
    p.add_argument(
        "--memory-mb",
        type=int,
        default=2048,
        help="memory a submission may use beyond the grader's own (2048)",
    )
    p.add_argument(
        "--solutions",
        type=Path,
        default=ROOT / "solutions",
        help="folder of reference notebooks (the repository's solutions/)",
    )
    p.add_argument("files", nargs="+", type=Path, help="submitted notebooks or folders of them")
    return p


def cli(argv: list[str] | None = None) -> int:
    try:
        options = build_parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error: argparse has printed the message
        return int(e.code or 0)
    try:
        return _grade_all(options)
    except (GraderError, NotebookError) as e:
        print(f"qwen-mini grade: error: {e}", file=sys.stderr)
        return 1


def _grade_all(options) -> int:
    ref = load_reference(options.solutions, options.chapter)
    files = submissions(options.files)
    with tempfile.TemporaryDirectory(prefix="qwen-mini-zygote-") as tmp:
        zygote = Zygote(ref.chapter, Path(tmp))
        try:
            all_grades = [grade_notebook(path, ref, zygote, options) for path in files]
        finally:
            zygote.close()
    ids = [e["id"] for e in zygote.exercises]
    max_total = sum(e["points"] for e in zygote.exercises)
    write_csv(options.out, ids, all_grades)
    used: set[str] = set()
    for grades in all_grades:
        if options.reports:
            write_report(options.reports, grades, options.chapter, max_total, used)
        note = f" — {grades.error}" if grades.error else ""
        warn = f" ({len(grades.warnings)} warnings)" if grades.warnings else ""
        print(f"{grades.notebook}: {_number(grades.total)}/{_number(max_total)}{warn}{note}")
    print(
        f"wrote {options.out}" + (f" and reports in {options.reports}" if options.reports else "")
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        serve_zygote(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit(cli(sys.argv[1:]))
