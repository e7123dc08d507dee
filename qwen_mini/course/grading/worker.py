"""What runs in the jail (jail.py): the worker, which runs the learner's cells.

A worker (`python -I`, started by the grader in a bubblewrap jail of its own, one per
submission) imports torch, IPython's cell transformer and the chapter's references (never its
checks: the grader says where each reference is), notes what every reference is made of, sets
its last limits, and then obeys the grader: run cell N, look up a name, call a method of an
object of its own, report whether an exercise's reference ran. It never compares anything: the
checks run in the grader, on values this process sends as plain data. Whatever it starts ends
with its jail (the jail's pid namespace).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import importlib
import importlib.util
import io
import os
import resource
import signal
import socket
import sys
import tempfile
import time
import traceback
import types

from .. import observing
from ..checking import exception_text, learner_line
from . import byvalue, protocol
from .jail import PROCESS_LIMIT
from .monitor import Monitor, Snapshot, changed
from .protocol import Codec, Handle, ProtocolError

_PIECES: dict[str, object] = {}  # earlier chapters' references, by exercise id


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
        self.pid = os.getpid()
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

    def send(self, message: dict) -> None:
        """Only the worker speaks on the channel: a copy of it that the learner's code forked
        (a fork bomb's, or `os.fork()` whose child runs on) ends here instead of answering the
        grader in the worker's name."""
        if os.getpid() != self.pid:
            os._exit(0)
        protocol.send(self.sock, message)

    def ask(self, message: dict):
        """Send a request to the grader and serve its requests until the answer comes."""
        self.request_id += 1
        message = dict(message, id=self.request_id)
        for key in ("args", "kwargs", "value", "obj"):
            if key in message:
                message[key] = self.codec.encode(message[key])
        self.send(message)
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
        self.send(dict(result, id=message.get("id")))

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
        out = {}
        if self.codec.copies:
            out["state"] = [
                [h, self.codec.encode(byvalue.state_of(self.codec, h, obj))]
                for h, obj in list(self.codec.copies.items())
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
                self.codec.copies.clear()
                self.codec.weights.clear()
                self.codec.origin.clear()
                self.codec.storage_origin.clear()
                self.codec.snapshots.clear()
                self.codec.sent.clear()
                self.observations.clear()
                return self.begin(m["ex"], float(m["wait"]))
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

    def begin(self, exercise: str, wait: float) -> dict:
        if exercise not in self.snap.references:
            raise ProtocolError(f"unknown exercise {exercise!r}")
        self.monitor.start(exercise)  # from here on, no thread of the notebook starts a process
        stopped, helpers = _stop_leftovers(wait)
        return {"tampered": changed(self.snap.names), "stopped": stopped, "helpers": helpers}

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
            if os.getpid() != self.pid:  # a fork bomb's copy whose fork failed: gone at once
                os._exit(0)
            result = {"ok": False, "kind": _kind(e), "error": _describe(e, f"<cell {index}>")}
        if os.getpid() != self.pid:  # a copy the cell forked ran on to here: see send()
            os._exit(0)
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


# what stopping a notebook's processes calls, bound before any learner code: a cell that
# replaces os.listdir or os.kill does not hide its processes from the stop
_os = types.SimpleNamespace(
    getppid=os.getppid, listdir=os.listdir, kill=os.kill, waitpid=os.waitpid, _exit=os._exit
)


def _stop_leftovers(wait: float) -> tuple[int, str]:
    """Stop every process the submission left running, before an exercise is checked: a helper
    would compute out of the monitor's sight, and a fork bomb's copies, each ending as its fork
    fails, let others take the places they free for as long as the CPU is busy. In the jail's
    pid namespace that is every process but its first (bwrap's, our parent, which reaps
    orphans) and this one; kill(-1) reaches them all at once, so none can fork past it. The
    killed get up to `wait` seconds to be gone. Returns how many were running, and one still
    running after that ("" if none: a process stuck in the kernel may not yet have seen its
    signal)."""
    if _os.getppid() != 1:  # not in a jail of its own: kill(-1) would reach the user's processes
        return 0, ""
    me, until = os.getpid(), time.monotonic() + wait

    def running() -> list[str]:  # not yet ended, and not on their way out
        _reap()
        ours = (p for p in _os.listdir("/proc") if p.isdigit() and int(p) not in (1, me))
        return [p for p in ours if _live(p)]

    found = left = running()
    while left and time.monotonic() < until:
        with contextlib.suppress(OSError):
            _os.kill(-1, signal.SIGKILL)
        time.sleep(0.02)
        left = running()
    return len(found), f"process {left[0]}" if left else ""


def _reap() -> None:
    """Collect this process's ended children (they stay in /proc until it does)."""
    while True:
        try:
            pid, _ = _os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


PF_EXITING = 0x4  # a process's flag (in /proc/<pid>/stat) once it has begun to exit


def _live(pid: str) -> bool:
    """Whether a process runs and is not exiting (a killed one, tearing down its memory, is)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # state, ppid, ..., flags (6th)
        return fields[0] not in ("Z", "X") and not int(fields[6]) & PF_EXITING
    except (OSError, IndexError, ValueError):
        return False  # gone while we looked


def _settle(memory_mb: int) -> None:
    """Before any learner code, once Python, torch and the references are loaded: the address
    space this process has now plus the memory limit; at most PROCESS_LIMIT processes (counted
    in the jail's user namespace); the worker's output, its imports."""
    try:
        with open("/proc/self/status") as f:
            size_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        size_kb = 0
    limit = size_kb * 1024 + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_NPROC, (PROCESS_LIMIT, PROCESS_LIMIT))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails instead of killing
    tempfile.tempdir = None
    sys.dont_write_bytecode = True
    sys.path[:] = [p for p in sys.path if p and not os.access(p, os.W_OK)]  # none it can write
    sys.path_importer_cache.clear()
    sys.stdout, sys.stderr = _STREAMS[:] = _output(1), _output(2)


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


_STREAMS: list = []  # the worker's stdout and stderr


def _output(fd: int) -> io.TextIOWrapper:
    buffered = io.BufferedWriter(_Output(fd))
    return io.TextIOWrapper(buffered, errors="backslashreplace", line_buffering=True)


def _worker_main(sock: socket.socket, snapshot: Snapshot) -> None:
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
    # the grader has closed the channel: end now, without the second of tearing down Python and
    # torch (and without running what the notebook registered to run at exit)
    for stream in _STREAMS:  # ours, whatever the notebook put in their place
        with contextlib.suppress(Exception):
            stream.flush()
    _os._exit(0)


def _reference_of(pieces: dict):
    """`checking.reference` in the sandbox, where no check module can be imported: the
    package.s pieces the worker located (this chapter's and the earlier chapters')."""
    from qwen_mini.course.checking import UnknownExercise

    def reference(exercise_id: str):
        if exercise_id not in pieces:
            raise UnknownExercise(f"unknown exercise {exercise_id!r} (when graded)")
        return pieces[exercise_id]

    return reference


# --- loading ----------------------------------------------------------------------------------


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


def serve(sock_fd: int) -> None:
    """The worker, in its jail: load torch and the chapter's references (never its checks: the
    grader says where each reference is), note what they are made of, then obey the grader."""
    sock = socket.socket(fileno=sock_fd)
    os.environ.pop("PWD", None)  # bwrap sets it after --chdir; the jail's environment is the list
    try:
        job = protocol.receive(sock)
        # torch.compile compiles in the process itself (no pool of compile workers, which a
        # check, where a compiled helper may first be called, could not start), and without
        # precompiled headers (a file of 150 MB, over the file size limit). Set for inductor to
        # read when a notebook first compiles: importing the compiler up front would cost every
        # worker a second (monitor.namespaces accepts what that import changes).
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        os.environ["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] = "0"
        import torch

        torch.set_num_threads(1)
        # a notebook that plots imports matplotlib itself (0.3 s, counted in its own time and
        # memory); most submissions graded do not, so the worker does not import it for them
        os.environ.setdefault("MPLBACKEND", "Agg")
        found, earlier = _references(job["spec"])
        snapshot = Snapshot(found, earlier=earlier, recompiled_given=job["spec"].get("recompiled"))
        _settle(int(job["memory_mb"]))
    except BaseException:
        with contextlib.suppress(OSError):
            protocol.send(sock, {"ready": False, "error": traceback.format_exc()[-4000:]})
        return
    _worker_main(sock, snapshot)
