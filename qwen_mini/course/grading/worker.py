"""What runs inside the forked grading process: learner cells, then the checks, with limits."""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

OUTPUT_CAP = 10_000  # characters of printed output kept per exercise
FILE_SIZE_LIMIT = 64 * 2**20  # bytes: a submission may write files, but not fill the disk


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
    from ..checking import get, run_checks

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

    from ..checking import _EXERCISES

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

        from ..checking import exercises

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


if __name__ == "__main__":
    serve_zygote(int(sys.argv[2]), sys.argv[3])
