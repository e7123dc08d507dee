"""Exercise checks: instant feedback in the notebooks, and the same checks for grading.

In a chapter notebook::

    from qwen_mini.course import check, use

    check("ch01.repeat_kv", repeat_kv)            # tests *this* object, prints one line
    Attention = use("ch01.Attention", Attention)  # yours if it passes, else the package's

A chapter's checks live in `qwen_mini/course/checks/chNN.py`, imported the first time one of its
exercise ids is used::

    register("ch01.repeat_kv", reference=attention.repeat_kv, points=1, title="...")

    @public("ch01.repeat_kv")      # shown to the learner; @hidden ones only run when grading
    def _(repeat_kv):
        expect_equal("shape", tuple(repeat_kv(k, 2).shape), (1, 4, 3, 8))

`QWEN_MINI_CHECKS` sets what a check does besides printing: `learner` (default) never raises,
so Run All keeps going; `solutions` raises unless the exercise passes (CI on solutions/);
`course` raises unless it is "not implemented yet" (CI on course/: a learner copy that passes
has leaked its solution, or its checks cannot fail).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

MODES = ("learner", "solutions", "course")
# Extra folders holding `chNN.py` check modules (course extensions, the test suite's fixtures).
PATH_ENV = "QWEN_MINI_EXERCISES_PATH"
CHECKS = "qwen_mini.course.checks"  # the package of the chapters' check modules


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
    registered: bool = False


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
    """Declare an exercise, the package object it reimplements and what it is worth."""
    entry = _entry(exercise_id)
    entry.reference, entry.points, entry.title, entry.registered = reference, points, title, True


def _add(exercise_id: str, which: str, name: str | None):
    def decorator(fn: Callable) -> Callable:
        checks = getattr(_entry(exercise_id), which)
        # re-importing a chapter module must not register its checks twice
        key = (fn.__code__.co_filename, fn.__code__.co_firstlineno)
        checks[:] = [c for c in checks if _key(c[1]) != key]
        label = name or _docline(fn) or f"{which} check {len(checks) + 1}"
        checks.append((label, fn))
        return fn

    return decorator


def _key(fn: Callable) -> tuple:
    return (fn.__code__.co_filename, fn.__code__.co_firstlineno)


def _docline(fn: Callable) -> str:
    return (fn.__doc__ or "").strip().split("\n")[0]


def public(exercise_id: str, name: str | None = None):
    """Decorate `def _(obj): ...`: a check the learner runs; it raises AssertionError to fail."""
    return _add(exercise_id, "public", name)


def hidden(exercise_id: str, name: str | None = None):
    """Like `public`, but only run when grading."""
    return _add(exercise_id, "hidden", name)


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
            message = f"{name} failed: your code raised {type(e).__name__}: {e}"
            return Result(exercise_id, "failed", done, len(checks), message, kind, e)
    return Result(exercise_id, "passed", len(checks), len(checks), kind=kind)


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


def _remember(exercise_id: str, obj, result: Result) -> None:
    """Keep a passing answer as the learner's piece for later chapters; set a kept one aside
    when the learner's answer now fails (qwen_mini/course/mine.py)."""
    from . import mine

    if result.ok:
        mine.keep(exercise_id, obj)
    elif result.status == "failed":
        mine.set_aside(exercise_id)


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


def randn(*shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Standard-normal test input, drawn in float32 (identical on every machine), then cast."""
    return torch.randn(*shape, generator=seeded(seed)).to(dtype)


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def expect_equal(name: str, got, expected) -> None:
    """Fail with "name: expected …, got …" unless got == expected (tensors: shape and values)."""
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        _expect_tensor(name, got, expected, atol=0.0, rtol=0.0)
        return
    try:
        same = bool(got == expected)
    except Exception:  # e.g. comparing a tensor-like object that refuses bool()
        same = False
    if not same:
        raise AssertionError(f"{name}: expected {_short(expected)}, got {_short(got)}")


def expect_close(name: str, got, expected, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Fail unless |got - expected| <= atol + rtol * |expected| everywhere, with equal shapes;
    the message gives the worst element, the max abs diff and the tolerance."""
    _expect_tensor(name, got, expected, atol, rtol)


def _as_tensor(name: str, value, role: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if value is None and role == "got":
        raise AssertionError(f"{name}: expected a tensor, got None (is a `return` missing?)")
    try:
        return torch.as_tensor(value)
    except Exception:
        raise AssertionError(f"{name}: expected a tensor, got {type(value).__name__}") from None


def _expect_tensor(name: str, got, expected, atol: float, rtol: float) -> None:
    g, e = _as_tensor(name, got, "got"), _as_tensor(name, expected, "expected")
    if tuple(g.shape) != tuple(e.shape):
        raise AssertionError(f"{name}: expected shape {tuple(e.shape)}, got {tuple(g.shape)}")
    if g.numel() == 0:
        return
    g64, e64 = g.cpu().to(torch.float64), e.cpu().to(torch.float64)
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
