"""The grader's side of the jail: starting one worker per submission in a jail of its own
(jail.py), and the stand-ins (`Remote`) through which the checks, running here, call the
learner's objects.

A submission's worker runs in a bubblewrap jail (its own user, pid, network, IPC, UTS and mount
namespaces), in a fresh folder under the system's temporary folder, with limits on CPU time,
memory, file size, open files and processes, and a cgroup of its own where the machine has one.
Nothing it does reaches this process except messages on its socket, and each of those is
validated: a malformed one, a stall past the deadline or a dead worker raise `WorkerFault`,
which the session turns into that submission's status.

The grader's objects reach a worker in two ways: by value (a module, a package or check object:
see byvalue.py), or, for what cannot be pickled and the check's own functions, as a handle the
learner's code calls back through (`_exportable`, `_method_allowed`). A check's own hooks and
callbacks may be given stand-ins for the learner's objects (`_check_code`); anything else of
the grader's is called with plain data only.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import os
import pickle
import py_compile
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from ..checking import CHECKS, exercises, from_checks
from . import byvalue, jail, monitor, protocol
from .plan import ROOT, GraderError
from .protocol import Codec, ProtocolError

PROCESS_OUTPUT_CAP = 20_000  # bytes kept of what a worker wrote to its stdout / stderr
MAX_NESTING = 20  # requests from the worker while one of ours is pending
SYSTEM_TMP = tempfile.gettempdir()  # where submissions' folders go (the grader's own: per run)
# the name of each submission's folder (and cgroups) starts with it: the pid of the grader that
# loaded this module, so one grading run's leftovers are told from those of another beside it
SUBMISSION_PREFIX = f"qwen-mini-submission-{os.getpid()}-"
BOOT = (
    "import sys; sys.path.insert(0, sys.argv[2]); "
    "from qwen_mini.course.grading.worker import serve; serve(int(sys.argv[1]))"
)
START_TIMEOUT = 300  # seconds for a worker to load torch and the references (a busy machine)


class WorkerFault(BaseException):
    """The worker cannot go on: it overran its time, died, or broke the protocol. A
    BaseException, so that a check's `except Exception` cannot swallow it."""

    status = "crashed"


class WorkerTimeout(WorkerFault):
    status = "timeout"


class WorkerGone(WorkerFault):
    pass


class BadMessage(WorkerFault):
    pass


class Jail:
    """What every worker of a chapter starts with: where the chapter's references are, and the
    files of them that lie in a hidden folder (an extra chapter's check file)."""

    def __init__(self, chapter: str, workdir: Path):
        self.chapter, self.workdir = chapter, workdir
        self.spec = _chapter_spec(chapter)
        self.exercises = [x for x, _ in self.spec["exercises"]]
        places = [w for _, w in self.spec["exercises"] + self.spec["pieces"]]
        places += self.spec["earlier"]
        files = {os.path.realpath(w[2]) for w in places if w[2]}
        hidden = jail.hidden_paths()
        self.files = sorted(f for f in files if jail._inside(f, hidden))
        # the graded references' source stays out of the jail (their modules are imported from
        # bytecode there): no copy of it to edit and run, and no TorchScript of it; the
        # fingerprints of that source compiled again are computed here instead
        graded = {os.path.realpath(w[2]) for _, w in self.spec["exercises"] if w[2]}
        self.sourceless = {
            f: _compiled(f, workdir) for f in sorted(graded - set(self.files)) if f.endswith(".py")
        }
        earlier = [e.reference for e in _earlier(chapter) if isinstance(e.reference, type)]
        self.spec["recompiled"] = monitor.all_recompiled(exercises(chapter), earlier)


def _place(obj) -> list:
    """Where the worker finds `obj`: [module, qualified name, file of the module]."""
    module = sys.modules[obj.__module__]
    return [obj.__module__, obj.__qualname__, getattr(module, "__file__", None)]


def _chapter_spec(chapter: str) -> dict:
    """What a worker needs of a chapter ("ch05"): each exercise's id and where its reference
    is, and where the earlier chapters' reference classes are (a later exercise may subclass
    them). Never the checks: the sandbox never imports them."""
    earlier = _earlier(chapter)
    for e in earlier + exercises(chapter):
        if _module(e).startswith(CHECKS + "."):
            raise GraderError(
                f"{e.id}: its reference is defined in {e.reference.__module__}, which the "
                "sandbox must not see: define it in the package (or qwen_mini/course/lab/)"
            )
    # what `reference(id)` and `mine(id)` give in the sandbox, which has no check to ask: every
    # other chapter's pieces of the package (a notebook may load a model built of later ones)
    others = [e for n in _package_chapters() if n != chapter for e in exercises(n)]
    others = [e for e in others if e.reference is not None and not from_checks(_module(e))]
    return {
        "exercises": [[e.id, _place(e.reference)] for e in exercises(chapter)],
        "earlier": [_place(e.reference) for e in earlier if isinstance(e.reference, type)],
        "pieces": [[e.id, _place(e.reference)] for e in others],
    }


def _earlier(chapter: str) -> list:
    """The exercises of the chapters before `chapter` ("ch05")."""
    if chapter[:2] != "ch" or not chapter[2:].isdigit():
        return []
    return [e for n in range(int(chapter[2:])) for e in exercises(f"ch{n:02d}")]


def _compiled(source: str, workdir: Path) -> str:
    """`source` compiled to a .pyc in `workdir` (by this interpreter, the worker's), which
    Python imports without the source: its code objects still name the source's path."""
    out = Path(tempfile.mkdtemp(prefix="sourceless-", dir=workdir)) / "module.pyc"
    mode = py_compile.PycInvalidationMode.UNCHECKED_HASH  # nothing beside it to compare with
    py_compile.compile(source, cfile=str(out), dfile=source, doraise=True, invalidation_mode=mode)
    return str(out)


def _package_chapters() -> list[str]:
    """The chapters whose checks the package holds ("ch00", ...)."""
    folder = Path(importlib.import_module(CHECKS).__file__).parent
    return sorted(p.stem for p in folder.glob("ch[0-9][0-9].py"))


def _module(e) -> str:
    return getattr(e.reference, "__module__", "") or ""


def _from_checks(module: str) -> bool:
    """Defined by a chapter's checks (or a test fixture's): a fake model or a callback that a
    check hands to the learner's code on purpose."""
    return from_checks(module)


def _exportable(obj) -> bool:
    """What the grader lets a worker hold a handle to: objects of the package's classes (a
    reference KV cache), torch modules (an embedding a check passes in), bound methods of the
    package's own non-module classes, and the functions and objects a check module defines to
    be called by the learner's code (which can call them with plain data only). Never modules,
    other plain functions or the grader itself."""
    if isinstance(obj, types.MethodType):
        return _method_allowed(obj)
    if isinstance(obj, types.FunctionType):
        return _from_checks(getattr(obj, "__module__", "") or "")
    module = getattr(type(obj), "__module__", "") or ""
    if isinstance(obj, torch.nn.Module):
        return not module.startswith("qwen_mini.course") or _from_checks(module)
    if _from_checks(module):
        return True
    return module.split(".")[0] == "qwen_mini" and not module.startswith("qwen_mini.course")


def _method_allowed(method: types.MethodType) -> bool:
    """A method the learner's code may call on an object of the grader's: one the package
    defines on a class that is not a module (`KVCache.update`), a module's `forward`, or a public
    method of a check module's own fake. Nothing that re-weights or hooks a module the grader
    computes expected values with."""
    owner, fn = method.__self__, method.__func__
    module = getattr(fn, "__module__", "") or ""
    if _from_checks(getattr(type(owner), "__module__", "") or ""):
        return _from_checks(module) and not fn.__name__.startswith("_")
    if isinstance(owner, torch.nn.Module):
        return fn.__name__ == "forward"
    return module.split(".")[0] == "qwen_mini" and not module.startswith("qwen_mini.course")


def _check_code(target) -> bool:
    """A callable a check module defines (a hook, a callback, a fake or a method of one): it
    may be given stand-ins for the learner's objects, as in the notebook; it is the check's own
    code, which only ever reaches them through requests (whose answers are plain data)."""
    if isinstance(target, types.MethodType):
        return _from_checks(getattr(target.__func__, "__module__", "") or "")
    if isinstance(target, types.FunctionType):
        return _from_checks(getattr(target, "__module__", "") or "")
    return _from_checks(getattr(type(target), "__module__", "") or "")


def _plain(value, depth: int = 0) -> bool:
    """No stand-in for the learner's objects inside (the grader never keeps the learner's
    callables: a hook registered with one would run learner code in the comparisons)."""
    if depth > 32 or type(value) is Remote:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return True


def _learner_exception(info) -> Exception:
    """The exception the learner's code raised, rebuilt here from its name and message."""
    if (
        type(info) is not dict
        or type(info.get("type")) is not str
        or type(info.get("msg")) is not str
    ):
        raise BadMessage("a malformed exception from the worker")
    name, text = info["type"][:100], info["msg"][:2000]
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
        e = cls(text)
    else:
        safe = name if name.isidentifier() else "Exception"
        e = type(safe, (Exception,), {"__module__": "learner"})(text)
    where = info.get("where")
    e.learner_line = where[:300] if type(where) is str else ""  # the line of the learner's cell
    return e


class Remote:
    """The grader's stand-in for an object that lives in the worker. Calling it, reading or
    setting its public attributes, indexing and iterating it are requests to the worker; its
    equality is identity and its repr is local, so none of the learner's code runs here."""

    __slots__ = ("_conn", "_h", "_type")

    def __init__(self, conn: Connection, h: int, type_name):
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "_type", str(type_name or "object")[:100])

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._conn.request({"op": "getattr", "h": self._h, "name": name})

    def __setattr__(self, name, value):
        self._conn.request({"op": "setattr", "h": self._h, "name": name, "value": value})

    def __call__(self, *args, **kwargs):
        return self._conn.request({"op": "call", "h": self._h, "args": args, "kwargs": kwargs})

    def __getitem__(self, key):
        return self._conn.request({"op": "getitem", "h": self._h, "key": key})

    def __setitem__(self, key, value):
        self._conn.request({"op": "setitem", "h": self._h, "key": key, "value": value})

    def __len__(self):
        n = self._conn.request({"op": "len", "h": self._h})
        if type(n) is not int or n < 0:
            raise TypeError("len() of your object is not a non-negative int")
        return n

    def __iter__(self):
        it = self._conn.request({"op": "iter", "h": self._h})
        if type(it) is not Remote:
            raise TypeError("iter() of your object returned plain data")
        return it

    def __next__(self):
        return self._conn.request({"op": "next", "h": self._h})

    def __repr__(self):
        return f"<your {self._type} object>"


class Connection:
    """One submission's worker: started on creation, ended by `close()`."""

    def __init__(self, cell: Jail, memory_mb: int, on_use, cpu_seconds: float = 600.0):
        self.jail, self.on_use = cell, on_use
        self.codec = Codec("p", lambda h, t: Remote(self, h, t), _exportable, self._copy_in)
        self.codec.pickle = self._by_value
        self.codec.is_remote = lambda obj: type(obj) is Remote
        self.copies: dict[str, str] = {}
        self.deadline = time.monotonic() + START_TIMEOUT
        self.request_id, self.depth = 0, 0
        self.rng: torch.Tensor | None = None  # torch's random state as the worker has it now
        self.cwd = tempfile.mkdtemp(prefix=SUBMISSION_PREFIX, dir=SYSTEM_TMP)
        self.output = tempfile.TemporaryFile(dir=cell.workdir)
        # the checks' own files (a safetensors file they write) go with this submission
        self.scratch = tempfile.mkdtemp(prefix="checks-", dir=cell.workdir)
        self.tempdir, tempfile.tempdir = tempfile.tempdir, self.scratch
        self.limits = jail.Limits(os.path.basename(self.cwd), memory_mb, cpu_seconds)
        self.sock, theirs = socket.socketpair()
        info, info_w = os.pipe()
        argv = [sys.executable, "-I", "-c", BOOT, str(theirs.fileno()), str(ROOT)]
        try:
            self.proc = subprocess.Popen(
                jail.command(argv, self.cwd, memory_mb, cell.files, info_w, cell.sourceless),
                pass_fds=[theirs.fileno(), info_w],
                stdin=subprocess.DEVNULL,
                stdout=self.output,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env=jail.environment(self.cwd),
                preexec_fn=self.limits.apply,
            )
        finally:
            theirs.close()
            os.close(info_w)
        self.closed, self.pid = False, None
        self.ended: dict = {}
        try:
            self._send({"spec": cell.spec, "memory_mb": memory_mb})
            ready = self._next_message()
            if ready.get("ready") is not True:
                self.close()
                raise GraderError(f"the worker could not start:\n{ready.get('error')}")
        except WorkerFault:
            self.close()
            raise
        finally:
            with os.fdopen(info, "rb") as f:  # bwrap wrote it before the worker started
                os.set_blocking(f.fileno(), False)
                self.pid = jail.jail_pid(f.read() or b"")

    def _by_value(self, obj):
        """A module or an object of the package or of a check: a copy for the worker (see
        byvalue.py), or None where it cannot be pickled (it then crosses as a handle)."""
        if not byvalue.by_value(obj):
            return None
        module = getattr(type(obj), "__module__", "") or ""
        if module.startswith(CHECKS + "."):
            raise TypeError(
                f"a check hands a {type(obj).__name__} of {module} to the learner's code: the "
                "sandbox sees no check module, so define its class in qwen_mini/course/fakes/"
            )
        try:
            return {"t": "val", "v": byvalue.dumps(obj, self.codec, self.codec.is_remote)}
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
            return None

    def _copy_in(self, path: str) -> str:
        """A check passes a file of its own (a safetensors file it wrote): the worker, another
        user, gets a copy in its folder (read-only for it), under the same file name."""
        if path not in self.copies:
            folder = os.path.join(self.cwd, "inputs", str(len(self.copies)))
            os.makedirs(folder, mode=0o755)
            copy = os.path.join(folder, os.path.basename(path))
            if os.path.isfile(path):
                shutil.copyfile(path, copy)
                os.chmod(copy, 0o644)
            self.copies[path] = copy
        return self.copies[path]

    # channel

    def _next_message(self) -> dict:
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeout("deadline")
            try:  # (the clock may run faster than the wall: look again soon)
                ready = select.select([self.sock], [], [], min(left, 0.25))[0]
            except (OSError, ValueError):
                raise WorkerGone("the channel broke") from None
            if not ready:
                continue
            self.sock.settimeout(max(0.01, self.deadline - time.monotonic()))
            try:
                return protocol.receive(self.sock)
            except TimeoutError:
                raise WorkerTimeout("deadline") from None
            except (EOFError, OSError):
                raise WorkerGone("the worker closed its channel") from None
            except ProtocolError as e:
                raise BadMessage(str(e)) from None

    def _send(self, message: dict) -> None:
        self.sock.settimeout(max(0.01, self.deadline - time.monotonic()))
        try:
            protocol.send(self.sock, message)
        except TimeoutError:
            raise WorkerTimeout("deadline") from None
        except OSError:
            raise WorkerGone("the worker closed its channel") from None

    def request(self, message: dict):
        """Send a request; serve the worker's requests until its answer; the decoded answer
        (or the learner's exception, raised here)."""
        if self.closed:
            raise WorkerGone("the worker has ended")
        self.request_id += 1
        rid = self.request_id
        out = dict(message, id=rid, grad=torch.is_grad_enabled())
        for key in ("args", "kwargs", "value", "key"):
            if key in out:
                out[key] = self.codec.encode(out[key])
        sync = []
        for key, (h, tensor, version) in self.codec.mirrors.items():
            if tensor._version != version:  # changed here in place: change the worker's too
                sync.append([h, self.codec.encode(tensor)])
                self.codec.mirrors[key] = (h, tensor, tensor._version)
        if sync:
            out["sync"] = sync
        if message["op"] in byvalue.STATE_OPS:  # the learner's code draws from the check's
            # random stream (sent when it moved here since the worker last had it)
            state = torch.get_rng_state()
            if self.rng is None or not torch.equal(state, self.rng):
                out["rng"] = protocol.rng_text(state)
                self.rng = state
        self._send(out)
        while True:
            reply = self._next_message()
            if "op" in reply:
                self._serve(reply)
                continue
            if reply.get("id") != rid:
                raise BadMessage("an answer to a question not asked")
            try:
                if message["op"] in byvalue.STATE_OPS:
                    # what the learner's code did to the objects the check passed in
                    if "args" in reply:
                        byvalue.apply_arguments(self.codec, reply["args"], self.codec.decode)
                    if "state" in reply:
                        byvalue.apply_state(self.codec, reply["state"], self.codec.decode)
                if "rng" in reply:  # where the learner's code left the random stream
                    self.rng = protocol.rng_state(reply["rng"])
                    torch.set_rng_state(self.rng)
                if "raise" in reply:
                    raised = _learner_exception(reply["raise"])
                elif "re" not in reply:
                    raise BadMessage("an answer without a value")
                else:
                    return self.codec.decode(reply["re"])
            except (ProtocolError, ValueError) as e:  # a malformed answer, not a learner's error
                raise BadMessage(str(e)) from None
            raise raised  # outside the try: a learner's ValueError is theirs, not the channel's

    def _serve(self, m: dict) -> None:
        """A request of the worker: the learner's code uses an object of the grader's, or
        asks (`use(...)`) whether its piece passes."""
        if self.depth >= MAX_NESTING:
            raise BadMessage("requests nested too deeply")
        self.depth += 1
        try:
            result = {"re": self.codec.encode(self._do(m))}
        except WorkerFault:
            raise
        except ProtocolError as e:
            raise BadMessage(str(e)) from None
        except Exception as e:  # a KeyError as its key: the worker's KeyError(key) reads as e
            key = isinstance(e, KeyError) and len(e.args) == 1 and type(e.args[0]) is str
            text = e.args[0] if key else str(e)
            result = {"raise": {"type": type(e).__name__, "msg": text[:2000]}}
        finally:
            self.depth -= 1
        self._send(dict(result, id=m.get("id")))

    def _do(self, m: dict):
        op, decode = m.get("op"), self.codec.decode
        if op == "use":
            exercise, obj = m.get("ex"), decode(m.get("obj"))
            if type(exercise) is not str:
                raise ProtocolError("use() without an exercise id")
            return bool(self.on_use(exercise, obj))
        name = m.get("name")
        if op in ("getattr", "setattr") and (type(name) is not str or name.startswith("_")):
            raise AttributeError(f"{name!r} is not a public attribute")
        target = self.codec.lookup(m.get("h"))
        if op == "getattr":
            value = getattr(target, name)
            if isinstance(value, types.MethodType) and not _method_allowed(value):
                raise AttributeError(f"your code may not call {name}() on the grader's objects")
            return value
        if op == "setattr":
            value = decode(m.get("value"))
            current = getattr(target, name, None)
            if isinstance(target, torch.nn.Module) or type(current) not in (int, float, bool):
                raise AttributeError(f"your code may not set {name} on the grader's objects")
            if not _plain(value) or type(value) not in (int, float, bool):
                raise TypeError(f"{name} must be set to a number")
            return setattr(target, name, value)
        if op == "call":
            args, kwargs = decode(m.get("args")), decode(m.get("kwargs"))
            if type(args) is not tuple or type(kwargs) is not dict:
                raise ProtocolError("a call without arguments")
            if not all(type(k) is str for k in kwargs):
                raise ProtocolError("keyword names must be strings")
            if not _check_code(target) and (not _plain(args) or not _plain(kwargs)):
                raise TypeError("only plain data (tensors, numbers, lists) can go to the grader")
            if isinstance(target, types.MethodType) and not _method_allowed(target):
                raise TypeError("your code may not call this method of the grader's objects")
            return target(*args, **kwargs)
        raise ProtocolError(f"unknown operation {op!r}")

    # ending

    def close(self) -> dict:
        """End the jail and everything in it; how the worker ended, and its output."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()
            self.ended = self._end()
            self.limits.remove()
            shutil.rmtree(self.cwd, ignore_errors=True)
            shutil.rmtree(self.scratch, ignore_errors=True)
            tempfile.tempdir = self.tempdir
            self.output.seek(0)
            self.ended["output"] = self.output.read(PROCESS_OUTPUT_CAP)
            self.ended["output_bytes"] = os.fstat(self.output.fileno()).st_size
            self.output.close()
        return self.ended

    def _end(self) -> dict:
        """{"exit": the worker's exit code (negative: a signal), "stopped": bool}. A worker that
        sees its channel closed ends by itself; one that does not is killed, and with the jail's
        first process the kernel kills every process of its pid namespace."""
        stopped = jail.stopped(self.pid)
        try:
            code = self.proc.wait(timeout=0 if stopped else 1)
        except subprocess.TimeoutExpired:
            code = None
            if self.pid is None:  # (--die-with-parent: its first process follows)
                self.proc.kill()
            with contextlib.suppress(OSError):
                os.kill(self.pid or self.proc.pid, signal.SIGKILL)
            self.proc.wait()  # bwrap ends once the kernel has ended its pid namespace
        if code is not None and code > 128:  # bwrap's code for a worker killed by a signal
            code = 128 - code
        return {"exit": code, "stopped": stopped}
