"""Objects a check hands to the learner's code, sent BY VALUE (grader -> worker only).

A check written as it runs in the notebook passes its own objects into the learner's code: a
module the learner's constructor registers (`add_module` needs a real `nn.Module`), a model whose
layers the learner's loop iterates, a model the learner's loader fills, a fake whose methods
return generators. A handle cannot be any of those. So such an object crosses as a pickle that
the GRADER writes and the WORKER reads (the grader is trusted; nothing is ever unpickled in the
grader: what comes back is plain data, see `protocol.py`):

- every module, tensor and package or check object in it is tagged with the grader's handle for
  its original, so when the learner's code hands one back (`layer.mixer`, a cache state given to
  a hook) it arrives in the grader as the grader's own object: `is` holds as in the notebook;
- the check's own functions in it (hooks registered on a module, callbacks) stay in the grader:
  they cross as handles and run there, called from the worker;
- sent again (the grader changed it: `cache.commit(n)`), it updates the worker's copy in place,
  so the learner's code that kept a reference sees the change;
- after every answer the worker reports what changed in the copies it holds (`state_of`:
  parameters and buffers by name, public attributes that are other objects or containers with
  other contents than when sent, tensors written in place), and the grader applies it to the
  originals (`apply_state`), as plain data. Accepted: any attribute of a check's own object (its
  records: calls, stored keys), tensors and numbers of a package object (a cache's slots and
  length), the parameters of an empty (meta) model the learner's loader fills. Refused (the check
  fails): new values for a parameter or buffer that had values (the grader computes expected
  values with those), any other change to a module or a package object (a tokenizer's tables),
  and a stand-in for one of the learner's objects put directly into an attribute (only inside a
  list, tuple or dict: a record, which checks read as data).

The tensors, lists, dicts and sets a check passes as plain data come back too (`track`,
`changed_arguments`, `apply_arguments`): the worker notes each as it arrives (a tensor's bytes, a
container's items), and after every answer reports those the learner's code changed (written in
place, items added, removed or replaced, at any depth); the grader writes that into its own
objects, so a check that the code leaves its input alone, or one that computes its expected
value from the input after the call, sees what it would see in the notebook. A container the
grader sent, handed back, is the grader's own again (`is` holds). Refused: writing in place into
a Parameter the check passed (its values are what the check computes expected values with).

What this does not guarantee: a check that hands a package state to the learner's code and then
computes expected values with it sees the tensors the learner's code wrote there, as in the
notebook; so do a check's records. Objects that cannot be pickled cross as handles, as before.
"""

from __future__ import annotations

import base64
import io
import pickle
import sys
import types

import torch

from ..checking import from_checks as _from_checks

STATE_OPS = ("call", "grad", "getattr", "setattr", "getitem", "setitem", "len", "iter", "next")


def _ours(obj) -> bool:
    """Tagged with the grader's handle: modules, tensors, namespaces, package and check objects."""
    if isinstance(obj, (type, types.FunctionType, types.MethodType, types.ModuleType)):
        return False
    if isinstance(obj, (torch.nn.Module, types.SimpleNamespace)) or type(obj) is object:
        return True
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return True
    module = getattr(type(obj), "__module__", "") or ""
    return module.split(".")[0] == "qwen_mini"


def by_value(obj) -> bool:
    """Sent by value rather than as a handle: a module, or an object of the package or of a
    check (not a dataclass, which already crosses as its fields, nor a function)."""
    if isinstance(obj, torch.nn.Module) or type(obj) is object:  # a module, a bare sentinel
        return True
    if isinstance(obj, (type, types.FunctionType, types.MethodType, types.ModuleType)):
        return False
    module = getattr(type(obj), "__module__", "") or ""
    return module.split(".")[0] == "qwen_mini" and (
        _from_checks(module) or not module.startswith("qwen_mini.course")
    )


# --- the grader's side ---------------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    def __init__(self, file, codec, is_remote):
        super().__init__(file, protocol=5)
        self.codec, self.is_remote = codec, is_remote

    def persistent_id(self, obj):
        if self.is_remote(obj):
            return ("w", obj._h)
        fn = obj.__func__ if isinstance(obj, types.MethodType) else obj
        if isinstance(fn, types.FunctionType) and _from_checks(fn.__module__):
            return ("p", self.codec.handle(obj), type(obj).__name__)  # runs here when called
        return None

    def reducer_override(self, obj):
        if not _ours(obj):
            return NotImplemented
        reduced = obj.__reduce_ex__(5)
        if isinstance(reduced, str):
            return NotImplemented
        h = self.codec.handle(obj)
        return (_revive, (h, reduced[0], reduced[1]), *reduced[2:])


def dumps(obj, codec, is_remote) -> str:
    out = io.BytesIO()
    _Pickler(out, codec, is_remote).dump(obj)
    return base64.b64encode(out.getvalue()).decode("ascii")


def _entries(codec, report, what: str):
    """(the grader's object, the encoded value) of each [handle, value] in a worker's report."""
    if type(report) is not list:
        raise ValueError(f"a malformed {what}")
    for entry in report:
        if type(entry) is not list or len(entry) != 2:
            raise ValueError(f"a malformed {what}")
        yield codec.lookup(entry[0]), entry[1]


def apply_state(codec, states, decode) -> None:
    """The worker's report of the copies it holds, applied to the grader's originals."""
    for obj, encoded in _entries(codec, states, "state report"):
        state = decode(encoded)
        if type(state) is not dict:
            raise ValueError("a malformed state report")
        handles = _tensor_handles(encoded)
        if isinstance(obj, torch.nn.Module):
            for kind in ("params", "buffers"):
                table = obj._parameters if kind == "params" else obj._buffers
                for name, t in (state.get(kind) or {}).items():
                    if name not in table or t is table[name]:
                        continue
                    old = table[name]
                    if t is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
                        raise AssertionError(
                            f"{name} of a module the check passed in: not a tensor"
                        )
                    if (
                        old is not None
                        and not old.is_meta
                        and not (
                            t is not None
                            and t.shape == old.shape
                            and t.dtype == old.dtype
                            and torch.equal(t.detach(), old.detach())
                        )
                    ):
                        raise AssertionError(
                            f"your code changed {name} of a module the check passed in (its "
                            "weights are what the check computes expected values with)"
                        )
                    if kind == "params" and t is not None and type(t) is not torch.nn.Parameter:
                        # one Parameter here per Parameter there: two that share a tensor
                        # without being tied stay two (a head not tied again after loading)
                        t = codec.parameter(t, handles.get((kind, name)))
                    table[name] = t
        attrs = state.get("attrs") or {}
        target = getattr(obj, "__dict__", None)
        if type(attrs) is not dict or not isinstance(target, dict):
            continue
        record = _from_checks(getattr(type(obj), "__module__", ""))
        for name, value in attrs.items():
            if type(name) is not str or name.startswith("_") or name not in target:
                continue
            if not record and (
                isinstance(obj, torch.nn.Module)
                or type(value) not in (torch.Tensor, int, float, bool, type(None))
            ):
                raise AssertionError(
                    f"your code changed {name} of the check's {type(obj).__name__} (it may "
                    "change a check's records, and the tensors and numbers of a package state "
                    "such as a cache, nothing else)"
                )
            if codec.is_remote(value) and not codec.is_remote(target[name]):
                raise AssertionError(
                    f"your code put one of its own objects in {name} of an object the check "
                    "passed in"
                )
            target[name] = value


def _tensor_handles(encoded) -> dict:
    """{(kind, name): the worker's handle} of the parameters and buffers in an encoded state."""
    out = {}
    if type(encoded) is not dict or type(encoded.get("v")) is not list:
        return out
    for pair in encoded["v"]:
        if type(pair) is not list or len(pair) != 2 or pair[0] not in ("params", "buffers"):
            continue
        table = pair[1]
        if type(table) is not dict or type(table.get("v")) is not list:
            continue
        for item in table["v"]:
            if type(item) is list and len(item) == 2 and type(item[1]) is dict:
                h = item[1].get("h")
                if type(item[0]) is str and type(h) is int:
                    out[(pair[0], item[0])] = h
    return out


def apply_arguments(codec, changes, decode) -> None:
    """What the learner's code did to the tensors and containers a check passed in, written into
    the grader's own: a tensor's new values in place, a container's new items."""
    for original, encoded in _entries(codec, changes, "report of changed arguments"):
        new = decode(encoded)
        if isinstance(original, torch.Tensor):
            if type(new) is not torch.Tensor:
                raise ValueError("a changed tensor that is not a tensor")
            if new.shape == original.shape and torch.equal(new, original.detach()):
                continue  # written with the values it had
            if isinstance(original, torch.nn.Parameter):
                raise AssertionError(
                    "your code wrote in place into a parameter the check passed in (its values "
                    "are what the check computes expected values with)"
                )
            if new.shape != original.shape or new.dtype != original.dtype:
                raise AssertionError(
                    f"your code changed the shape or dtype of a tensor the check passed in, in "
                    f"place (to {list(new.shape)} {new.dtype})"
                )
            with torch.no_grad():
                original.copy_(new)
        elif type(original) is list and type(new) is list:
            original[:] = new
        elif (isinstance(original, dict) and type(new) is dict) or (
            type(original) is set and type(new) is set
        ):
            original.clear()
            original.update(new)
        else:
            raise ValueError("a malformed report of changed arguments")


# --- the worker's side ---------------------------------------------------------------------------

_WORKER = None  # the worker's codec, while it reads a pickle


def _revive(h, fn, args):
    codec = _WORKER
    known = codec.from_grader.get(h)
    if known is not None and not isinstance(known, torch.Tensor):
        return known  # sent again: its state is set again, in place
    obj = fn(*args)
    codec.adopt(h, obj)
    return obj


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, codec):
        super().__init__(file)
        self.codec = codec

    def persistent_load(self, pid):
        if type(pid) is not tuple or pid[0] not in ("w", "p"):
            raise pickle.UnpicklingError("bad persistent id")
        if pid[0] == "w":
            return self.codec.lookup(pid[1])
        return self.codec.decode({"t": "ref", "side": "p", "h": pid[1], "type": pid[2]})


def loads(data: str, codec):
    global _WORKER
    _WORKER = codec
    try:
        obj = _Unpickler(io.BytesIO(base64.b64decode(data)), codec).load()
    finally:
        _WORKER = None
    for h, copy in list(codec.copies.items()):  # as the grader has them now
        codec.snapshots[h] = _signature(copy)
        # its tensors go back once in the next report: the grader then watches them for
        # changes it makes in place (the `mirrors`), which reach this copy (see state_of)
        codec.weights.pop(h, None)
    return obj


def _sig(value):
    """What tells a changed attribute: another object, or a container with other contents."""
    if type(value) in (list, tuple):
        return (id(value), tuple(id(x) for x in value))
    if type(value) is dict:
        return (id(value), tuple((id(k), id(x)) for k, x in value.items()))
    if type(value) is set:
        return (id(value), frozenset(id(x) for x in value))
    if isinstance(value, torch.Tensor) and value.is_inference():
        return object()  # made under torch.inference_mode: no version counter; always sent back
    if isinstance(value, torch.Tensor):  # written in place (a cache's slots)
        return (id(value), value._version)
    return id(value)


def _signature(obj) -> dict:
    attrs = getattr(obj, "__dict__", None)
    return {k: _sig(v) for k, v in attrs.items()} if isinstance(attrs, dict) else {}


def state_of(codec, h, obj) -> dict:
    """What the grader takes back of a copy: the parameters and buffers of a module (by name),
    all of them in the first report after it was sent, then those that are other tensors or
    were written in place since the last report (the grader keeps the rest); and the public
    attributes that changed since the grader sent it."""
    before = codec.snapshots.get(h) or {}
    out = {}
    if isinstance(obj, torch.nn.Module):
        weights, last = _weights(obj), codec.weights.get(h, {})
        for kind, table in (("params", obj._parameters), ("buffers", obj._buffers)):
            out[kind] = {
                k: t
                for k, t in table.items()
                if (t is None or not t.is_meta) and not _same(last.get((kind, k)), weights[kind, k])
            }
        codec.weights[h] = weights
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        out["attrs"] = {
            k: v
            for k, v in attrs.items()
            if type(k) is str
            and not k.startswith("_")
            and k != "training"
            and not callable(v)
            and before.get(k) != _sig(v)
        }
    return out


def _weights(module: torch.nn.Module) -> dict:
    """(kind, name) -> each parameter and buffer as it is now (see `_as_sent`)."""
    return {
        (kind, name): _as_sent(t)
        for kind, table in (("params", module._parameters), ("buffers", module._buffers))
        for name, t in table.items()
    }


def _same(before, now) -> bool:
    """The same tensor (or None) as before, with the same values."""
    if before is None or before[0] is not now[0]:
        return False
    return now[0] is None or not _changed(*before)


TRACKED_BYTES_MAX = 64 * 2**20  # a bigger tensor is compared by its version counter only


def track(codec, h, value) -> None:
    """Worker: `value` (a tensor, list, dict or set) arrived as the grader's object `h`; note it
    as it is now, to tell later what the learner's code changed."""
    if isinstance(value, torch.Tensor):
        codec.sent[h] = _as_sent(value)
    else:
        codec.sent[h] = (value, _items(value), None)
        codec.origin[id(value)] = h


def _as_sent(t: torch.Tensor | None) -> tuple:
    """(tensor, version, copy): to tell later whether it was written in place (by its bytes; a
    big one, or one made under inference_mode, by its version counter). `.data` has a version
    counter of its own, so a write through it is seen only in the bytes."""
    if t is None or t.is_meta:
        return (t, None, None)
    version = None if t.is_inference() else t._version
    small = t.numel() * t.element_size() <= TRACKED_BYTES_MAX
    return (t, version, t.detach().clone() if small else None)


def _items(value) -> tuple:
    if type(value) is dict:
        return tuple((id(k), id(x)) for k, x in value.items())
    if type(value) is set:
        return tuple(sorted(id(x) for x in value))
    return tuple(id(x) for x in value)


def _changed(value, version, before) -> bool:
    if isinstance(value, torch.Tensor):
        if before is None:  # no copy kept (too big): written in place, or not
            return version is None or value._version != version
        return not (value.shape == before.shape and torch.equal(value.detach(), before))
    return _items(value) != version


def _kept(codec, h, value) -> bool:
    """Is `value` held by anything but this bookkeeping (the learner's code kept it: it may
    change it in a later call)? If not, it cannot change any more and needs no watching."""
    ours = 4  # codec.sent, the variables of the caller and of this function, getrefcount
    ours += codec.from_grader.get(h) is value
    ours += codec.objects.get(codec.ids.get(id(value))) is value
    return sys.getrefcount(value) > ours


def changed_arguments(codec) -> list:
    """Worker: [grader's handle, new value] for each tensor and container the grader sent that
    the learner's code changed since it was sent (or last reported); noted again as it is now.
    One that nothing else holds any more is no longer watched (a check makes many calls)."""
    out = []
    for h in list(codec.sent):
        value, version, before = codec.sent[h]
        if _changed(value, version, before):
            if isinstance(value, torch.Tensor):
                out.append([h, codec.encode(value)])
            else:  # its items, as a new container (the one itself would cross as the grader's)
                out.append([h, codec.encode(type(value)(value))])
            track(codec, h, value)
        if not _kept(codec, h, value):
            del codec.sent[h]
    return out
