"""The channel between the grader and a worker: framed JSON messages and values as plain data.

A frame is a 4-byte big-endian length and that many bytes of JSON (ASCII: lone surrogates in
learner text travel escaped). Values cross as plain data of exact types only:

    None, bool, int, float, str            as themselves (the exact built-in types)
    list, tuple, set, frozenset, dict      {"t": "list" | "tuple" | "set" | ..., "v": ...}
    torch.Tensor (or nn.Parameter)         {"t": "tensor", "dtype", "shape", "data" (base64), ...}
      from the worker, a view of a storage: {"t": "tensor", ..., "sid", "storage" (base64 of the
      whole storage), "offset", "stride"}: the grader keeps one buffer per storage id, so two
      tensors that share memory in the worker share it here (`data_ptr()` identity, a KV cache
      returning views of its buffer, a buffer reallocated by growth: a new storage id)
    torch.dtype / device / Size, slice     {"t": "dtype" | "device" | "size" | "slice", "v": ...}
    a dataclass of the package, a SimpleNamespace (grader -> worker only) {"t": "obj" | "ns"}
    a package object by import path (grader -> worker only)              {"t": "pkg", "v": path}
    a module, a package or check object (grader -> worker only): a pickle the grader writes
      and only the worker reads, see byvalue.py               {"t": "val", "v": base64}
    a tensor the grader sent, handed back unchanged: {"t": "tensor", ..., "ph": h}, believed
      only if its bytes are exactly the grader's tensor's: then it is the grader's own tensor
    a path (grader -> worker only): a copy of the file the worker can read  {"t": "path", "v": ...}
    anything else                          a handle: {"t": "ref", "side": "w" | "p", "h": n}

A tensor subclass coming from the worker crosses as {"t": "bad"}, and decoding it fails the check
as a wrong answer; a subclass of a built-in type (a named tuple, an int with its own `__eq__`)
crosses as a handle, which equals nothing but itself: neither one's own `__eq__` or
`__torch_function__` ever runs on the grader's side. Decoding validates every field: a
malformed value raises ProtocolError, which costs that submission only.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import json
import math
import os
import pathlib
import socket
import struct
import sys
import types

import torch

MAX_FRAME = 64 * 2**20  # bytes: a bigger message is a protocol error
HEADER = struct.Struct(">I")
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
MUTABLE = (list, dict, set, torch.Tensor)  # what a check passes that the learner's code may change
MAX_DEPTH = 32  # nesting of containers in one value
MAX_DIM = 2**40  # a tensor's size, stride or offset along one dimension; their product < 2**62
SHARED_STORAGE_MAX = 8 * 2**20  # bytes: a bigger storage crosses as a plain copy of the tensor
SHARED_TOTAL_MAX = 256 * 2**20  # bytes of storages one worker keeps alive to keep their ids


class Handle:
    """Marks a value to send as a handle even if it is plain data (the object under test)."""

    def __init__(self, obj):
        self.obj = obj


class ProtocolError(Exception):
    """A message that is not what the protocol allows."""


RNG_BYTES = len(torch.get_rng_state())  # torch's CPU random state (a Mersenne Twister's)


def rng_text(state: torch.Tensor) -> str:
    """torch's random state as text: the grader and the sandbox share the check's stream."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def rng_state(text) -> torch.Tensor:
    raw = base64.b64decode(text, validate=True) if type(text) is str else b""
    if len(raw) != RNG_BYTES:
        raise ProtocolError("a malformed random state")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class WrongType(AssertionError):
    """A value from the learner's code that is not plain data (a subclass with its own rules)."""


# --- framing -------------------------------------------------------------------------------------


def send(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message, ensure_ascii=True, allow_nan=True).encode("ascii")
    if len(data) > MAX_FRAME:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_FRAME}")
    sock.sendall(HEADER.pack(len(data)) + data)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def receive(sock: socket.socket) -> dict:
    """One message (blocking; callers select() first). EOFError at end, ProtocolError if bad."""
    (n,) = HEADER.unpack(_read_exact(sock, HEADER.size))
    if n > MAX_FRAME:
        raise ProtocolError(f"a frame of {n} bytes (the limit is {MAX_FRAME})")
    try:
        message = json.loads(_read_exact(sock, n).decode("ascii"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(message, dict):
        raise ProtocolError("a message must be a JSON object")
    return message


# --- values --------------------------------------------------------------------------------------


class Codec:
    """Encodes values for one side of the channel; objects that are not plain data become handles
    into `self.objects`; `remote(side, h)` builds the local stand-in for the other side's handle."""

    def __init__(self, side: str, remote, export_ok=lambda obj: True, path_hook=None):
        self.side = side  # "w" (worker) or "p" (grader)
        self.objects: dict[int, object] = {}
        self.remote = remote
        self.export_ok = export_ok
        self.path_hook = path_hook  # grader side: a file's path -> its copy the worker can read
        # grader: id(tensor) -> (the worker's handle, the tensor here, its version then); see
        # _decode_tensor. One entry a tensor: a check that reads a weight a thousand times
        # watches it once, not a thousand times at every request
        self.mirrors: dict[int, tuple[int, torch.Tensor, int]] = {}
        self.ids: dict[int, int] = {}  # id(obj) -> its handle: one object, one handle
        self.remotes: dict[int, object] = {}  # the other side's handle -> one stand-in
        self.storages: dict[int, tuple[int, object]] = {}  # worker: data_ptr -> (sid, storage)
        self.storage_bytes = 0
        self.buffers: dict[int, torch.Tensor] = {}  # grader: storage id -> its bytes here
        self.pickle = None  # grader: obj -> a by-value message or None (see byvalue.py)
        self.is_remote = lambda obj: False  # grader: a stand-in for a worker's object
        self.params: dict[int, torch.nn.Parameter] = {}  # grader: id(tensor) -> its Parameter
        self.from_grader: dict[int, object] = {}  # worker: grader handle -> its copy here
        self.copies: dict[int, object] = {}  # worker: those of them sent by value (not tensors)
        self.origin: dict[int, int] = {}  # worker: id(copy) -> the grader's handle
        self.storage_origin: dict[int, int] = {}  # worker: data_ptr -> grader tensor handle
        self.tensor_cache: dict[tuple, torch.Tensor] = {}  # grader: one tensor per worker view
        self.snapshots: dict[int, dict] = {}  # worker: grader handle -> its attributes as sent
        self.weights: dict[int, dict] = {}  # worker: grader handle -> its tensors as last reported
        self.sent: dict[int, tuple] = {}  # worker: grader handle -> a tensor or container as sent

    def adopt(self, h, obj) -> None:
        """Worker: `obj` is the copy of the grader's object `h` (by value or as a tensor)."""
        self.from_grader[h] = obj
        self.origin[id(obj)] = h
        if not isinstance(obj, torch.Tensor):
            self.copies[h] = obj
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            with _suppress():
                self.storage_origin[obj.untyped_storage().data_ptr()] = h

    def parameter(self, t: torch.Tensor, worker_handle=None) -> torch.nn.Parameter:
        """Grader: one Parameter per Parameter of the worker's (`worker_handle`), else per
        received tensor: a tied weight stays one object, two untied ones stay two."""
        key = ("w", worker_handle) if type(worker_handle) is int else id(t)
        if key not in self.params:
            self.params[key] = torch.nn.Parameter(t, requires_grad=t.requires_grad)
            self.objects[self.handle(t)] = t  # kept alive: its id stays its own
        return self.params[key]

    def handle(self, obj) -> int:
        h = self.ids.get(id(obj))
        if h is not None and self.objects.get(h) is obj:  # kept alive here: the id is still its
            return h
        h = len(self.objects) + 1
        self.objects[h] = obj
        self.ids[id(obj)] = h
        return h

    def lookup(self, h) -> object:
        if type(h) is not int or h not in self.objects:
            raise ProtocolError(f"unknown handle {h!r}")
        return self.objects[h]

    # values going out

    def encode(self, value, depth: int = 0):
        if depth > MAX_DEPTH:
            raise ValueError("a value nested too deeply to send")
        t = type(value)
        if t is Handle:
            return self.ref(value.obj)
        if self.side == "w" and id(value) in self.origin and not isinstance(value, torch.Tensor):
            h = self.origin[id(value)]
            if self.from_grader.get(h) is value or self.sent.get(h, (None,))[0] is value:
                # the grader's own object (or list, dict, set), back to it
                return {"t": "ref", "side": "p", "h": h, "type": _name(t)[:100]}
        if t is str and self.path_hook and value.startswith("/") and os.path.isfile(value):
            return self.path_hook(value)  # a file of the grader's, named in a string
        if value is None or t in (bool, int, str):
            return value
        if t is float:
            return (
                value
                if value == value and abs(value) != float("inf")
                else {"t": "float", "v": repr(value)}
            )
        if t in (list, tuple, set, frozenset):
            return self._mutable(
                value, {"t": t.__name__, "v": [self.encode(x, depth + 1) for x in value]}
            )
        if t is dict or t is collections.OrderedDict:
            return self._mutable(
                value,
                {
                    "t": "dict",
                    "v": [
                        [self.encode(k, depth + 1), self.encode(v, depth + 1)]
                        for k, v in value.items()
                    ],
                },
            )
        if t is torch.Tensor or t is torch.nn.Parameter:
            return self._tensor(value)
        if t is torch.dtype:
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if t is torch.device:
            return {"t": "device", "v": str(value)}
        if t is torch.Size:
            return {"t": "size", "v": list(value)}
        if t is slice:
            return {
                "t": "slice",
                "v": [self.encode(x, depth + 1) for x in (value.start, value.stop, value.step)],
            }
        if value is Ellipsis:
            return {"t": "ellipsis"}
        if self.side == "w" and isinstance(value, torch.Tensor):
            return {"t": "bad", "v": f"a {_name(t)}, a subclass of torch.Tensor"}
        if self.side == "p":
            if self.pickle is not None and value is not None:
                sent = self.pickle(value)
                if sent is not None:
                    return sent
            if isinstance(value, pathlib.PurePath) and self.path_hook:
                return {"t": "path", "v": self.path_hook(str(value))}
            if t is types.SimpleNamespace:
                return {
                    "t": "ns",
                    "v": {k: self.encode(v, depth + 1) for k, v in vars(value).items()},
                }
            if dataclasses.is_dataclass(value) and _package_path(t):
                fields = {
                    f.name: self.encode(getattr(value, f.name), depth + 1)
                    for f in dataclasses.fields(value)
                }
                return {"t": "obj", "cls": _package_path(t), "v": fields}
            if _package_path(value) and not isinstance(value, types.ModuleType):
                return {"t": "pkg", "v": _package_path(value)}
        if not self.export_ok(value):
            raise TypeError(f"a {_name(t)} cannot be passed to the other side")
        return self.ref(value)

    def _mutable(self, value, out: dict) -> dict:
        """Grader: a list, dict or set the learner's code may change: the worker says how."""
        if self.side == "p" and type(value) in MUTABLE:
            out["ph"] = self.handle(value)
        return out

    def ref(self, obj) -> dict:
        name = getattr(obj if isinstance(obj, type) else type(obj), "__name__", "object")
        return {"t": "ref", "side": self.side, "h": self.handle(obj), "type": str(name)[:100]}

    def _tensor(self, value: torch.Tensor) -> dict:
        if value.is_meta:  # made without device= while the default device was meta
            return {"t": "bad", "v": "a tensor on the meta device"}
        if value.layout != torch.strided or value.is_quantized:
            return {"t": "bad", "v": f"a {value.layout} tensor (expected a dense one)"}
        name = str(value.dtype).removeprefix("torch.")
        if name not in DTYPES:
            return {"t": "bad", "v": f"a tensor of dtype {value.dtype}"}
        out = {
            "t": "tensor",
            "dtype": name,
            "shape": list(value.shape),
            "grad": bool(value.requires_grad and value.is_leaf),
        }
        if self.side == "p":  # the worker may hand it back: it will say so ("ph")
            out["ph"] = self.handle(value)
        if self.side == "w":  # the grader may change it in place (p.fill_(1.0)): keep a way back
            out["h"] = self.handle(value)
            shared = self._storage(value)
            if shared is not None:  # its storage only (a view of few bytes stays few bytes)
                return out | shared
        data = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        out["data"] = base64.b64encode(raw).decode("ascii")
        return out

    def _storage(self, value: torch.Tensor) -> dict | None:
        """The worker's side of a tensor that crosses with its storage (see the module's doc);
        None where it crosses as a plain copy (a big, odd or exhausted case)."""
        if (
            value.device.type != "cpu"
            or value.dtype is torch.bool
            or value.is_conj()
            or value.is_neg()
        ):
            return None
        try:
            storage = value.detach().untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        nbytes, ptr = storage.nbytes(), storage.data_ptr()
        if not 0 < nbytes <= SHARED_STORAGE_MAX or ptr == 0:
            return None
        if ptr in self.storages and self.storages[ptr][1].nbytes() == nbytes:
            sid = self.storages[ptr][0]
        else:
            if self.storage_bytes + nbytes > SHARED_TOTAL_MAX:
                return None
            sid = len(self.storages) + 1
            self.storages[ptr] = (sid, storage)  # kept alive: its address stays its own
            self.storage_bytes += nbytes
        # device="cpu": this may run inside a call made with the default device set to meta
        raw = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage, 0, (nbytes,), (1,))
        extra = {"ph": self.storage_origin[ptr]} if ptr in self.storage_origin else {}
        return extra | {
            "sid": sid,
            "storage": base64.b64encode(raw.numpy().tobytes()).decode("ascii"),
            "offset": value.storage_offset(),
            "stride": list(value.stride()),
        }

    # values coming in

    def decode(self, value):
        """The value a message holds. On the grader's side, anything malformed (whatever the
        check that finds it) is a ProtocolError, which costs the submission that sent it."""
        if self.side == "w":
            return self._decode(value, 0)
        try:
            return self._decode(value, 0)
        except (ProtocolError, WrongType):
            raise
        except (TypeError, ValueError, OverflowError, IndexError, KeyError, RuntimeError) as e:
            raise ProtocolError(
                f"a malformed value ({type(e).__name__}: {_short(str(e))})"
            ) from None

    def _decode(self, value, depth: int):
        if depth > MAX_DEPTH:
            raise ProtocolError("a value nested too deeply")
        if value is None or type(value) in (bool, int, float, str):
            return value
        if type(value) is not dict or type(value.get("t")) is not str:
            raise ProtocolError(f"not a value: {_short(value)}")
        t, v = value["t"], value.get("v")
        if t in ("list", "tuple", "set", "frozenset"):
            _need(type(v) is list, value)
            items = [self._decode(x, depth + 1) for x in v]
            if t in ("set", "frozenset"):
                try:
                    items = set(items) if t == "set" else frozenset(items)
                except TypeError:
                    raise ProtocolError("an unhashable set element") from None
            elif t == "tuple":
                items = tuple(items)
            return self._arrived(value, items)
        if t == "dict":
            _need(type(v) is list and all(type(p) is list and len(p) == 2 for p in v), value)
            out = {}
            for k, x in v:
                key = self._decode(k, depth + 1)
                try:
                    out[key] = self._decode(x, depth + 1)
                except TypeError:
                    raise ProtocolError("an unhashable dict key") from None
            return self._arrived(value, out)
        if t == "float":
            _need(v in ("nan", "inf", "-inf"), value)
            return float(v)
        if t == "tensor":
            return self._decode_tensor(value)
        if t == "dtype":
            _need(type(v) is str and v in DTYPES, value)
            return DTYPES[v]
        if t == "device":
            _need(type(v) is str and v in ("cpu", "meta"), value)
            return torch.device(v)
        if t == "size":
            _need(_sizes(v), value)
            return torch.Size(v)
        if t == "slice":
            _need(type(v) is list and len(v) == 3, value)
            parts = [self._decode(x, depth + 1) for x in v]
            _need(all(x is None or type(x) is int for x in parts), value)
            return slice(*parts)
        if t == "ellipsis":
            return Ellipsis
        if t == "bad":
            raise WrongType(
                f"your code returned {_short(v, 200)}; "
                "return plain data (a torch.Tensor, numbers, lists)"
            )
        if t == "ref":
            h, side = value.get("h"), value.get("side")
            if side == self.side:
                return self.lookup(h)
            _need(side in ("w", "p") and type(h) is int, value)
            if h not in self.remotes:  # one object there, one stand-in here (identity holds)
                self.remotes[h] = self.remote(h, value.get("type"))
            return self.remotes[h]
        if self.side == "w" and t == "path":
            _need(type(v) is str, value)
            return pathlib.Path(v)
        if self.side == "w" and t == "val":
            from . import byvalue

            _need(type(v) is str, value)
            return byvalue.loads(v, self)
        if self.side == "w" and t in ("ns", "obj", "pkg"):
            return self._decode_object(t, value, depth)
        raise ProtocolError(f"unknown value type {t!r}")

    def _arrived(self, value: dict, obj):
        """Worker: a tensor, list, dict or set of the grader's: noted, to report its changes."""
        if self.side == "w" and type(value.get("ph")) is int and type(obj) in MUTABLE:
            from . import byvalue

            byvalue.track(self, value["ph"], obj)
        return obj

    def _decode_tensor(self, value: dict) -> torch.Tensor:
        if "sid" in value and self.side == "p":
            tensor = self._decode_view(value)
        else:
            tensor = self._decode_copy(value)
            if self.side == "w" and type(value.get("ph")) is int:
                self.adopt(value["ph"], tensor)
        if value.get("grad") is True and tensor.is_floating_point():
            tensor.requires_grad_(True)
        if "h" in value:
            _need(type(value["h"]) is int, value)
            self.mirrors[id(tensor)] = (value["h"], tensor, tensor._version)
        return self._arrived(value, tensor)

    def _decode_view(self, value: dict) -> torch.Tensor:
        """A tensor over a storage of the worker's: the grader's buffer for that storage, its
        bytes refreshed in place (tensors received earlier over it see them, as views would),
        and a view into it whose every element is inside the buffer."""
        dtype, shape, stride = value.get("dtype"), value.get("shape"), value.get("stride")
        sid, offset, data = value.get("sid"), value.get("offset"), value.get("storage")
        _need(_dtype(dtype) and DTYPES[dtype] is not torch.bool and type(data) is str, value)
        _need(type(sid) is int and type(offset) is int and 0 <= offset < MAX_DIM, value)
        _need(_sizes(shape) and _sizes(stride) and len(shape) == len(stride), value)
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError:
            raise ProtocolError("tensor data is not base64") from None
        _need(0 < len(raw) <= SHARED_STORAGE_MAX, value)
        dt = DTYPES[dtype]
        size = torch.empty((), dtype=dt).element_size()
        last = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n > 0)
        if all(n > 0 for n in shape):
            _need((last + 1) * size <= len(raw), value)
        else:
            _need(offset * size <= len(raw), value)
        numel = math.prod(shape)
        if numel * size > MAX_FRAME:  # a view of few bytes that would be gigabytes to compare
            raise WrongType(
                f"your code returned a tensor of shape {tuple(shape)} ({numel} elements, a view "
                f"of a smaller one); the grader takes tensors of at most {MAX_FRAME >> 20} MB"
            )
        dt_shape = (sid, dtype, offset, tuple(shape), tuple(stride))
        mine = self._grader_tensor(value.get("ph"), raw, dt, offset, shape, stride)
        if mine is not None:
            return mine
        new = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        buf = self.buffers.get(sid)
        if buf is None or buf.numel() != new.numel():
            buf = self.buffers[sid] = new  # a storage of another size: another buffer
        else:
            with torch.no_grad():
                buf.copy_(new)
        cached = self.tensor_cache.get(dt_shape)
        if cached is not None and cached.untyped_storage().data_ptr() == buf.data_ptr():
            return cached  # the same view of the same storage: the same tensor, as there
        view = torch.empty(0, dtype=dt, device="cpu").set_(
            buf.untyped_storage(), offset, shape, stride
        )
        self.tensor_cache[dt_shape] = view
        return view

    def _grader_tensor(self, ph, raw: bytes, dt, offset, shape, stride):
        """The worker says this tensor lies in the memory of a tensor the grader sent it (a
        parameter made of a tensor a check's callback returned): believed only if that memory
        holds exactly the grader's bytes; then it is a view of the grader's own tensor."""
        if type(ph) is not int or ph not in self.objects:
            return None
        g = self.objects[ph]
        if type(g) not in (torch.Tensor, torch.nn.Parameter) or g.dtype != dt:
            return None
        if g.is_meta or not g.is_contiguous() or g.device.type != "cpu":
            return None
        data = g.detach().reshape(-1)
        mine = data.view(torch.uint8) if data.numel() else data
        if mine.numel() != len(raw) or not torch.equal(
            mine, torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        ):
            return None
        if offset == 0 and list(g.shape) == shape and list(g.stride()) == stride:
            return g
        base = g.storage_offset()
        empty = torch.empty(0, dtype=dt, device="cpu")
        return empty.set_(g.untyped_storage(), base + offset, shape, stride)

    def _decode_copy(self, value: dict) -> torch.Tensor:
        dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
        _need(_dtype(dtype) and type(data) is str, value)
        _need(_sizes(shape), value)
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError:
            raise ProtocolError("tensor data is not base64") from None
        numel = 1
        for n in shape:
            numel *= n
        dt = DTYPES[dtype]
        size = torch.empty((), dtype=dt).element_size()
        _need(len(raw) == numel * size, value)
        if numel == 0:  # on the CPU whatever the default device (a check may set it)
            tensor = torch.empty(shape, dtype=dt, device="cpu")
        elif dt is torch.bool:
            tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).ne(0).reshape(shape)
        else:
            tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)
        return tensor

    def _decode_object(self, t: str, value: dict, depth: int):
        v = value.get("v")
        if t == "pkg":
            _need(type(v) is str, value)
            return resolve(v)
        _need(type(v) is dict and all(type(k) is str for k in v), value)
        fields = {k: self._decode(x, depth + 1) for k, x in v.items()}
        if t == "ns":
            return types.SimpleNamespace(**fields)
        cls = resolve(value.get("cls"))
        obj = object.__new__(cls)
        obj.__dict__.update(fields)
        return obj


def _suppress():
    import contextlib

    return contextlib.suppress(RuntimeError, NotImplementedError)


def _dtype(name) -> bool:
    return type(name) is str and name in DTYPES


def _sizes(v) -> bool:
    """A tensor's shape or strides as sent: at most 16 ints, each in [0, MAX_DIM), whose
    product torch can hold."""
    if (
        type(v) is not list
        or len(v) > 16
        or not all(type(x) is int and 0 <= x < MAX_DIM for x in v)
    ):
        return False
    product = 1
    for x in v:
        product *= max(x, 1)
    return product < 2**62


def _need(ok: bool, value) -> None:
    if not ok:
        raise ProtocolError(f"malformed value {_short(value)}")


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _name(t: type) -> str:
    return f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', '?')}"


def _package_path(obj) -> str:
    """`qwen_mini.x.y` if `obj` is a module-level object of the package (not of the course)."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(name, str) or "." in name:
        return ""
    if module.split(".")[0] != "qwen_mini" or module.startswith("qwen_mini.course"):
        return ""
    found = getattr(sys.modules.get(module), name, None)
    return f"{module}.{name}" if found is obj else ""


def resolve(path) -> object:
    """The package object at `qwen_mini.module.name`, among modules already imported."""
    if type(path) is not str or "." not in path:
        raise ProtocolError(f"bad import path {path!r}")
    module, name = path.rsplit(".", 1)
    if module.split(".")[0] != "qwen_mini" or module not in sys.modules:
        raise ProtocolError(f"not a package object: {path!r}")
    try:
        return getattr(sys.modules[module], name)
    except AttributeError:
        raise ProtocolError(f"not a package object: {path!r}") from None
