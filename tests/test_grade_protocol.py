"""The grader's channel on its own: what the sandbox sends is rebuilt as plain data of exact types,
and anything else is refused, never trusted (no sandbox started here)."""

import base64
import socket

import pytest
import torch

from qwen_mini.course.grading import protocol
from qwen_mini.course.grading.protocol import Codec, ProtocolError, WrongType


class Stand:  # what the grader builds for a handle to one of the worker's objects
    def __init__(self, h, type_name):
        self.h, self.type_name = h, type_name


def _pair():
    worker = Codec("w", lambda h, t: ("parent object", h))
    grader = Codec("p", Stand)
    return worker, grader


def test_plain_values_cross_as_themselves():
    worker, grader = _pair()
    value = {
        "a": [1, 2.5, None, True, "x\udc80"],
        "t": (torch.tensor([[1.0, float("nan")]]), torch.arange(3), torch.zeros(0, 2)),
        "d": torch.bfloat16,
        "s": torch.Size([2, 3]),
        "n": float("inf"),
        "set": {1, 2, "three"},
        "frozen": frozenset({(1, 2)}),
    }
    got = grader.decode(worker.encode(value))
    assert got["a"] == value["a"] and got["d"] is torch.bfloat16 and got["s"] == torch.Size([2, 3])
    assert got["n"] == float("inf")
    assert type(got["set"]) is set and got["set"] == value["set"]
    assert type(got["frozen"]) is frozenset and got["frozen"] == value["frozen"]
    for g, v in zip(got["t"], value["t"], strict=True):
        assert type(g) is torch.Tensor and g.dtype == v.dtype and g.shape == v.shape
        assert torch.equal(g.nan_to_num(7), v.nan_to_num(7))


def test_a_parameter_crosses_as_a_plain_tensor_that_can_be_written_back():
    worker, grader = _pair()
    p = torch.nn.Parameter(torch.ones(3))
    got = grader.decode(worker.encode(p))
    assert type(got) is torch.Tensor and torch.equal(got, torch.ones(3))
    [(h, tensor, version)] = grader.mirrors.values()
    assert worker.lookup(h) is p and tensor is got and version == got._version
    # sent again (a check reading one weight a thousand times): the same tensor here, watched
    # once, not once for every time it arrived
    for _ in range(3):
        assert grader.decode(worker.encode(p)) is got
    assert list(grader.mirrors.values()) == [(h, got, got._version)]


def test_a_tensor_subclass_is_a_wrong_answer():
    class Agree(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return True

    worker, grader = _pair()
    with pytest.raises(WrongType, match="subclass of torch.Tensor"):
        grader.decode(worker.encode(torch.zeros(2).as_subclass(Agree)))


def test_objects_with_their_own_equality_cross_as_handles():
    class Yes(int):
        def __eq__(self, other):
            return True

    worker, grader = _pair()
    got = grader.decode(worker.encode([Yes(3), object()]))
    assert all(type(x) is Stand for x in got)
    assert got[0] != 3  # the grader never runs the learner's __eq__


@pytest.mark.parametrize(
    "value",
    [
        {"t": "tensor", "dtype": "float32", "shape": [2], "data": "AAAA"},  # 3 bytes, not 8
        {"t": "tensor", "dtype": "object", "shape": [1], "data": ""},
        {"t": "tensor", "dtype": "float32", "shape": [-1], "data": ""},
        {"t": "dict", "v": [[{"t": "list", "v": []}, 1]]},  # unhashable key
        {"t": "ref", "side": "w", "h": "x"},
        {"t": "ref", "side": "p", "h": 99},  # a handle the grader never gave
        {"t": "pkg", "v": "os.system"},  # never imported on the grader's side from the worker
        {"t": "size", "v": [1, "2"]},
        {"t": "nope"},
        [1, 2],
    ],
)
def test_malformed_values_are_protocol_errors(value):
    _, grader = _pair()
    with pytest.raises(ProtocolError):
        grader.decode(value)


def _storage(n: int) -> str:
    return base64.b64encode(bytes(n)).decode()


def _copy(shape, data=8, dtype="float32"):
    return {"t": "tensor", "dtype": dtype, "shape": shape, "data": _storage(data)}


def _view(shape, stride, offset=0, storage=16, dtype="float32"):
    fields = {"shape": shape, "stride": stride, "sid": 1, "offset": offset}
    return {"t": "tensor", "dtype": dtype, "storage": _storage(storage), **fields}


FORGED = {  # tensors a submission's patched worker can send: none is a tensor
    "negative": [_copy([-1]), _copy([2, -4]), _view([-1], [1]), _view([2], [-1])]
    + [_view([1], [1], -1)],
    "huge": [_copy([2**63, 0]), _copy([0, 2**64]), _copy([2**80]), _view([2**64, 0], [1, 1])]
    + [_view([1], [2**63]), _view([1], [1], 2**70), _copy([2**40, 2**40, 0])],
    "product overflow": [_copy([2**31, 2**31, 2**31, 0]), _view([2**30] * 3 + [0], [1] * 4)]
    + [_copy([2**39] * 2, data=0), {"t": "size", "v": [2**63]}, {"t": "size", "v": [2**40] * 2}],
    "not an int": [_copy([1.5]), _copy(["2"]), _copy([True]), _copy([None]), _copy(2)]
    + [_copy({"a": 1}), _view([2.0], [1]), _view([2], [1.0]), _view([1], [1], 0.0)],
    "bytes and dtype disagree": [_copy([2], data=7), _copy([1], dtype="float64", data=4)]
    + [_copy([3], dtype="bool", data=4), _view([3], [1], dtype="bfloat16", storage=5)]
    + [_view([4], [1], offset=1, storage=16), _view([3], [2], storage=16)],
    "not a dtype": [_copy([2], dtype=["float32"]), _copy([2], dtype={"t": 1})]
    + [_view([2], [1], dtype=["float64"]), {"t": "dtype", "v": ["x"]}, {"t": "device", "v": [1]}],
}


@pytest.mark.parametrize(
    "kind, value", [(kind, v) for kind, values in FORGED.items() for v in values]
)
def test_forged_tensors_are_protocol_errors(kind, value):
    _, grader = _pair()
    with pytest.raises(ProtocolError):
        grader.decode(value)
    with pytest.raises(ProtocolError):  # also inside a container, at any depth
        grader.decode({"t": "list", "v": [1, {"t": "tuple", "v": [value]}]})


def test_the_bounds_let_real_tensors_through():
    worker, grader = _pair()
    base = torch.arange(12.0).reshape(3, 4)
    for t in (base, base.t(), base[:, 1:3], base[1:, ::2], torch.zeros(0, 2**20), base[2:3]):
        got = grader.decode(worker.encode(t))
        assert got.shape == t.shape and torch.equal(got, t)


def test_frames_are_validated():
    a, b = socket.socketpair()
    with a, b:
        protocol.send(a, {"op": "x", "text": "\udc80"})
        assert protocol.receive(b) == {"op": "x", "text": "\udc80"}
        a.sendall(b"\x00\x00\x00\x05hello")
        with pytest.raises(ProtocolError):
            protocol.receive(b)
        a.sendall(b"\xff\xff\xff\xff")
        with pytest.raises(ProtocolError):
            protocol.receive(b)
        a.sendall(b"\x00\x00\x00\x02[]")
        with pytest.raises(ProtocolError):
            protocol.receive(b)


# --- by value (grader -> worker) and storages (worker -> grader): the new surface ---------------


def _linked():
    """A grader codec that sends modules by value, and the worker codec that reads them."""
    from qwen_mini.course.grading import byvalue

    worker = Codec("w", lambda h, t: ("parent object", h))
    grader = Codec("p", Stand)
    grader.is_remote = lambda obj: type(obj) is Stand
    grader.pickle = lambda obj: (
        {"t": "val", "v": byvalue.dumps(obj, grader, grader.is_remote)}
        if byvalue.by_value(obj)
        else None
    )
    return worker, grader


def test_the_grader_never_unpickles_what_the_worker_sends(tmp_path):
    import base64
    import os
    import pickle

    planted = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {planted}",))

    _, grader = _linked()
    data = base64.b64encode(pickle.dumps(Boom())).decode()
    for value in ({"t": "val", "v": data}, {"t": "pkg", "v": "qwen_mini.x.y"}):
        with pytest.raises(ProtocolError):
            grader.decode(value)
    assert not planted.exists()


def test_a_module_by_value_comes_back_as_the_graders_own_object():
    from qwen_mini.course.grading import byvalue

    worker, grader = _linked()
    layer = torch.nn.Linear(2, 2)
    copy = worker.decode(grader.encode(layer))
    assert type(copy) is torch.nn.Linear and copy is not layer
    assert torch.equal(copy.weight, layer.weight)
    assert grader.decode(worker.encode([copy, copy.weight]))[0] is layer
    h = grader.handle(layer)
    # the learner's code changes the weights of the check's module: refused when applied, also
    # when written through .data (whose version counter is not the parameter's)
    for zero in (lambda p: p.zero_(), lambda p: p.data.zero_()):
        copy = worker.decode(grader.encode(layer))  # (sent again: as the grader has it)
        # its weights go back once (the grader then watches them for its own changes in
        # place), then only when changed
        first = [[h, worker.encode(byvalue.state_of(worker, h, copy))]]
        assert set(grader.decode(first[0][1])["params"]) == {"weight", "bias"}
        byvalue.apply_state(grader, first, grader.decode)
        assert byvalue.state_of(worker, h, copy)["params"] == {}
        with torch.no_grad():
            zero(copy.weight)
        state = [[h, worker.encode(byvalue.state_of(worker, h, copy))]]
        with pytest.raises(AssertionError, match="changed weight"):
            byvalue.apply_state(grader, state, grader.decode)
        assert layer.weight.abs().sum() > 0


def test_a_meta_module_may_be_filled_and_records_come_back():
    from qwen_mini.course.grading import byvalue

    worker, grader = _linked()
    with torch.device("meta"):
        target = torch.nn.Linear(2, 2, bias=False)
    copy = worker.decode(grader.encode(target))
    given = worker.decode(grader.encode(torch.ones(2, 2)))  # what a check's callback returned
    copy.load_state_dict({"weight": given}, assign=True)
    h = grader.handle(target)
    state = [[h, worker.encode(byvalue.state_of(worker, h, copy))]]
    byvalue.apply_state(grader, state, grader.decode)
    assert type(target.weight) is torch.nn.Parameter and torch.equal(
        target.weight, torch.ones(2, 2)
    )


def test_a_package_state_may_change_its_tensors_and_numbers_only():
    from qwen_mini.attention import KVCache
    from qwen_mini.course.grading import byvalue

    worker, grader = _linked()
    cache = KVCache(1, 2, 4, dtype=torch.float32)
    h = grader.handle(cache)
    copy = worker.decode(grader.encode(cache))
    assert type(copy) is KVCache and copy is not cache
    copy.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    copy.commit(3)
    state = [[h, worker.encode(byvalue.state_of(worker, h, copy))]]
    byvalue.apply_state(grader, state, grader.decode)
    assert cache.length == 3 and torch.equal(cache.k[:, :, :3], torch.ones(1, 2, 3, 4))
    copy.length = [3]  # not a number: refused
    state = [[h, worker.encode(byvalue.state_of(worker, h, copy))]]
    with pytest.raises(AssertionError, match="changed length"):
        byvalue.apply_state(grader, state, grader.decode)


def test_a_worker_object_cannot_replace_an_attribute_of_the_graders():
    from qwen_mini.course.grading import byvalue

    worker, grader = _linked()
    module = torch.nn.Linear(2, 2)
    module.helper = types_ns = __import__("types").SimpleNamespace(a=1)
    copy = worker.decode(grader.encode(module))
    copy.helper = object.__new__(type("Evil", (), {}))  # a learner's object
    h = grader.handle(module)
    state = [[h, worker.encode(byvalue.state_of(worker, h, copy))]]
    with pytest.raises(AssertionError, match="changed helper"):
        byvalue.apply_state(grader, state, grader.decode)
    assert module.helper is types_ns


def test_views_share_their_storage_and_forged_ones_are_refused():
    worker, grader = _pair()
    buf = torch.arange(12.0).reshape(3, 4)
    a = grader.decode(worker.encode(buf[:2]))
    b = grader.decode(worker.encode(buf))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert type(a) is torch.Tensor and torch.equal(b, buf)
    message = worker.encode(buf)
    message["stride"] = [400, 1]  # reaches past the storage it sent
    with pytest.raises(ProtocolError):
        grader.decode(message)


def test_a_claim_to_be_the_graders_tensor_needs_its_exact_bytes():
    worker, grader = _linked()
    mine = torch.arange(4.0)
    copy = worker.decode(grader.encode(mine))
    assert grader.decode(worker.encode(copy)) is mine  # untouched: the grader's own tensor
    copy.add_(1)  # changed in the worker: a copy with the new values, never the grader's
    got = grader.decode(worker.encode(copy))
    assert got is not mine and torch.equal(got, torch.arange(4.0) + 1)
    assert torch.equal(mine, torch.arange(4.0))
