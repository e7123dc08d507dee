"""Inside the sandbox: what each exercise's reference is made of, and a watch on which code runs
while the grader checks an exercise, so that an answer that is the reference (called, wrapped,
subclassed, copied, compiled again with other flags or from its AST, run in a thread) is caught;
and what "tampering" compares.

Everything here is computed in the worker, before any learner code runs, and kept by it.
It runs in the learner's process, so it is a tripwire, not a wall: the comparisons that decide
points never run here (they run in the grader, see `session.py`).
"""

from __future__ import annotations

import ast
import builtins
import dis
import hashlib
import inspect
import os
import sys
import sysconfig
import textwrap
import types

import torch

# bound at import, before learner code: replacing `sys.setprofile` does not turn the watch off
_setprofile = sys.setprofile
_FUTURE_ANNOTATIONS = 0x1000000  # __future__.annotations.compiler_flag
MIN_RECOMPILED_BYTES = 32  # bytecode of a recompiled variant that identifies its source
# instructions a reference's function needs for its copies with other tables (its instructions
# alone) to be recognised: a shorter one (`pass`, `self.length = n`) is like a thousand others
DISTINCT = 8

BLOCKED_WHILE_CHECKED = (
    "sys.setprofile",
    "sys.settrace",
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.exec",
    "os.spawn",
    "os.system",
    "subprocess.Popen",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.cdata",
    "ctypes.addressof",
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
    "sys._current_frames",
)


_INDUCTOR = os.path.join(os.path.dirname(torch.__file__), "_inductor", "")
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _compiler_at_work(event: str) -> bool:
    """torch.compile's compiler (inductor) runs the C++ compiler and loads what it built, and
    the first call of a compiled helper may come inside a check: allowed when the code asking,
    past the standard library's subprocess and ctypes, is one of inductor's modules."""
    if event not in ("subprocess.Popen", "ctypes.dlopen"):
        return False
    frame = sys._getframe(2)
    while frame is not None:
        name, module = frame.f_code.co_filename, frame.f_globals.get("__name__", "")
        if name.startswith(_INDUCTOR) and module.startswith("torch._inductor."):
            return getattr(sys.modules.get(module), "__dict__", None) is frame.f_globals
        if not name.startswith(_STDLIB) or "-packages" in name:
            return False
        frame = frame.f_back
    return False


# --- what the references are made of (computed before any learner code) ---------------------


def _codes(obj, seen=None, earlier=()) -> list[types.CodeType]:
    """Every code object a function or class (and the functions nested in them) runs. A class's
    bases that are `earlier` pieces (other exercises' references) are theirs, not its own: a
    variant written as a subclass of an earlier exercise may call it."""
    seen = set() if seen is None else seen
    out = []
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    if isinstance(obj, types.CodeType):
        out.append(obj)
        for c in obj.co_consts:
            if isinstance(c, types.CodeType):
                out += _codes(c, seen)
    elif isinstance(obj, (staticmethod, classmethod)):
        out += _codes(obj.__func__, seen)
    elif isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                out += _codes(f, seen)
    elif isinstance(obj, type):
        for klass in obj.__mro__:
            if klass is not obj and klass in earlier:
                continue
            if getattr(klass, "__module__", "").split(".")[0] not in ("builtins", "torch"):
                for value in vars(klass).values():
                    out += _codes(value, seen)
    elif hasattr(obj, "__code__") and isinstance(obj.__code__, types.CodeType):
        out += _codes(obj.__code__, seen)
    return out


_SKIPPED = {
    dis.opmap[name] for name in ("NOP", "EXTENDED_ARG", "CACHE") if name in dis.opmap
}  # no CACHE in 3.10
_LOCAL = set(dis.haslocal) | set(dis.hasfree)


def fingerprint(code: types.CodeType) -> str:
    """What a code object does, without where it was compiled or how its tables are laid out: a
    copy of the reference's source compiled again (exec, a module written to disk) and a copy of
    its code object with constants, names or local names added, renamed or reordered, no-ops
    inserted or its line table changed (`code.replace`) have the same fingerprint: a digest of
    its instructions (see `_instructions`), the same in every process (the grader computes
    those of the references' sources, which the worker's jail does not show)."""
    return _digest(code, ("instructions", _instructions(code)))


def exact(code: types.CodeType) -> str:
    """A digest of a code object's bytecode and tables as they are: for a function too short to
    be recognised by its instructions alone (see DISTINCT)."""
    consts = [exact(c) if isinstance(c, types.CodeType) else _constant(c) for c in code.co_consts]
    return _digest(code, ("exact", code.co_code, code.co_names, code.co_varnames, tuple(consts)))


def size(code: types.CodeType) -> int:
    """How many instructions `_instructions` keeps, counted in the bytecode without
    disassembling it (a hundred times faster). Both digests begin with it, so the watcher
    disassembles only a code object as long as one of the reference's: a check whose code
    imports a module (torch._dynamo, sympy) calls thousands of new code objects."""
    ops = code.co_code[::2]  # (opcode, argument) pairs; CACHE entries are opcode 0
    return len(ops) - sum(ops.count(op) for op in _SKIPPED)


def _qualname(code: types.CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11 and later


def _digest(code: types.CodeType, value) -> str:
    return f"{size(code)}:{hashlib.blake2b(repr(value).encode(), digest_size=16).hexdigest()}"


def prints(code: types.CodeType) -> tuple[str, ...]:
    """The fingerprints a reference's code object is recognised by (both, where it is long
    enough)."""
    if size(code) < DISTINCT:
        return (exact(code),)
    return (exact(code), fingerprint(code))


def _instructions(code: types.CodeType) -> tuple:
    """Each instruction with the constant or name it uses: a local by the order it first
    appears, a jump by the instruction it goes to; no no-ops."""
    kept = [i for i in dis.get_instructions(code) if i.opcode not in _SKIPPED]
    index = {i.offset: n for n, i in enumerate(kept)}
    local: dict = {}
    out = []
    for i in kept:
        if i.opcode in _LOCAL:
            arg = local.setdefault((i.opcode in dis.hasfree, i.argval), len(local))
        elif i.opcode in dis.hasjrel or i.opcode in dis.hasjabs:
            arg = index.get(i.argval, -1)
        elif i.opcode in dis.hasconst:
            arg = _constant(i.argval)
        elif i.opcode in dis.hasname:
            arg = i.argval
        else:
            arg = i.arg
        out.append((i.opname, arg))
    return tuple(out)


def _constant(c) -> tuple | str:
    if isinstance(c, types.CodeType):
        return fingerprint(c)
    if isinstance(c, frozenset):  # in an order of its own in every process
        return ("frozenset", tuple(sorted(repr(x) for x in c)))
    return (type(c).__name__, repr(c))


def _sources(obj, earlier=()) -> list[str]:
    """The source of a reference and of the package classes it inherits from (not `earlier`)."""
    parts = [obj]
    if isinstance(obj, type):
        parts = [k for k in obj.__mro__ if k is obj or k not in earlier]
        parts = [k for k in parts if getattr(k, "__module__", "").split(".")[0] == "qwen_mini"]
    out = []
    for part in parts:
        try:
            out.append(textwrap.dedent(inspect.getsource(part)))
        except (OSError, TypeError):
            pass
    return out


def recompiled(obj, earlier=()) -> set:
    """The fingerprints of a reference's source compiled again in every way a submission can
    compile it: with or without `from __future__ import annotations`, with `optimize` 0, 1 or
    2 (no asserts, no docstrings), from source or from its AST parsed and unparsed again."""
    out, seen = set(), set()
    for source in _sources(obj, earlier):
        try:
            tree = ast.parse(source)
            texts = {source, ast.unparse(tree)}
        except (SyntaxError, ValueError, RecursionError):
            continue
        for text in texts:
            for flags in (0, _FUTURE_ANNOTATIONS):
                for optimize in (0, 1, 2):
                    try:
                        code = compile(text, "<copy>", "exec", flags, True, optimize)
                    except (SyntaxError, ValueError):
                        continue
                    for c in _codes(code):  # most variants compile to the same code
                        if _distinctive(c) and (digest := exact(c)) not in seen:
                            seen.add(digest)
                            out.update(prints(c))
    return out


def _distinctive(code: types.CodeType) -> bool:
    """Long enough not to be a copy of anything else: a method whose docstring is stripped may be
    `pass` or `return self.x`, like many functions of the standard library and of torch. A
    comprehension, generator expression or lambda (`sum(s[0] for s in stats)`) is as common in
    torch and in a learner's own helpers; a copy of the function around it is what gives it away."""
    return len(code.co_code) >= MIN_RECOMPILED_BYTES and not code.co_name.startswith("<")


def all_recompiled(exercises, earlier=()) -> dict[str, list[str]]:
    """{exercise id: the fingerprints of its reference's source compiled again}, as Snapshot
    computes them where the source can be read."""
    earlier = set(earlier) | {e.reference for e in exercises if isinstance(e.reference, type)}
    return {
        e.id: sorted(recompiled(e.reference, earlier - {e.reference}))
        for e in exercises
        if e.reference is not None
    }


class Snapshot:
    """Per exercise: the reference object, the ids of its code objects and their fingerprints;
    the ids of every code object of the package; what the checked namespaces hold."""

    def __init__(self, exercises, earlier=(), recompiled_given=None):
        """`earlier`: the reference classes of earlier chapters' exercises, which a variant may
        subclass (their code is theirs, not the variant's). `recompiled_given`: {exercise id:
        fingerprints of its source compiled again} (see `all_recompiled`), where the source is
        not here to read (the worker's jail)."""
        self.references = {e.id: e.reference for e in exercises}
        # a class of this chapter may subclass another exercise's (SharedExpertMoeBlock of
        # SparseMoeBlock): that base is the other exercise's code, whoever's it is
        earlier = set(earlier) | {e.reference for e in exercises if isinstance(e.reference, type)}
        self.code_ids, self.fingerprints, self.sizes = {}, {}, {}
        self.keep = []  # code objects stay alive, so their ids stay theirs
        if recompiled_given is None:
            recompiled_given = all_recompiled(exercises, earlier)
        for e in exercises:
            codes = _codes(e.reference, earlier=set(earlier) - {e.reference})
            self.keep += codes
            self.code_ids[e.id] = {id(c) for c in codes}
            # its own code objects, however short (a copy with another name is still a copy),
            # but no comprehension, generator expression or lambda on its own (see _distinctive)
            own = {p for c in codes if not c.co_name.startswith("<") for p in prints(c)}
            self.fingerprints[e.id] = own | set(recompiled_given.get(e.id, ()))
            # the instruction counts they begin with (see `size`)
            self.sizes[e.id] = {int(p.partition(":")[0]) for p in self.fingerprints[e.id]}
        self.package_ids = set()
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] == "qwen_mini" and module is not None:
                for value in list(vars(module).values()):
                    codes = _codes(value)
                    self.keep += codes
                    self.package_ids.update(id(c) for c in codes)
        self.names = namespaces()


def namespaces() -> dict[str, int]:
    """Public names of torch, torch.nn.functional, Tensor, Module, the builtins and the package's
    model modules, each with the id of what it refers to."""
    import torch.nn.functional as F

    spaces = dict(torch=torch, F=F, Tensor=torch.Tensor, Module=torch.nn.Module, builtins=builtins)
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "qwen_mini" and not name.startswith("qwen_mini.course"):
            spaces[name] = module
    names = {
        f"{where}.{k}": id(v)
        for where, m in spaces.items()
        for k, v in list(vars(m).items())
        if not k.startswith("_") and not isinstance(v, types.ModuleType)
    }
    if _wraps_the_seed(torch.manual_seed):
        names["torch.manual_seed"] = id(_SEED)
    return names


# torch.compile's compiler, imported when a notebook first compiles, puts torch.manual_seed in a
# wrapper of its own (torch._dynamo's import); that wrapper, of the function there was before any
# learner code ran, is the same torch.manual_seed
_SEED = torch.manual_seed
_WRAPPER = torch._disable_dynamo(_SEED)  # one made now, for the wrapper's code and globals


def _wraps_the_seed(value) -> bool:
    if not isinstance(value, types.FunctionType) or value is _SEED:
        return False
    if value.__code__ is not _WRAPPER.__code__ or value.__globals__ is not _WRAPPER.__globals__:
        return False
    cells = dict(zip(value.__code__.co_freevars, value.__closure__ or (), strict=False))
    try:
        return cells["fn"].cell_contents is _SEED and cells["recursive"].cell_contents is True
    except (KeyError, ValueError):
        return False


def changed(before: dict[str, int]) -> str:
    now = namespaces()
    for name, value in before.items():
        if now.get(name) != value:
            return name
    return ""


class Monitor:
    """While the grader checks an exercise, notes whether the reference's code runs: called
    directly, wrapped, subclassed, through functools.partial, or as a copy compiled again."""

    def __init__(self, snapshot: Snapshot):
        self.snap = snapshot
        self.cell_code_ids: set[int] = set()
        self.cell_codes: list = []
        self.memo: dict[int, list] = {}  # id -> [code, size, (exact, fingerprint) or None]
        self.exercise = None
        self.hit = ""

    def add_cell(self, code: types.CodeType) -> None:
        for c in _codes(code):
            self.cell_codes.append(c)
            self.cell_code_ids.add(id(c))

    def profile(self, frame, event, arg):
        if event != "call" or self.exercise is None or self.hit:
            return
        code = frame.f_code
        cid = id(code)
        if cid in self.cell_code_ids:
            return
        ids = self.snap.code_ids[self.exercise]
        if cid in ids:
            self.hit = _qualname(code)
            return
        if cid in self.snap.package_ids:
            return  # an earlier piece of the package: allowed
        entry = self.memo.get(cid)
        if entry is None or entry[0] is not code:
            entry = self.memo[cid] = [code, size(code), None]
        if entry[1] not in self.snap.sizes[self.exercise]:
            return
        if entry[2] is None:
            entry[2] = (exact(code), fingerprint(code))
        if not self.snap.fingerprints[self.exercise].isdisjoint(entry[2]):
            self.hit = f"a copy of {_qualname(code)}"

    def audit(self, event: str, args) -> None:
        if event in ("sys.setprofile", "sys.settrace"):  # never, or a thread could unwatch itself
            caller = sys._getframe(1).f_code  # (only this monitor may change the profiler)
            if caller not in (
                Monitor.start.__code__,
                Monitor.stop.__code__,
                Monitor.enter_thread.__code__,
            ):
                raise RuntimeError(f"{event} is not available while a notebook is graded")
            return
        if self.exercise is None or event == "sys._getframe":
            return
        if event.startswith(BLOCKED_WHILE_CHECKED) and not _compiler_at_work(event):
            raise RuntimeError(f"{event} is not allowed while an exercise is being checked")

    def enter_thread(self) -> None:
        """First thing in every thread the submission starts: threads are watched too."""
        _setprofile(self.profile)

    def watch_threads(self) -> None:
        import _thread
        import threading

        start = _thread.start_new_thread

        def start_new_thread(function, args, kwargs=None):
            def run(*a, **k):
                self.enter_thread()
                return function(*a, **k)

            return start(run, args, kwargs or {})

        _thread.start_new_thread = threading._start_new_thread = start_new_thread

    def start(self, exercise: str) -> None:
        self.exercise, self.hit = exercise, ""
        _setprofile(self.profile)

    def stop(self) -> str:
        _setprofile(None)
        self.exercise = None
        return self.hit
