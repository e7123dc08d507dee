"""Variants of a case: the same exercise run the way the real models run it.

A case checks an exercise on the CPU in float32. The models ship in bfloat16 and run on GPUs,
get trained, and are moved with `.to()`; a variant runs a case again in one of those ways, so
that every exercise declares which of them it must survive, as data::

    case("ch01.attention", "...", inputs, variants=("bfloat16", "meta"))
    case("ch05.deltanet_gates", "...", inputs, variants=(bfloat16(float32=SOFTPLUS),))

The kinds, each written once here:

- `bfloat16`: the case's floating-point inputs (tensors, modules) cast to bfloat16. Each output
  tensor must have the dtype the reference's has (a bfloat16 input gives a bfloat16 output) and
  values within a bfloat16 tolerance of the reference's on the same inputs; an observation
  (`float32=(kind, what)`) sees that the steps the prose computes in float32 are float32.
- `meta`: the learner's code runs with torch's default device set to `meta`, its inputs still
  on the CPU: a tensor made without `device=` lands on `meta` and the first operation mixing it
  with the inputs fails, as it would on a GPU with a tensor made on the CPU.
- `registered`: the module a case builds has every parameter of the reference's in its
  `state_dict()`, and `.to(dtype)` converts all of them (a list of experts kept in a plain
  Python list is invisible to both).
- `lazy`: a generator yields as it goes: a caller that takes the first few items pays for those
  only (a list built first, then returned, pays for all of them).
- `backward`: a backward pass through the block works and gives the reference's gradients (an
  in-place `h += ...` on a tensor autograd saved breaks it).

Each runs where the learner's code runs (observing.py): when graded, the default device is set
in the sandbox, around each call of the learner's code, and the backward pass runs there too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from . import checking, observing

KINDS = ("bfloat16", "meta", "registered", "lazy", "backward")
# bfloat16 keeps 8 bits of mantissa: a relative step of 2**-8 ≈ 0.004 per rounding; a few
# roundings on the way, and values of order 1, stay within these
BF16_ATOL, BF16_RTOL = 2e-2, 2e-2


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str
    # bfloat16: the tolerance (0: BF16_ATOL, BF16_RTOL), and (observation kind, what it names)
    # for the steps that must compute in float32
    atol: float = 0.0
    rtol: float = 0.0
    float32: tuple[str, str] | None = None
    # replaces the case's call in this variant (a call that casts what it builds, say)
    call: Callable | None = None
    # registered: (impl, *inputs) -> the module; backward: (impl, *inputs) -> (fn, arguments);
    # lazy: (impl, *inputs) -> (what the generator function returned, cost() -> work done)
    build: Callable | None = None
    take: int = 3  # lazy: how many items the caller takes
    what: str = ""  # registered, backward, lazy: what the message calls the object
    name: str = ""  # what the check is called after the case's name (default: the kind's)
    # run before the exercise's plain checks (registration, which every case's loading needs)
    first: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown variant {self.kind!r} (known: {', '.join(KINDS)})")
        if self.kind in ("registered", "backward", "lazy") and self.build is None:
            raise ValueError(f"a {self.kind} variant needs build=")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return {
            "bfloat16": "in bfloat16",
            "meta": "with the default device set to meta",
            "registered": "parameters registered",
            "lazy": "a generator: yields as it goes",
            "backward": "a backward pass",
        }[self.kind]


def bfloat16(**kwargs) -> Variant:
    return Variant("bfloat16", **kwargs)


def meta(**kwargs) -> Variant:
    return Variant("meta", **kwargs)


def registered(build: Callable, what="module", name: str = "", first: bool = False) -> Variant:
    return Variant("registered", build=build, what=what, name=name, first=first)


def lazy(build: Callable, take: int = 3, what: str = "generator", name: str = "") -> Variant:
    return Variant("lazy", build=build, take=take, what=what, name=name)


def backward(build: Callable, what="block", atol=1e-5, rtol=1e-4, name: str = "") -> Variant:
    return Variant("backward", build=build, what=what, atol=atol, rtol=rtol, name=name)


def of(spec) -> Variant:
    return spec if isinstance(spec, Variant) else Variant(spec)


def case(exercise_id: str, name: str, inputs: Callable, *args, variants: tuple = (), **kw) -> None:
    """`checking.case` (the same arguments), then each of `variants` (a kind's name or a
    `Variant`) as a check of its own, after the exercise's plain ones."""
    c = checking.case(exercise_id, name, inputs, *args, **kw)
    for spec in variants:
        v = of(spec)
        label = f"{name}, {v.label}"
        checking.add_check(
            exercise_id, c.hidden, label, check_of(c, v), variant=True, first=v.first
        )


def check_of(c: checking.Case, v: Variant) -> Callable:
    """The check (obj) -> None that runs case `c` as variant `v`."""
    run = {
        "bfloat16": _bfloat16,
        "meta": _meta,
        "registered": _registered,
        "lazy": _lazy,
        "backward": _backward,
    }[v.kind]
    return lambda obj: run(c, v, obj)


# --- bfloat16 ------------------------------------------------------------------------------------


def to_bfloat16(value):
    """Floating-point tensors and modules cast to bfloat16, inside lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.bfloat16) if value.is_floating_point() else value
    if isinstance(value, nn.Module):
        return value.to(torch.bfloat16)
    if type(value) in (list, tuple):
        return type(value)(to_bfloat16(v) for v in value)
    if type(value) is dict:
        return {k: to_bfloat16(v) for k, v in value.items()}
    return value


def _dtype_difference(got, want, path: str = "") -> tuple[str, object, object] | None:
    """The first tensor of `want` whose counterpart in `got` has another dtype: (where, the
    learner's dtype, the reference's)."""
    if isinstance(want, torch.Tensor):
        if isinstance(got, torch.Tensor) and got.dtype != want.dtype:
            return path or "the output", got.dtype, want.dtype
        return None
    if isinstance(want, dict) and isinstance(got, dict):
        for k, w in want.items():
            if k in got:
                found = _dtype_difference(got[k], w, f"{path}[{k!r}]" if path else str(k))
                if found:
                    return found
    if isinstance(want, list | tuple) and isinstance(got, list | tuple) and len(got) == len(want):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            found = _dtype_difference(g, w, f"{path or 'the output'}[{i}]")
            if found:
                return found
    return None


def _short_dtype(d) -> str:
    return str(d).removeprefix("torch.")


def _bfloat16(c: checking.Case, v: Variant, obj) -> None:
    entry = checking.get(c.exercise_id)
    vc = dataclasses.replace(
        c,
        inputs=lambda g: to_bfloat16(c.inputs(g)),
        call=v.call or c.call,
        expected=None,
        atol=v.atol or BF16_ATOL,
        rtol=v.rtol or BF16_RTOL,
    )
    seed = checking._seed(vc)
    try:
        with observing.observe(v.float32[0]) if v.float32 else _nothing() as seen:
            got = checking._result(vc, obj, seed)
    except (AssertionError, NotImplementedError):
        raise
    except Exception as e:
        raise AssertionError(
            f"with bfloat16 inputs, your code raised {_raised(e)} (a tensor made or left in "
            "float32 meeting a bfloat16 one? a bfloat16 input must give a bfloat16 output: "
            "make tensors in the input's dtype, dtype=x.dtype)"
        ) from None
    want = checking._result(vc, entry.reference, seed, ours=True)
    wrong = _dtype_difference(got, want)
    if wrong:
        where, mine, theirs = wrong
        idea = checking._matching_mistake(vc, entry, got, seed, obj)
        if theirs != torch.bfloat16:  # a step the prose computes in float32 (or an integer)
            hint = ": cast to it first, e.g. .float()" if theirs == torch.float32 else ""
            raise AssertionError(
                f"with bfloat16 inputs, {where} must be {_short_dtype(theirs)}: yours is "
                f"{_short_dtype(mine)} (the chapter computes it in {_short_dtype(theirs)}{hint})"
                + (f"; {idea}" if idea else "")
            )
        raise AssertionError(
            f"a {_short_dtype(theirs)} input must give a {_short_dtype(theirs)} output: "
            f"{where} is {_short_dtype(mine)} (made in {_short_dtype(mine)}, or computed in it "
            "and not cast back? return the input's dtype, e.g. .to(x.dtype); a bfloat16 model "
            "fails at its next layer otherwise)" + (f"; {idea}" if idea else "")
        )
    if v.float32:
        kind, what = v.float32
        other = [d for d in (seen.value or []) if d != torch.float32]
        if other:
            raise AssertionError(
                f"with bfloat16 inputs, {what} must be computed in float32: your code computed "
                f"it in {_short_dtype(other[0])} (cast its inputs to float32 first, e.g. "
                "w.float(): bfloat16 keeps 8 bits of mantissa)"
            )
    root = entry.id.split(".", 1)[1] if vc.call is checking._plain_call else ""
    try:
        checking.expect_close(root, got, want, vc.atol, vc.rtol)
    except AssertionError as e:
        idea = checking._matching_mistake(vc, entry, got, seed, obj)
        raise AssertionError(
            f"with bfloat16 inputs, {idea or e} (the reference run on the same bfloat16 "
            "inputs; a bfloat16 tolerance)"
        ) from None


def _raised(e: BaseException) -> str:
    """The learner's exception, and where in their cells it was raised."""
    where = checking.learner_line(e)
    return checking.exception_text(e, 240) + (f" at {where}" if where else "")


# --- meta ----------------------------------------------------------------------------------------

META_IDEA = (
    "your code made a tensor on the default device (the CPU), not on its input's device: make "
    "it with device=x.device (torch.arange(n, device=x.device), torch.ones(..., device=...)), "
    "or from the input (x.new_zeros, torch.zeros_like); on a GPU it would be on the wrong "
    "device. This check runs your code with the default device set to 'meta'"
)


def _on_meta(impl):
    """`impl` called with the default device set to meta (in the notebook: the grader's
    sandbox does the same around each call of the learner's code, see `observing`)."""

    def call(*args, **kwargs):
        with torch.device("meta"):
            return impl(*args, **kwargs)

    return call


def _has_meta(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_meta
    if isinstance(value, dict):
        return any(_has_meta(x) for x in value.values())
    if isinstance(value, list | tuple):
        return any(_has_meta(x) for x in value)
    return False


def _meta(c: checking.Case, v: Variant, obj) -> None:
    vc = dataclasses.replace(c, call=v.call or c.call)
    seed = checking._seed(vc)
    try:
        if observing.graded():
            with observing.observe("default_device_meta"):
                got = checking._result(vc, obj, seed)
        else:
            got = checking._result(vc, _on_meta(obj), seed)
    except Exception as e:  # NotImplementedError too: "Cannot copy out of meta tensor"
        if "meta" not in str(e):
            raise
        raise AssertionError(f"{META_IDEA} ({_raised(e)})") from None
    if _has_meta(got):
        raise AssertionError(f"{META_IDEA} (it returned a tensor on the meta device)")
    # the same inputs as the case, which passed: a difference comes from the default device
    # (some operations take a meta operand without complaint and give garbage)
    entry = checking.get(c.exercise_id)
    want = (
        checking._result(vc, entry.reference, seed, ours=True)
        if vc.expected is None
        else vc.expected(*checking._inputs(vc, seed))
    )
    try:
        checking.expect_close("", got, want, vc.atol, vc.rtol)
    except AssertionError as e:
        raise AssertionError(f"{META_IDEA} (its result changed: {e})") from None


# --- registered ----------------------------------------------------------------------------------


def _floating(state: dict) -> dict:
    return {k: t for k, t in state.items() if isinstance(t, torch.Tensor) and t.is_floating_point()}


def _registered(c: checking.Case, v: Variant, obj) -> None:
    entry = checking.get(c.exercise_id)
    seed = checking._seed(c)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mine = v.build(obj, *checking._inputs(c, seed))
    with torch.random.fork_rng(devices=[]), observing.here():
        torch.manual_seed(seed)
        theirs = v.build(entry.reference, *checking._inputs(c, seed))
    if isinstance(mine, list | tuple | dict):
        raise AssertionError(
            f"the {v.what} came back as a plain Python {type(mine).__name__}: the modules in it "
            "are invisible to state_dict(), .to() and the optimizer of a module holding it; "
            "return an nn.ModuleList (nn.ModuleDict)"
        )
    want, got = _floating(theirs.state_dict()), mine.state_dict()
    got = _floating(got) if isinstance(got, dict) else {}
    n_want, n_got = sum(t.numel() for t in want.values()), sum(t.numel() for t in got.values())
    missing = [k for k in want if k not in got]
    if missing or n_got < n_want:
        named = (
            f" lacks {missing[0]!r} ({len(missing)} of {len(want)} missing) and" if missing else ""
        )
        raise AssertionError(
            f"the {v.what}'s parameters are not all registered: its state_dict(){named} holds "
            f"{n_got} values, the reference's {n_want}; a module kept in a plain Python list or "
            "dict is invisible to state_dict(), .to() and the optimizer: use nn.ModuleList "
            "(nn.ModuleDict), and nn.Parameter or register_buffer for tensors"
        )
    moved = mine.to(torch.float64)
    moved = mine if moved is None else moved
    state = moved.state_dict()
    left = [k for k, t in _floating(state if isinstance(state, dict) else {}).items()]
    left = [k for k in left if state[k].dtype != torch.float64]
    if left:
        raise AssertionError(
            f"the {v.what}'s .to(torch.float64) left {left[0]!r} in {state[left[0]].dtype}: "
            "every parameter must follow .to() (register it as nn.Parameter or a buffer)"
        )


# --- lazy ----------------------------------------------------------------------------------------


def _lazy(c: checking.Case, v: Variant, obj) -> None:
    entry = checking.get(c.exercise_id)
    seed = checking._seed(c)

    def first_items(impl, ours: bool):
        with torch.random.fork_rng(devices=[]), observing.here() if ours else _nothing():
            torch.manual_seed(seed)
            result, cost = v.build(impl, *checking._inputs(c, seed))
            if isinstance(result, list | tuple):
                return result, None, cost()
            items = []
            it = iter(result)
            for _ in range(v.take):
                try:
                    items.append(next(it))
                except StopIteration:
                    break
            return result, items, cost()

    result, items, cost = first_items(obj, False)
    _, _, reference_cost = first_items(entry.reference, True)
    if items is None:
        raise AssertionError(
            f"the {v.what} must yield each item as it makes it: yours returned a "
            f"{type(result).__name__} of {len(result)}, made in full before the caller saw the "
            f"first one (a caller that stops after {v.take} pays for all of them; use yield)"
        )
    if cost > reference_cost:
        raise AssertionError(
            f"the {v.what} must yield each item as it makes it: a caller that took {v.take} "
            f"paid for {cost} steps, not {reference_cost} (yield each item before making the "
            "next)"
        )


class _nothing:
    value = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- backward ------------------------------------------------------------------------------------


def _backward(c: checking.Case, v: Variant, obj) -> None:
    entry = checking.get(c.exercise_id)
    seed = checking._seed(c)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fn, arguments = v.build(obj, *checking._inputs(c, seed))
        try:
            _, got = observing.gradients(fn, *arguments)
        except AssertionError:
            raise
        except Exception as e:
            raise AssertionError(
                f"the backward pass through your {v.what} fails ({_raised(e)}): an in-place "
                "update (h += ..., x[...] = ...) of a tensor autograd saved for the backward "
                "pass breaks training; write h = h + ..."
            ) from None
    with torch.random.fork_rng(devices=[]), observing.here():
        torch.manual_seed(seed)
        fn, arguments = v.build(entry.reference, *checking._inputs(c, seed))
        _, want = observing.gradients(fn, *arguments)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is not None and g is None:
            raise AssertionError(
                f"the backward pass through your {v.what}: no gradient reaches argument {i + 1} "
                "(a .detach(), .item() or torch.no_grad() cuts the graph)"
            )
        if w is not None:
            try:
                checking.expect_close(f"the gradient of argument {i + 1}", g, w, v.atol, v.rtol)
            except AssertionError as e:
                raise AssertionError(f"the backward pass through your {v.what}: {e}") from None
