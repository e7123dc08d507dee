"""Observations of HOW the code under test runs, made where it runs.

Most checks look at what the learner's code returns. A few look at how it runs: the memory it
allocates (`read_safetensors_header` reads the header, not the file), the dtype each softmax
computes in, the gradients a loss passes back (`gradients`). In the notebook that is a context
manager around the call. When graded, the checks run in the grader and the learner's code in a
sandbox: an observation made in the grader would see the grader, not the code. So a check asks
for one by name::

    with observe("softmax_dtypes") as seen:
        w = attention_weights(q, k, mask)
    seen.value  # [torch.float32, ...]

and the grader has it made in the sandbox, around each call of the learner's code inside the
block, and sent back as plain data (`sandboxed`). The observers are defined here once, for both.
"""

from __future__ import annotations

import contextlib
import tracemalloc

import torch


class ComputeDtypes(torch.overrides.TorchFunctionMode):
    """Records the dtype each call of the named torch functions computes in (its input's, or
    the dtype= it was asked for): `softmax` for attention weights, `pow`, `mean`, `rsqrt` and
    their variants for a norm's squares, their mean and its root."""

    def __init__(self, names: tuple[str, ...]):
        super().__init__()
        self.names, self.value = names, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if any(n == name or (n == "softmax" and n in name) for n in self.names):
            x = args[0] if args else kwargs.get("input")
            wanted = kwargs.get(
                "dtype", args[2] if name.endswith("softmax") and len(args) > 2 else None
            )
            dtype = wanted if isinstance(wanted, torch.dtype) else getattr(x, "dtype", None)
            self.value.append(dtype)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def around(self):
        with self:
            yield


class PeakMemory:
    """The most memory (bytes, as tracemalloc counts Python allocations) one call allocated."""

    def __init__(self):
        self.value = 0

    @contextlib.contextmanager
    def around(self):
        was_tracing = tracemalloc.is_tracing()
        if not was_tracing:
            tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            yield
        finally:
            self.value = max(self.value, tracemalloc.get_traced_memory()[1])
            if not was_tracing:
                tracemalloc.stop()


class Overflows(torch.overrides.TorchFunctionMode):
    """The names of the operations whose floating-point result holds +inf or NaN. A -inf is
    not one: masking with -inf before `exp` is how a mask stays finite; `exp` of a large
    positive number is not, and even when a later `tril` or `where` zeroes it, the backward
    pass multiplies that inf by 0 and the gradient is NaN."""

    def __init__(self):
        super().__init__()
        self.value = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point() and not out.is_meta:
            if (out.isnan() | (out == float("inf"))).any():
                self.value.append(getattr(func, "__name__", str(func)))
        return out

    @contextlib.contextmanager
    def around(self):
        with self:
            yield


class DefaultDevice:
    """Not an observation but a condition: the code inside runs with torch's default device set
    to `meta`, so a tensor it makes without `device=` is not on its inputs' device (variants.py).
    Made where the code runs, like the observations."""

    value = None

    @contextlib.contextmanager
    def around(self):
        with torch.device("meta"):
            yield


OBSERVERS = {
    "softmax_dtypes": lambda: ComputeDtypes(("softmax",)),
    # the square, the mean (or sum) of squares and the root, however they are spelled
    "norm_dtypes": lambda: ComputeDtypes(
        ("pow", "__pow__", "square", "mean", "sum", "rsqrt", "sqrt", "norm", "vector_norm")
    ),
    "peak_memory": PeakMemory,
    "overflows": Overflows,
    "default_device_meta": DefaultDevice,
    # the float32 steps of a bfloat16 run (variants.py): softplus, 1 + w
    "softplus_dtypes": lambda: ComputeDtypes(("softplus",)),
    "add_dtypes": lambda: ComputeDtypes(("add", "__add__", "__radd__", "add_", "__iadd__")),
}

_sandbox = None  # while the grader runs checks: kind -> a context manager observing there
_remote_gradients = None  # ... and (fn, args) -> fn's result and gradients, computed there
_grad = torch.autograd.grad  # as it was before any learner code ran


def graded() -> bool:
    """Whether the code under test runs in the grader's sandbox (not in this process)."""
    return _sandbox is not None


def new(kind: str):
    if kind not in OBSERVERS:
        raise KeyError(f"unknown observation {kind!r} (known: {', '.join(OBSERVERS)})")
    return OBSERVERS[kind]()


@contextlib.contextmanager
def observe(kind: str):
    """Observe how the code called inside the block runs; `.value` holds what was seen."""
    if _sandbox is not None:
        with _sandbox(kind) as seen:
            yield seen
        return
    seen = new(kind)
    with seen.around():
        yield seen


def gradients(fn, *args):
    """(fn(*args), the gradient of the sum of its tensors with respect to each floating-point
    tensor in `args`, in order, lists and tuples included; None for one the result does not
    depend on).

    How a check sees that a loss can be trained through. Made where the code runs: when
    graded, tensors cross to the grader without their autograd graphs, so the backward pass
    runs in the sandbox."""
    if _remote_gradients is not None:
        return _remote_gradients(fn, args)
    return gradients_here(fn, args)


def gradients_here(fn, args: tuple):
    leaves: list[torch.Tensor] = []

    def leaf(value):  # a fresh leaf per tensor: the gradient of this call alone
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            leaves.append(value.detach().clone().requires_grad_())
            return leaves[-1]
        if isinstance(value, list | tuple):
            return type(value)(leaf(v) for v in value)
        return value

    def tracked(value) -> list[torch.Tensor]:  # the result's tensors that carry a graph
        if isinstance(value, torch.Tensor):
            return [value] if value.requires_grad else []
        if isinstance(value, list | tuple):
            return [t for v in value for t in tracked(v)]
        return []

    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.detach()
        return type(value)(plain(v) for v in value) if isinstance(value, list | tuple) else value

    with torch.enable_grad():
        out = fn(*[leaf(a) for a in args])
        outputs = tracked(out)
        if outputs:
            total = sum(t.float().sum() for t in outputs)
            grads = list(_grad(total, leaves, allow_unused=True))
        else:
            grads = [None] * len(leaves)
    return plain(out), grads


@contextlib.contextmanager
def here():
    """Observations made in this process: around the grader's own code (the reference, a
    catalogued mistake), which runs here even while the learner's runs in the sandbox."""
    global _sandbox, _remote_gradients
    previous = _sandbox, _remote_gradients
    _sandbox = _remote_gradients = None
    try:
        yield
    finally:
        _sandbox, _remote_gradients = previous


class _Seen:
    value = None


@contextlib.contextmanager
def sandboxed(request):
    """The grader's side: while this runs, `observe` has the sandbox make its observations
    (`request` sends one of the worker's operations and returns its answer)."""
    global _sandbox, _remote_gradients

    def remote_gradients(fn, args):  # fn: the grader's stand-in for the learner's object
        return request({"op": "grad", "h": fn._h, "args": list(args)})

    @contextlib.contextmanager
    def remote(kind: str):
        new(kind)  # an unknown kind fails here, as in the notebook
        seen = _Seen()
        i = request({"op": "observe", "kind": kind})
        try:
            yield seen
        finally:
            seen.value = request({"op": "unobserve", "i": i})

    previous = _sandbox, _remote_gradients
    _sandbox, _remote_gradients = remote, remote_gradients
    try:
        yield
    finally:
        _sandbox, _remote_gradients = previous
