"""Exercise checks: instant feedback in the notebooks, and the same checks for grading.

In a chapter notebook::

    from qwen_mini.course import check, use

    check("ch01.repeat_kv", repeat_kv)            # tests *this* object, prints one line
    Attention = use("ch01.Attention", Attention)  # yours if it passes, else the package's

A chapter's checks live in `qwen_mini/course/checks/chNN.py`, imported the first time one of its
exercise ids is used. An exercise is data: its cases and a catalogue of its typical mistakes::

    register("ch01.repeat_kv", reference=attention.repeat_kv, points=1, title="...")

    case("ch01.repeat_kv", "two copies of each head", lambda g: (randn(1, 2, 3, 8, g=g), 2))
    case("ch01.repeat_kv", "other sizes", lambda g: (randn(2, 3, 5, 4, g=g), 3), hidden=True)

    @mistake("ch01.repeat_kv", "the copies are tiled (h0 h1 h0 h1): repeat each head in place")
    def _(x, n):
        return x.repeat(1, n, 1, 1)

A case draws its inputs from a generator (public cases: a fixed seed, so the learner sees the same
message every run; hidden ones: seeded with a secret, see `new_secret`),
calls the implementation on fresh copies of them (`call`, by default `impl(*inputs)`: a small
function may build a module, fill a model, run a cache and return what to compare), and compares
the result with the reference's, or with a hand-derived `expected(*inputs)`, through
`expect_close`. When they differ, each catalogued mistake runs on the same inputs: a mistake whose
result is the learner's, here and on the exercise's other cases (a crash of the same kind counts),
names its idea; an answer no mistake reproduces, or two ideas both do, gets what differs (which
value, where, what dtype or shape) instead of a guess. A case may return a dict of named stages
(`{"after attention": ..., "output": ...}`): the first stage that differs is the one reported.

`QWEN_MINI_CHECKS` sets what a check does besides printing: `learner` (default) never raises,
so Run All keeps going; `solutions` raises unless the exercise passes (CI on solutions/);
`course` raises unless it is "not implemented yet" (CI on course/: a learner copy that passes
has leaked its solution, or its checks cannot fail).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import importlib.util
import math
import os
import re
import secrets
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import observing

MODES = ("learner", "solutions", "course")
# Extra folders holding `chNN.py` check modules (course extensions, the test suite's fixtures).
PATH_ENV = "QWEN_MINI_EXERCISES_PATH"
CHECKS = "qwen_mini.course.checks"  # the package of the chapters' check modules
# what checks hand to the learner's code (spies, fake models): importable where the checks are not
FAKES = "qwen_mini.course.fakes"


def from_checks(module: str) -> bool:
    """Code of a chapter's checks: a check module, a test fixture's, or what checks hand to the
    learner's code (`FAKES`)."""
    return isinstance(module, str) and module.startswith(
        (CHECKS + ".", FAKES + ".", "qwen_mini_extra_exercises.")
    )


class UnknownExercise(KeyError):
    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


class CheckError(AssertionError):
    """Raised by `check` in the `solutions` and `course` modes."""


@dataclass
class Exercise:
    id: str
    reference: object = None
    points: float = 1
    title: str = ""
    public: list[tuple[str, Callable]] = field(default_factory=list)
    hidden: list[tuple[str, Callable]] = field(default_factory=list)
    mistakes: dict[str, Mistake] = field(default_factory=dict)
    registered: bool = False
    variant_labels: set[str] = field(default_factory=set)  # checks run after the plain ones
    cases: list[Case] = field(default_factory=list)  # the checks declared with `case`


@dataclass(frozen=True)
class Mistake:
    """A typical wrong answer: a function (or class) with the exercise's signature, and the idea
    it gets wrong, which is the message a learner sees when their answer matches it."""

    exercise_id: str
    name: str
    fn: Callable
    idea: str
    public: bool = True  # False: a mistake the chapter does not warn about, caught when grading


@dataclass(frozen=True)
class Case:
    exercise_id: str
    name: str
    inputs: Callable  # (generator) -> tuple of the arguments
    call: Callable  # (implementation, *arguments) -> what is compared
    expected: Callable | None  # (*arguments) -> the value; None: the reference's result
    atol: float
    rtol: float
    seed: int
    hidden: bool


@dataclass
class Result:
    exercise_id: str
    status: str  # "passed", "failed", "not-implemented" (or "unknown" exercise id)
    passed: int  # checks passed before the first failure
    total: int
    message: str = ""  # the first failure
    kind: str = "public"  # "public", or "all" when hidden checks ran too
    exception: BaseException | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.status == "passed"

    def __bool__(self) -> bool:
        return self.ok

    def _ipython_display_(self):
        pass  # check() has printed its line; a notebook should not echo the object as well

    def line(self) -> str:
        if self.status == "passed":
            return f"✓ {self.exercise_id}: passed {self.passed}/{self.total} {self.kind} checks"
        if self.status == "not-implemented":
            return f"○ {self.exercise_id}: not implemented yet"
        return f"✗ {self.exercise_id}: {self.message}"


_EXERCISES: dict[str, Exercise] = {}
_LOADED: set[str] = set()


# --- registration (used by the chapter modules) --------------------------------------------------


def _entry(exercise_id: str) -> Exercise:
    if exercise_id not in _EXERCISES:
        _EXERCISES[exercise_id] = Exercise(exercise_id)
    return _EXERCISES[exercise_id]


def register(exercise_id: str, reference=None, points: float = 1, title: str = "") -> None:
    """Declare an exercise, the package object it reimplements and what it is worth; its cases
    and mistakes follow (a chapter module imported again declares them afresh)."""
    _EXERCISES[exercise_id] = Exercise(exercise_id, reference, points, title, registered=True)


def add_check(
    exercise_id: str, hidden: bool, label: str, fn: Callable, variant=False, first=False
) -> None:
    """Add the check `fn(obj)` named `label`; a variant's goes after the plain ones, or before
    them all with `first`."""
    entry = _entry(exercise_id)
    if label in {name for name, _ in entry.public + entry.hidden}:
        raise ValueError(f"{exercise_id}: two checks named {label!r} (a message must say which)")
    checks = entry.hidden if hidden else entry.public
    if first:  # a variant that every case needs to hold (registration): before them all
        checks.insert(0, (label, fn))
        return
    if variant:
        entry.variant_labels.add(label)
        checks.append((label, fn))
        return
    # a plain check goes before the variants (variants.py): a wrong answer hears about its
    # values first, then about the dtypes, devices and uses the models put it to
    at = next((i for i, (n, _) in enumerate(checks) if n in entry.variant_labels), len(checks))
    checks.insert(at, (label, fn))


def _check_function(exercise_id: str, which: str, name: str | None):
    def decorator(fn: Callable) -> Callable:
        checks = getattr(_entry(exercise_id), which)
        label = name or _docline(fn) or f"{which} check {len(checks) + 1}"
        add_check(exercise_id, which == "hidden", label, lambda obj: fn(obj))
        return fn

    return decorator


def _docline(fn: Callable) -> str:
    return (fn.__doc__ or "").strip().split("\n")[0]


def public(exercise_id: str, name: str | None = None):
    """Decorate `def _(obj): ...`: a check the learner runs; it raises AssertionError to fail.
    For a check that is not a case (the chapters write cases; the test fixtures use these)."""
    return _check_function(exercise_id, "public", name)


def hidden(exercise_id: str, name: str | None = None):
    """Like `public`, but only run when grading."""
    return _check_function(exercise_id, "hidden", name)


def case(
    exercise_id: str,
    name: str,
    inputs: Callable,
    call: Callable | None = None,
    expected: Callable | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    seed: int = 0,
    hidden: bool = False,
) -> Case:
    """Declare a case: `inputs(generator)` gives the arguments, `call(impl, *arguments)` what is
    compared (default `impl(*arguments)`) with the reference's, or with `expected(*arguments)`.
    (`qwen_mini.course.variants.case` also runs it again as the models run it.)"""
    c = Case(exercise_id, name, inputs, call or _plain_call, expected, atol, rtol, seed, hidden)
    add_check(exercise_id, hidden, name, lambda obj: _run_case(c, obj))
    _entry(exercise_id).cases.append(c)
    return c


def _plain_call(impl, *arguments):
    return impl(*arguments)


def mistake(exercise_id: str, idea: str, name: str | None = None, public: bool = True):
    """Decorate a wrong implementation with the exercise's signature: the idea it gets wrong."""

    def decorator(fn: Callable) -> Callable:
        key = name or fn.__name__
        mistakes = _entry(exercise_id).mistakes
        if key in mistakes:
            raise ValueError(f"{exercise_id}: two mistakes named {key!r}")
        mistakes[key] = Mistake(exercise_id, key, fn, idea, public)
        return fn

    return decorator


def catalogue(chapter: str) -> list[Mistake]:
    """Every catalogued mistake of a chapter ("ch02"), exercise by exercise."""
    return [m for e in exercises(chapter) for m in e.mistakes.values()]


# --- running a case ------------------------------------------------------------------------------

_SECRET = secrets.randbits(64)  # seeds the hidden cases' inputs; never printed


def new_secret(value: int | None = None) -> None:
    """Set the secret for the hidden cases' inputs: `value` (the course secret a grading run
    reads, so that a notebook graded again gets the same inputs), or a new random one."""
    global _SECRET
    _SECRET = secrets.randbits(64) if value is None else value


def _seed(c: Case) -> int:
    if not c.hidden:
        return c.seed
    text = f"{_SECRET}:{c.exercise_id}:{c.name}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


def _inputs(c: Case, seed: int) -> tuple:
    # a copy: inputs built from a module's constants must not carry what a call did to them
    return copy.deepcopy(c.inputs(torch.Generator().manual_seed(seed)))


def _result(c: Case, impl, seed: int, changed: list | None = None, ours: bool = False):
    """`impl` run on a fresh copy of the case's inputs, the global RNG seeded alike for every
    implementation; the positions of the inputs it changed are added to `changed`. `ours`: the
    reference or a catalogued mistake, whose runs are observed here (when graded, the learner's
    code is observed in the sandbox, where it runs)."""
    with torch.random.fork_rng(devices=[]), observing.here() if ours else contextlib.nullcontext():
        torch.manual_seed(seed)
        arguments = _inputs(c, seed)
        out = c.call(impl, *arguments)
    if changed is not None:
        fresh = _inputs(c, seed)
        changed += [
            i for i, (a, b) in enumerate(zip(arguments, fresh, strict=True)) if not _unchanged(a, b)
        ]
    return out


def _unchanged(a, b) -> bool:
    """Whether an input is as it was made: tensors value for value (NaN where NaN was),
    containers item for item, a module's parameters and buffers; other objects are not
    compared."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        equal = a == b
        return bool((equal | (a.isnan() & b.isnan()) if a.is_floating_point() else equal).all())
    if isinstance(a, nn.Module) and isinstance(b, nn.Module):
        return _unchanged(a.state_dict(), b.state_dict())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_unchanged(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_unchanged(x, y) for x, y in zip(a, b, strict=True))
    return True


def _changed_inputs(c: Case, entry: Exercise, got, seed: int, changed: list[int], obj) -> None:
    """Fail when the learner's code changed an input that the reference leaves as it was
    (named by a catalogued mistake that does the same, if one matches)."""
    if not changed:
        return
    by_reference: list[int] = []
    _result(c, entry.reference, seed, by_reference, ours=True)
    wrong = [i for i in changed if i not in by_reference]
    if wrong:
        i = wrong[0]
        idea = _matching_mistake(c, entry, got, seed, obj, changes=i)
        raise AssertionError(
            idea
            or (
                f"your code changed its input in place (argument {i + 1} of this case, "
                f"{type(_inputs(c, seed)[i]).__name__}): the caller's value must stay as it was; "
                "compute into a new one (x = x * s, not x *= s; a copy of a dict before deleting "
                "from it)"
            )
        )


def _run_case(c: Case, obj) -> None:
    seed = _seed(c)
    entry = get(c.exercise_id)
    changed: list[int] = []
    try:
        got = _result(c, obj, seed, changed)
    except (NotImplementedError, AssertionError, MemoryError):
        raise
    except Exception as e:  # named by a catalogued mistake that crashes alike, if one does
        idea = _matching_mistake(c, entry, Raised(e), seed, obj)
        if idea is not None:
            e.idea = idea  # run_checks (and the grader) add it to "your code raised ..."
        raise
    _changed_inputs(c, entry, got, seed, changed, obj)
    want = (
        _result(c, entry.reference, seed, ours=True)
        if c.expected is None
        else c.expected(*_inputs(c, seed))
    )
    root = entry.id.split(".", 1)[1] if c.call is _plain_call else ""
    try:
        expect_close(root, got, want, c.atol, c.rtol)
    except AssertionError:
        idea = _matching_mistake(c, entry, got, seed, obj)
        if idea is None:
            raise
        raise AssertionError(idea) from None


@dataclass(frozen=True)
class Raised:
    """What a call raised, in place of its result: two calls agree when both raised the same
    type of exception."""

    error: BaseException


def _outcome(c: Case, impl, ours: bool, changed: list | None = None):
    """`impl`'s result on case `c` (its own seed), or Raised when it raised."""
    try:
        return _result(c, impl, _seed(c), changed, ours)
    except MemoryError:
        raise
    except Exception as e:
        return Raised(e)


def _agree(got, other, c: Case) -> bool:
    """Whether two outcomes of case `c` are the same answer."""
    if isinstance(got, Raised) or isinstance(other, Raised):
        return (
            isinstance(got, Raised)
            and isinstance(other, Raised)
            # by name: the grader rebuilds what the learner's code raised in a class of its own
            and type(got.error).__name__ == type(other.error).__name__
        )
    try:
        expect_close("", got, other, c.atol, c.rtol)
    except Exception:
        return False
    return True


def _matching_mistake(c: Case, entry: Exercise, got, seed: int, obj, changes=None) -> str | None:
    """The idea of the catalogued mistake that really is the learner's answer: its result on
    this case is the learner's (and, given `changes`, it changes that input too), and on every
    other case of the exercise that runs with this one (the public ones; the hidden ones too when
    this one is hidden) its result is the learner's as well. An answer that only happens to agree
    with a mistake on this case, or that two mistakes of different ideas both give, is described,
    not named by a guessed idea."""
    others = None  # the learner's outcomes on the other cases, made once, when first needed
    found = None
    for m in entry.mistakes.values():
        if found is not None and m.idea == found:
            continue
        by_mistake: list[int] = []
        if not _agree(got, _outcome(c, m.fn, True, by_mistake), c) or not (
            changes is None or changes in by_mistake
        ):
            continue
        if others is None:
            cases = [o for o in entry.cases if o is not c and (c.hidden or not o.hidden)]
            others = [(o, _outcome(o, obj, False)) for o in cases]
        if all(_agree(theirs, _outcome(o, m.fn, True), o) for o, theirs in others):
            if found is not None:
                return None  # two ideas give this answer: what differs says more than a guess
            found = m.idea
    return found


# --- lookup --------------------------------------------------------------------------------------


def _load_chapter(prefix: str) -> None:
    """Import the check module of chapter `prefix` ("ch01") once."""
    if prefix in _LOADED or not prefix.isidentifier():
        return
    try:
        importlib.import_module(f"{CHECKS}.{prefix}")
    except ModuleNotFoundError as e:
        if e.name != f"{CHECKS}.{prefix}":
            raise  # the chapter module exists but one of its own imports is broken
        _load_extra(prefix)
    _LOADED.add(prefix)


def _load_extra(prefix: str) -> None:
    for folder in filter(None, os.environ.get(PATH_ENV, "").split(os.pathsep)):
        path = Path(folder) / f"{prefix}.py"
        if path.is_file():
            name = f"qwen_mini_extra_exercises.{prefix}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            return


def get(exercise_id: str) -> Exercise:
    """The registered exercise; UnknownExercise (with the known ids) if there is none."""
    _load_chapter(exercise_id.split(".")[0])
    entry = _EXERCISES.get(exercise_id)
    if entry is None or not entry.registered:
        prefix = exercise_id.split(".")[0]
        known = ", ".join(e.id for e in exercises(prefix)) or "none"
        raise UnknownExercise(f"unknown exercise {exercise_id!r} (known in {prefix}: {known})")
    return entry


def exercises(chapter: str) -> list[Exercise]:
    """The registered exercises of a chapter ("ch01"), in registration order."""
    _load_chapter(chapter)
    return [e for e in _EXERCISES.values() if e.registered and e.id.split(".")[0] == chapter]


def reference(exercise_id: str):
    """The package's implementation of an exercise."""
    return get(exercise_id).reference


# --- running checks ------------------------------------------------------------------------------


def run_checks(exercise_id: str, obj, hidden: bool = False) -> Result:
    """Run the public (and with hidden=True, also the hidden) checks on `obj`; stop at the first
    failure. Each check starts from the same random seed and leaves the caller's RNG untouched."""
    entry = get(exercise_id)
    checks = entry.public + (entry.hidden if hidden else [])
    kind = "all" if hidden else "public"
    for done, (name, fn) in enumerate(checks):
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                fn(obj)
        except NotImplementedError:
            return Result(exercise_id, "not-implemented", done, len(checks), kind=kind)
        except AssertionError as e:
            return Result(exercise_id, "failed", done, len(checks), f"{name} failed: {e}", kind)
        except Exception as e:  # the learner's code crashed inside the check
            where = learner_line(e)
            at = f" ({where})" if where else ""
            message = f"{name} failed: your code raised {exception_text(e)}{at}{crash_idea(e)}"
            return Result(exercise_id, "failed", done, len(checks), message, kind, e)
    return Result(exercise_id, "passed", len(checks), len(checks), kind=kind)


def exception_text(e: BaseException, limit: int = 500) -> str:
    """`e` as "MemoryError: text", or its name alone when it has no text ("MemoryError", never
    "MemoryError: "); the text cut to `limit` characters."""
    try:
        text = str(e)
    except Exception:  # a learner's exception class whose __str__ itself raises
        text = "(a message that could not be read)"
    text = text[:limit]
    return f"{type(e).__name__}: {text}" if text.strip() else type(e).__name__


def crash_idea(e: BaseException) -> str:
    """The idea of the catalogued mistake that crashes as the learner's code did (as "; idea"),
    or ""."""
    idea = getattr(e, "idea", None)
    return f"; {idea}" if isinstance(idea, str) else ""


_GRADER_CELL = re.compile(r"<cell (\d+)")  # the grader's name for a notebook cell's code


def _cell_label(filename: str) -> str | None:
    """ "cell In[5]" for the code of a notebook cell (IPython's name for it, or the grader's
    "<cell 5>"); None for any other file."""
    found = _GRADER_CELL.match(filename)
    if found:
        return f"cell {found.group(1)}"
    found = re.match(r"<ipython-input-(\d+)-", filename)
    if found:
        return f"cell In[{found.group(1)}]"
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    names = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if isinstance(names, dict) and filename in names:
        return f"cell In[{names[filename]}]"
    return None


def learner_line(e: BaseException, lines_of: Callable | None = None) -> str:
    """Where in the learner's cells `e` was raised: "cell In[5], line 3: y = x @ w" (the
    deepest frame of a notebook cell in its traceback), or "" when no cell's code is in it.
    `lines_of(filename)`: a cell's lines, where linecache does not hold them (the sandbox)."""
    where = getattr(e, "learner_line", None)  # said by the sandbox, where the code ran
    if isinstance(where, str):
        return where
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        label = _cell_label(frame.filename)
        if label is None:
            continue
        lines = lines_of(frame.filename) if lines_of else None
        n = frame.lineno or 0
        text = lines[n - 1] if lines and 0 < n <= len(lines) else frame.line or ""
        text = " ".join(text.split())
        return f"{label}, line {n}" + (f": {text[:160]}" if text else "")
    return ""


def mode() -> str:
    value = os.environ.get("QWEN_MINI_CHECKS", "").strip().lower() or "learner"
    if value not in MODES:
        raise ValueError(f"QWEN_MINI_CHECKS={value!r}: expected one of {', '.join(MODES)}")
    return value


def check(exercise_id: str, obj) -> Result:
    """Test `obj` (not the package's copy) with the exercise's public checks; print one line.

    Returns the result, true when every check passes (and shown as nothing in a notebook).
    Raises only in the `solutions` and `course` modes.
    """
    current = mode()
    try:
        result = run_checks(exercise_id, obj)
    except UnknownExercise as e:
        if current != "learner":
            raise
        print(f"? {e}")
        return Result(exercise_id, "unknown", 0, 0, str(e))
    print(result.line())
    _remember(exercise_id, obj, result)
    if current == "solutions" and not result.ok:
        raise CheckError(f"{result.line()} (QWEN_MINI_CHECKS=solutions: the solution must pass)")
    if current == "course" and result.status != "not-implemented":
        raise CheckError(
            f"{result.line()} (QWEN_MINI_CHECKS=course: a learner copy must report 'not "
            "implemented yet'; a pass means the solution leaked or the checks cannot fail)"
        )
    return result


# who else hears of each result of check() and use(), as (exercise id, object, result): the
# learner's pieces (course/__init__.py adds mine.remember), the grader's tests
AFTER_CHECK: list[Callable[[str, object, Result], None]] = []


def _remember(exercise_id: str, obj, result: Result) -> None:
    for listener in AFTER_CHECK:
        listener(exercise_id, obj, result)


def use(exercise_id: str, obj):
    """`obj` if it passes its public checks, else the package's reference; says which."""
    if obj is reference(exercise_id):  # an earlier use() already swapped the package's in
        print(f"→ using the package's {exercise_id}")
        return obj
    result = run_checks(exercise_id, obj)
    _remember(exercise_id, obj, result)
    if result.ok:
        print(f"✓ using your {exercise_id} (it passes its checks)")
        return obj
    why = "not implemented yet" if result.status == "not-implemented" else "not passing yet"
    print(f"→ using the package's {exercise_id}: yours is {why}")
    return reference(exercise_id)


# --- assertion helpers for check functions -------------------------------------------------------


def seeded(seed: int) -> torch.Generator:
    """A generator of its own, so check inputs are the same whatever the learner seeded."""
    return torch.Generator().manual_seed(seed)


def randn(
    *shape, seed: int = 0, dtype=torch.float32, g: torch.Generator | None = None
) -> torch.Tensor:
    """Standard-normal test input, drawn in float32 (identical on every machine), then cast;
    from a case's generator `g`, else from one seeded with `seed`."""
    return torch.randn(*shape, generator=g or seeded(seed)).to(dtype)


def between(g: torch.Generator, low: int, high: int) -> int:
    """A size drawn from a case's generator, low ≤ n ≤ high (hidden cases vary their shapes)."""
    return int(torch.randint(low, high + 1, (), generator=g))


def named(value, *names: str) -> dict:
    """The parts of a returned tuple by name, so that a message says which one differs."""
    if not (isinstance(value, tuple | list) and len(value) == len(names)):
        raise AssertionError(f"expected a tuple ({', '.join(names)}), got {_kind(value)}")
    return dict(zip(names, value, strict=True))


def _short(value, limit: int = 120) -> str:
    """`value` as text, a long list as its first few items and how many in all."""
    if isinstance(value, tuple | list) and len(value) > 6:
        head = ", ".join(_short(v, 30) for v in value[:5])
        text = f"[{head}, … ({len(value)} items in all)]"
        return text if len(text) <= limit else text[: limit - 1] + "…"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _sequence_difference(got, expected) -> str:
    """Where two sequences first differ: the position and both items there, and both lengths
    when they differ."""
    i = next(
        (k for k, (a, b) in enumerate(zip(got, expected, strict=False)) if not _same(a, b)), None
    )
    if i is None:
        i = min(len(got), len(expected))
        longer, which = (got, "got") if len(got) > len(expected) else (expected, "expected")
        return (
            f"expected {len(expected)} items, got {len(got)}: the first {i} agree, then "
            f"{which} has {_short(list(longer[i : i + 3]), 60)}"
            + (" …" if len(longer) > i + 3 else "")
        )
    lengths = (
        f"; {len(expected)} items expected, {len(got)} given" if len(got) != len(expected) else ""
    )
    return (
        f"first difference at position {i} of {len(expected)}: expected {_short(expected[i], 50)}, "
        f"got {_short(got[i], 50)}{lengths} (expected {_short(expected)}, got {_short(got)})"
    )


def expect_equal(name: str, got, expected) -> None:
    """`expect_close` with no tolerance."""
    expect_close(name, got, expected, atol=0.0, rtol=0.0)


def expect_close(name: str, got, expected, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """The one comparison: fail with "name: expected …, got …" unless `got` has the structure
    of `expected` (dicts with its keys, sequences of its length), tensors of its shape and dtype
    (a subclass or another object is wrong), and values within atol + rtol·|expected|. NaN or inf
    where `expected` is finite is wrong; the message gives the worst element. A value without a
    name is "the result"."""
    name = name or "the result"
    if isinstance(expected, dict):
        _expect_dict(name, got, expected, atol, rtol)
    elif isinstance(expected, tuple | list) and not _plain(expected):
        if not isinstance(got, tuple | list) or len(got) != len(expected):
            what = (
                f"{type(got).__name__} of length {len(got)}"
                if isinstance(got, tuple | list)
                else _kind(got)
            )
            raise AssertionError(f"{name}: expected {len(expected)} values, got {what}")
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            expect_close(f"{name}[{i}]", g, e, atol, rtol)
    elif isinstance(expected, torch.Tensor):
        _expect_tensor(name, got, expected, atol, rtol)
    elif isinstance(expected, float) or (type(expected) is int and (atol or rtol)):
        _expect_number(name, got, expected, atol, rtol)
    elif type(expected) is str and type(got) is str and got != expected:
        raise AssertionError(f"{name}: {_text_difference(got, expected)}")
    elif not _same(got, expected):
        if _sequences(got, expected) and (len(got) > 6 or len(expected) > 6):
            raise AssertionError(f"{name}: {_sequence_difference(got, expected)}")
        raise AssertionError(f"{name}: expected {_short(expected)}, got {_short(got)}")


def _text_difference(got: str, expected: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    i = min(len(got), len(expected)) if i is None else i
    lo = max(0, i - 30)
    return (
        f"first difference at character {i}: expected …{expected[lo : i + 30]!r}…, "
        f"got …{got[lo : i + 30]!r}…"
    )


def _plain(value) -> bool:
    """Data compared whole and shown whole (a shape, a list of ids), not element by element."""
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return type(value) in (int, str, bool, type(None)) or isinstance(value, torch.dtype)


def _same(got, expected) -> bool:
    if type(got) is not type(expected) and not _sequences(got, expected):
        return False
    if isinstance(expected, tuple | list):
        return len(got) == len(expected) and all(map(_same, got, expected))
    try:
        return bool(got == expected)
    except Exception:  # an object that refuses bool()
        return False


def _sequences(got, expected) -> bool:  # a list where a tuple is expected is the same answer
    return isinstance(got, tuple | list) and isinstance(expected, tuple | list)


def _kind(value) -> str:
    return "None (is a `return` missing?)" if value is None else type(value).__name__


def _expect_dict(name: str, got, expected: dict, atol: float, rtol: float) -> None:
    if not isinstance(got, dict):
        raise AssertionError(f"{name}: expected a dict, got {_kind(got)}")
    missing = [k for k in expected if k not in got]
    if missing:
        raise AssertionError(f"{name}: the key {missing[0]!r} is missing ({len(missing)} missing)")
    extra = [k for k in got if k not in expected]
    if extra:
        raise AssertionError(f"{name}: unexpected key {extra[0]!r} ({len(extra)} unexpected)")
    for key, e in expected.items():
        path = f"{name}[{key!r}]" if name != "the result" else str(key)
        expect_close(path, got[key], e, atol, rtol)


def _expect_number(name: str, got, expected: float, atol: float, rtol: float) -> None:
    if type(got) not in (int, float):  # a tensor, a NumPy scalar or a stand-in is not a number
        raise AssertionError(f"{name}: expected a Python number, got {_kind(got)}")
    if math.isfinite(expected) and not math.isfinite(got):
        raise AssertionError(f"{name}: expected {expected:.6g}, got {got}")
    if not (got == expected or abs(got - expected) <= atol + rtol * abs(expected)):
        tolerance = f"tolerance {atol:g} + {rtol:g}·|expected|"
        raise AssertionError(f"{name}: expected {expected:.6g}, got {got:.6g} ({tolerance})")


def _expect_tensor(name: str, got, expected: torch.Tensor, atol: float, rtol: float) -> None:
    if type(got) not in (torch.Tensor, torch.nn.Parameter):
        raise AssertionError(f"{name}: expected a tensor, got {_kind(got)}")
    g, e = got.detach(), expected.detach()
    if tuple(g.shape) != tuple(e.shape):
        raise AssertionError(f"{name}: expected shape {tuple(e.shape)}, got {tuple(g.shape)}")
    if g.dtype != e.dtype:
        raise AssertionError(f"{name}: expected dtype {e.dtype}, got {g.dtype}")
    if g.numel() == 0:
        return
    g64, e64 = g.cpu().to(torch.float64), e.cpu().to(torch.float64)
    # equal_nan only where the expected value is itself NaN: NaN never matches a number
    bad = ~torch.isclose(g64, e64, atol=atol, rtol=rtol, equal_nan=True)
    if not bad.any():
        return
    diff = (g64 - e64).abs().nan_to_num(nan=math.inf)
    flat = int(torch.where(bad.flatten(), diff.flatten(), -1.0).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
    at = f" at index {list(index)}" if index else ""
    worst = f"{float(e64.flatten()[flat]):.6g}{at}, got {float(g64.flatten()[flat]):.6g}"
    if atol == 0 and rtol == 0:
        count = int(bad.sum())
        raise AssertionError(f"{name}: expected {worst} ({count} of {g.numel()} values differ)")
    raise AssertionError(
        f"{name}: expected {worst} (max abs diff {float(diff.max()):.3g}; "
        f"tolerance {atol:g} + {rtol:g}·|expected|)"
    )
