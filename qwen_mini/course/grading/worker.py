"""What runs on the sandbox side: the zygote, and in each forked worker the learner's cells.

The zygote (`python -I`, trusted, started once per grading slot) imports torch, IPython's cell
transformer and the chapter's references (never its checks: the grader says where each reference
is), notes what every reference is made of, then forks one worker per submission. A worker
enters a view of the machine of its own (isolation.py), drops to an unprivileged user of its own
(when the grader runs as root), sets its limits, and then obeys the grader: run cell N, look up
a name, call a method of an object of its own, report whether an exercise's reference ran. It
never compares anything: the checks run in the grader, on values this process sends as plain
data.

When a submission is done, the zygote kills every process it left behind: the worker's session,
every process of its user id, and every orphan reparented to the zygote (a child subreaper), so
`setsid` and double forks do not escape.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import importlib
import importlib.util
import io
import json
import os
import resource
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

from .. import observing
from ..checking import exception_text, learner_line
from . import byvalue, isolation, protocol
from .monitor import Monitor, Snapshot, changed
from .protocol import Codec, Handle, ProtocolError

FILE_SIZE_LIMIT = 64 * 2**20  # bytes: a submission may write files, but not fill the disk
# a worker's memory cgroup also counts the zygote's pages it writes to (copy-on-write)
COPY_HEADROOM_MB = 256  # measured: about 25 MB once started
PROCESS_LIMIT = 64  # processes of a submission's user (fork bombs)
PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG = 36, 1
KEPT_ENV = {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "MPLBACKEND", "MKL_NUM_THREADS"}
_DROPPED = False  # this process runs as a user id of its own
_FROM_FILES: list[str] = []  # the files references were loaded from (an extra chapter's checks)
_PIECES: dict[str, object] = {}  # earlier chapters' references, by exercise id (the zygote's)


# --- the worker ----------------------------------------------------------------------------------


class _Shell:
    """Just enough of IPython's `get_ipython()` for a cell with magics to run headless."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def run_line_magic(self, name, line, *args, **kwargs):
        self.worker.notes.append(f"skipped the magic %{name}")

    def run_cell_magic(self, name, line, cell, *args, **kwargs):
        if name in ("time", "timeit", "capture"):  # these run their body as Python
            # the cell's own body is its code; any other text handed to the magic (the
            # package's source, read with inspect) is code compiled by the cell, like exec's
            own = isinstance(cell, str) and cell.strip() in self.worker.source
            where = f"<cell {self.worker.cell} %%{name}>"
            if own:
                self.worker.exec_source(cell, where)
            else:
                exec(compile(self.worker.transform(cell), where, "exec"), self.worker.namespace)
        else:
            self.worker.notes.append(f"skipped the cell magic %%{name}")

    def system(self, cmd, *args, **kwargs):
        self.worker.notes.append(f"skipped the shell command !{cmd}")

    def getoutput(self, cmd, *args, **kwargs):
        self.worker.notes.append(f"skipped the shell command !{cmd}")
        return []


class ParentObject:
    """An object of the grader's (a reference KV cache a check passes in): public attributes and
    calls go back to the grader."""

    __slots__ = ("_worker", "_h", "_type")

    def __init__(self, worker, h, type_name):
        object.__setattr__(self, "_worker", worker)
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "_type", type_name)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return self._worker.ask({"op": "getattr", "h": self._h, "name": name})

    def __setattr__(self, name, value):
        if name.startswith("_"):
            raise AttributeError(name)
        self._worker.ask({"op": "setattr", "h": self._h, "name": name, "value": value})

    def __call__(self, *args, **kwargs):
        return self._worker.ask({"op": "call", "h": self._h, "args": args, "kwargs": kwargs})

    def __repr__(self):
        return f"<grader's {self._type}>"


class Worker:
    def __init__(self, sock: socket.socket, snapshot: Snapshot):
        from IPython.core.inputtransformer2 import TransformerManager

        self.sock, self.snap = sock, snapshot
        self.transform = TransformerManager().transform_cell
        self.codec = Codec("w", lambda h, t: ParentObject(self, h, t))
        self.monitor = Monitor(snapshot)
        self.namespace = {"__name__": "__main__", "__builtins__": builtins}
        self.namespace["get_ipython"] = lambda: _Shell(self)
        self.notes: list[str] = []
        self.checked: list[tuple[str, object]] = []
        self.cell, self.source = -1, ""
        self.cells: dict[str, list[str]] = {}  # each cell's code by its file name, "<cell 5>"
        self.request_id = 0
        self.observers = dict(observing.OBSERVERS)  # as they were before any learner code
        self.gradients = observing.gradients_here
        self.observations: dict[int, object] = {}  # what the checks asked to observe now
        self.observing = False
        self.learner_rng = None  # torch's random state before the checks shared theirs
        self.rng_reported = None  # the shared state as the grader last knew it

    # the learner's check() and use(): grading happens in the grader

    def check(self, exercise_id, obj=None, *args, **kwargs):
        self.checked.append((str(exercise_id), obj))

    def use(self, exercise_id, obj=None, *args, **kwargs):
        exercise_id = str(exercise_id)
        if exercise_id not in self.snap.references:
            raise KeyError(f"unknown exercise {exercise_id!r}")
        if obj is self.snap.references[exercise_id]:
            return obj
        ok = self.ask({"op": "use", "ex": exercise_id, "obj": obj})
        return obj if ok is True else self.snap.references[exercise_id]

    # channel

    def ask(self, message: dict):
        """Send a request to the grader and serve its requests until the answer comes."""
        self.request_id += 1
        message = dict(message, id=self.request_id)
        for key in ("args", "kwargs", "value", "obj"):
            if key in message:
                message[key] = self.codec.encode(message[key])
        protocol.send(self.sock, message)
        return self.serve(until=self.request_id)

    def serve(self, until=None):
        while True:
            message = protocol.receive(self.sock)
            if "op" not in message:
                if message.get("id") != until:
                    raise ProtocolError("an answer to a question not asked")
                if "raise" in message:
                    raise _exception(message["raise"])
                return self.codec.decode(message.get("re"))
            self.answer(message)
            if message["op"] == "quit":
                return None

    def answer(self, message: dict) -> None:

        try:
            with self.observed(message.get("op")):
                value = self.do(message)
            result = {"re": self.codec.encode(value)}
        except ProtocolError:
            raise
        except BaseException as e:  # the learner's exception, sent as a description
            where = learner_line(e, self.cells.get)[:300]
            result = {"raise": {"type": _type_name(e), "msg": _message(e), "where": where}}
        if message.get("op") in byvalue.STATE_OPS:
            try:  # what the learner's code did to the objects the check passed in
                result.update(self.changes())
            except BaseException as e:
                result = {"raise": {"type": _type_name(e), "msg": _text(e)}}
        if self.learner_rng is not None and message.get("op") in byvalue.STATE_OPS:
            import torch

            state = torch.get_rng_state()  # where the learner's code left the check's stream
            if not torch.equal(state, self.rng_reported):
                result["rng"] = protocol.rng_text(state)
                self.rng_reported = state
        protocol.send(self.sock, dict(result, id=message.get("id")))

    @contextlib.contextmanager
    def observed(self, op):
        """A call of the learner's code, inside the observations a check asked for (once: not
        again in the calls the grader makes back while it runs)."""
        if op not in byvalue.STATE_OPS or not self.observations or self.observing:
            yield
            return
        self.observing = True
        try:
            with contextlib.ExitStack() as stack:
                for seen in self.observations.values():
                    stack.enter_context(seen.around())
                yield
        finally:
            self.observing = False

    def changes(self) -> dict:
        """The state of the grader's objects this process holds, as the learner's code left
        them: by-value copies ("state"), tensors and containers passed as data ("args")."""
        import torch

        out = {}
        copies = self.codec.from_grader
        if any(not isinstance(obj, torch.Tensor) for obj in copies.values()):
            out["state"] = [
                [h, self.codec.encode(byvalue.state_of(obj, self.codec.snapshots.get(h)))]
                for h, obj in list(copies.items())
                if not isinstance(obj, torch.Tensor)
            ]
        changed = byvalue.changed_arguments(self.codec)
        if changed:
            out["args"] = changed
        return out

    def do(self, m: dict):
        import torch

        op, lookup, decode = m["op"], self.codec.lookup, self.codec.decode
        for h, value in m.get("sync", []):
            with torch.no_grad():
                lookup(h).copy_(decode(value))
        if "rng" in m:  # the check's random stream, as in the notebook
            if self.learner_rng is None:
                self.learner_rng = torch.get_rng_state()
            self.rng_reported = protocol.rng_state(m["rng"])
            torch.set_rng_state(self.rng_reported)
        if op == "restore_rng":
            if self.learner_rng is not None:
                torch.set_rng_state(self.learner_rng)
            self.learner_rng = None
            return None
        with torch.set_grad_enabled(m.get("grad", True) is True):
            if op == "cell":
                return self.run_cell(m["i"], m["src"])
            if op == "lookup":
                name = m["name"]
                if name not in self.namespace:
                    raise NameError(f"name {name!r} is not defined")
                return Handle(self.namespace[name])
            if op == "handle":
                return Handle(lookup(m["h"]))
            if op == "fallback":
                self.namespace[m["name"]] = self.snap.references[m["ex"]]
                return None
            if op == "begin":
                self.codec.from_grader.clear()  # the copies of an earlier exercise's checks
                self.codec.origin.clear()
                self.codec.storage_origin.clear()
                self.codec.snapshots.clear()
                self.codec.sent.clear()
                self.observations.clear()
                return self.begin(m["ex"])
            if op == "end":
                hit = self.monitor.stop()
                return {"reference": hit, "tampered": changed(self.snap.names)}
            if op == "quit":
                return None
            if op == "observe":
                if m.get("kind") not in self.observers:
                    raise ProtocolError(f"unknown observation {m.get('kind')!r}")
                i = max(self.observations, default=0) + 1
                self.observations[i] = self.observers[m["kind"]]()
                return i
            if op == "unobserve":
                if m.get("i") not in self.observations:
                    raise ProtocolError("no such observation")
                return self.observations.pop(m["i"]).value
            target = lookup(m["h"])
            if op == "call":
                return target(*decode(m["args"]), **decode(m["kwargs"]))
            if op == "grad":  # the call and its backward pass (observing.gradients)
                return self.gradients(target, tuple(decode(m["args"])))
            if op == "getattr":
                return getattr(target, m["name"])
            if op == "setattr":
                return setattr(target, m["name"], decode(m["value"]))
            if op == "getitem":
                return target[decode(m["key"])]
            if op == "setitem":
                target[decode(m["key"])] = decode(m["value"])
                return None
            if op == "len":
                return len(target)
            if op == "iter":
                return Handle(iter(target))
            if op == "next":
                return next(target)
        raise ProtocolError(f"unknown operation {op!r}")

    def begin(self, exercise: str) -> dict:
        if exercise not in self.snap.references:
            raise ProtocolError(f"unknown exercise {exercise!r}")
        helpers = _helpers_alive()
        self.monitor.start(exercise)
        return {"tampered": changed(self.snap.names), "helpers": helpers}

    # cells

    def exec_source(self, text: str, name: str) -> None:
        source = self.transform(text)
        self.cells[name] = source.splitlines()  # the lines a message about an error quotes
        code = compile(source, name, "exec")
        self.monitor.add_cell(code)
        exec(code, self.namespace)

    def run_cell(self, index: int, text: str) -> dict:
        self.cell, self.notes, self.checked, self.source = index, [], [], text
        result = {"ok": True}
        try:
            self.exec_source(text, f"<cell {index}>")
        except BaseException as e:
            result = {"ok": False, "kind": _kind(e), "error": _describe(e, f"<cell {index}>")}
        sys.stdout.flush()
        sys.stderr.flush()
        result["notes"] = self.notes
        result["checked"] = [[x, Handle(obj)] for x, obj in self.checked]
        return result


def _type_name(obj) -> str:
    t = obj if isinstance(obj, type) else type(obj)
    return str(getattr(t, "__name__", "object"))[:100]


def _text(e: BaseException, limit: int = 2000) -> str:
    try:
        text = str(e)
    except BaseException:
        text = "(an exception whose message could not be read)"
    return text[:limit]


def _message(e: BaseException) -> str:
    """What the grader rebuilds `e` from: its text; a KeyError's key itself (the grader's
    KeyError(key) then reads as this one does: str() of a KeyError quotes its key)."""
    if isinstance(e, KeyError) and len(e.args) == 1 and type(e.args[0]) is str:
        return e.args[0][:2000]
    return _text(e)


def _exception(info) -> BaseException:
    if type(info) is not dict:
        raise ProtocolError("a malformed exception")
    name, text = str(info.get("type")), str(info.get("msg"))
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(text)
    return RuntimeError(f"{name}: {text}")


def _kind(e: BaseException) -> str:
    if isinstance(e, NotImplementedError):
        return "not-implemented"
    if isinstance(e, (SystemExit, KeyboardInterrupt)):
        return "exit"
    text = _text(e).lower()
    if isinstance(e, MemoryError) or "can't allocate memory" in text or "out of memory" in text:
        return "memory"
    return "error"


def _describe(e: BaseException, filename: str) -> str:
    if isinstance(e, SystemExit):
        return f"called sys.exit({_text(e)}); a notebook must not exit"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == filename]
    at = f" (line {lines[-1]} of the cell)" if lines else ""
    return f"raised {exception_text(e)}{at}"


def _helpers_alive() -> str:
    """Threads or processes the submission started that still run (they would escape the
    monitor while an exercise is checked)."""
    me, uid = os.getpid(), os.getuid()
    if not _DROPPED:
        return ""
    for pid in _pids():
        if pid != me and _uid_of(pid) == uid:
            return f"process {pid}"
    return ""


# --- processes -----------------------------------------------------------------------------------


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _state_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""


def _descendants(root: int) -> set[int]:
    parents = {pid: _parent_of(pid) for pid in _pids()}
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier and p not in found}
        found |= frontier
    return found


def sweep(uid: int | None, patience: float = 60.0) -> int:
    """Kill every descendant of this process (orphans are reparented here: a subreaper) and
    every process of `uid`, until none is left (a machine under load can take seconds to end a
    fork bomb: the limit is time, not a number of rounds); reap them. How many were left."""
    me = os.getpid()
    give_up = time.monotonic() + patience
    victims: set[int] = set()
    while time.monotonic() < give_up:
        victims = _descendants(me)
        if uid is not None:
            victims |= {p for p in _pids() if _uid_of(p) == uid}
        victims.discard(me)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _reap()
        if not victims:
            return 0
        time.sleep(0.01)
    return len(victims)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: no subreaper; the process group and the user id still apply


def _limit(memory_mb: int, uid: int | None) -> None:
    try:
        with open("/proc/self/status") as f:
            size_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        size_kb = 0
    limit = size_kb * 1024 + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if uid is not None:  # counts the processes of this user id, which is the submission's own
        resource.setrlimit(resource.RLIMIT_NPROC, (PROCESS_LIMIT, PROCESS_LIMIT))


def _become(job: dict) -> None:
    """In the forked child: a session of its own, its own view of the machine (isolation.py),
    limits, the submission's user, its folder and its own temporary space."""
    os.setsid()
    uid = job.get("uid")
    view = job.get("view")
    if view:
        limit = (job["memory_mb"] + COPY_HEADROOM_MB) * 2**20
        isolation.join_memory_group(_group_name(os.getpid(), job), limit)
        isolation.enter(Path(view["root"]), job["cwd"], job["memory_mb"], **view["paths"])
    _limit(job["memory_mb"], uid)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        global _DROPPED
        _DROPPED = True
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the zygote gone: nothing left to answer to
    os.chdir(job["cwd"])
    temporary = "/tmp" if view else job["cwd"]  # a private /tmp, or the submission's folder
    keep = {k: v for k, v in os.environ.items() if k in KEPT_ENV or k.startswith(("LC_", "OMP_"))}
    os.environ.clear()  # nothing of the grader's environment (a sudo command line...)
    os.environ.update(keep, HOME=job["cwd"], TMPDIR=temporary, QWEN_MINI_CHECKS="learner")
    os.environ["QWEN_MINI_MINE"] = "off"  # mine(...) is the package's piece, as for nbgrader
    tempfile.tempdir = None  # computed again from TMPDIR, not the zygote's cached choice
    sys.dont_write_bytecode = True
    if uid is not None:  # nothing importable from a folder it can write
        sys.path[:] = [p for p in sys.path if not os.access(p, os.W_OK)]
        sys.path_importer_cache.clear()
    sys.stdout = _output(1)
    sys.stderr = _output(2)


class _Output(io.RawIOBase):
    """File descriptor 1 or 2 for `print`: a write past FILE_SIZE_LIMIT is dropped, not an
    error in the learner's cell (the report keeps the first bytes only), so a notebook that
    prints forever runs into its time limit however fast the machine writes."""

    def __init__(self, fd: int):
        self.fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> int:
        try:
            return os.write(self.fd, data)
        except OSError as e:
            if e.errno != errno.EFBIG:
                raise
            return len(data)


def _output(fd: int) -> io.TextIOWrapper:
    buffered = io.BufferedWriter(_Output(fd))
    return io.TextIOWrapper(buffered, errors="backslashreplace", line_buffering=True)


def _group_name(pid: int, job: dict) -> str:
    return f"{pid}-{job.get('uid')}"


def _worker_main(job: dict, sock: socket.socket, output: int, snapshot: Snapshot) -> None:
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    _become(job)
    import qwen_mini.course as course
    from qwen_mini.course import checking

    worker = Worker(sock, snapshot)
    course.check = checking.check = worker.check
    course.use = checking.use = worker.use
    checking.reference = _reference_of({**_PIECES, **snapshot.references})
    worker.monitor.watch_threads()
    sys.addaudithook(worker.monitor.audit)
    try:
        protocol.send(sock, {"ready": True})
        worker.serve()
    except (EOFError, OSError, ProtocolError):
        pass


def _reference_of(pieces: dict):
    """`checking.reference` in the sandbox, where no check module can be imported: the
    package's pieces the zygote located (this chapter's and the earlier chapters')."""
    from qwen_mini.course.checking import UnknownExercise

    def reference(exercise_id: str):
        if exercise_id not in pieces:
            raise UnknownExercise(f"unknown exercise {exercise_id!r} (when graded)")
        return pieces[exercise_id]

    return reference


# --- the zygote ----------------------------------------------------------------------------------


def _locate(where: list) -> object:
    """An exercise's reference from its place: [module, qualified name, file]. A module the
    package does not hold (an extra chapter's check file defining its reference) is loaded from
    its file; the package's check modules are never imported here."""
    module, qualname, file = where
    if module not in sys.modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            spec = importlib.util.spec_from_file_location(module, file)
            sys.modules[module] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[module])
            _FROM_FILES.append(os.path.realpath(file))
    obj = sys.modules[module]
    for name in qualname.split("."):
        obj = getattr(obj, name)
    return obj


def _references(spec: dict) -> tuple[list, set]:
    """(exercises with their references, earlier chapters' reference classes) of the grader's
    description of the chapter: what the worker needs, without a single check."""
    found = [types.SimpleNamespace(id=x, reference=_locate(w)) for x, w in spec["exercises"]]
    _PIECES.update({x: _locate(w) for x, w in spec.get("pieces", [])})
    return found, {_locate(w) for w in spec["earlier"]}


def _in_child(fn) -> str:
    """Run `fn` in a forked child (it may mount, chroot or switch users); the text it returns,
    or what it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                text = fn()
            except BaseException as e:
                text = exception_text(e)
            os.write(w, text.encode()[:2000])
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return text


def _view(workdir: Path) -> tuple[dict | None, str]:
    """The worker's view of the machine (isolation.py) if this machine lets the zygote build it
    (tried once, in a child), else None and why (not root, namespaces forbidden)."""
    if os.geteuid() != 0:
        return None, "the grader does not run as root"
    root, probe = workdir / "view", workdir / "probe"
    root.mkdir(exist_ok=True)
    probe.mkdir(exist_ok=True)
    paths = {"visible": isolation.visible_paths(), "hidden": isolation.hidden_paths()}
    paths["files"] = _FROM_FILES

    def attempt() -> str:
        isolation.enter(root, str(probe), 16, **paths)
        return ""

    why = _in_child(attempt)
    return (None, why) if why else ({"root": str(root), "paths": paths}, "")


def _unreadable(paths: list[str]) -> str:
    """As a user of no account, the first of `paths` it cannot read ("" if none)."""
    return _in_child(lambda: isolation.readable_problem(2_099_999_999, paths))


def serve_zygote(sock_fd: int, chapter: str) -> None:
    sock = socket.socket(fileno=sock_fd)
    try:
        import torch
        import torch._dynamo  # noqa: F401  (imported once here, so that importing it is no change)
        import torch._inductor.config

        # torch.compile compiles in the process itself (no pool of compile workers, which a
        # check, where a compiled helper may first be called, could not start), and without
        # precompiled headers (a file of 150 MB, over the file size limit)
        torch._inductor.config.compile_threads = 1
        torch._inductor.config.cpp_cache_precompile_headers = False
        from IPython.core.inputtransformer2 import TransformerManager  # noqa: F401

        import qwen_mini

        torch.set_num_threads(1)
        os.environ.setdefault("MPLBACKEND", "Agg")
        with contextlib.suppress(ImportError):  # once here, not once per notebook (and its fonts)
            import matplotlib.pyplot as plt

            plt.figure()
            plt.close("all")
        found, earlier = _references(protocol.receive(sock))
        snapshot = Snapshot(found, earlier=earlier)
        view, why = _view(Path.cwd())
        problem = ""
        if view is None and os.geteuid() == 0:  # users switch, but see the machine as it is
            needed = [sys.executable, *sys.path, *(m.__file__ for m in (qwen_mini, torch))]
            problem = _unreadable([p for p in needed if p and os.path.exists(p)])
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        ready = {"ready": True, "exercises": [e.id for e in found], "not_isolated": why}
        protocol.send(sock, dict(ready, unreadable=problem))
    except BaseException:
        protocol.send(sock, {"ready": False, "error": traceback.format_exc()})
        return
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 65536, 2)
        except OSError:
            return
        if not message:
            return
        job = dict(json.loads(message), view=view)
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                _worker_main(job, socket.socket(fileno=fds[0]), fds[1], snapshot)
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        protocol.send(sock, {"pid": pid})
        try:
            protocol.receive(sock)  # {"end": ...}: the grader is done with this submission
        except (EOFError, OSError, ProtocolError):
            sweep(job.get("uid"))
            if view:
                isolation.leave_memory_group(_group_name(pid, job))
            return
        stopped = _state_of(pid) == "T"
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = None
        try:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            pass
        left = sweep(job.get("uid"))
        if view:
            isolation.leave_memory_group(_group_name(pid, job))
        protocol.send(sock, {"exit": code, "stopped": stopped, "left": left})
