"""The grader's channel on its own: what the sandbox sends is rebuilt as plain data of exact types,
and anything else is refused, never trusted (no sandbox started here)."""

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
    (h, tensor, version) = grader.mirrors[0]
    assert worker.lookup(h) is p and tensor is got and version == got._version


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
