"""What the learner's code does to a check's arguments comes back to the grader, in-process: the
grader's codec ("p") encodes, the worker's ("w") decodes, the learner's code changes what it got,
and the worker's report, applied by the grader, leaves the grader's objects as the notebook
would have them. The real grader runs these through a socket (tests/test_grade_wrong_answers.py).
"""

import pytest
import torch

from qwen_mini.course import observing
from qwen_mini.course.grading import byvalue
from qwen_mini.course.grading.protocol import Codec


def _pair():
    return Codec("p", lambda h, t: ("remote", h)), Codec("w", lambda h, t: ("parent", h))


def _call(grader, worker, args, learner):
    """`learner(*args)` in the worker; its changes applied to the grader's `args`."""
    got = worker.decode(grader.encode(args))
    out = learner(*got)
    changes = byvalue.changed_arguments(worker)
    encoded = worker.encode(out)
    byvalue.apply_arguments(grader, changes, grader.decode)
    return grader.decode(encoded)


def test_a_tensor_written_in_place_comes_back():
    grader, worker = _pair()
    x = torch.arange(6.0).reshape(2, 3)
    view = x[0]  # the check's other names for the same memory see it too

    def scale(t):
        t *= 2
        return t

    out = _call(grader, worker, (x,), scale)
    assert torch.equal(x, torch.arange(6.0).reshape(2, 3) * 2)
    assert torch.equal(view, torch.tensor([0.0, 2.0, 4.0]))
    assert torch.equal(out, x)


def test_dicts_lists_and_sets_come_back_at_any_depth_and_stay_the_graders():
    grader, worker = _pair()
    inner = [1, 2]
    message = {"role": "assistant", "reasoning_content": "r", "list": inner}
    seen = {1}

    def learner(m, s):
        del m["reasoning_content"]
        m["list"].append(3)
        s.add(2)
        return m

    out = _call(grader, worker, (message, seen), learner)
    assert message == {"role": "assistant", "list": [1, 2, 3]} and inner == [1, 2, 3]
    assert message["list"] is inner and seen == {1, 2}
    assert out is message  # handed back, the grader's own dict, as in the notebook


def test_nothing_changed_nothing_reported():
    grader, worker = _pair()
    x, d = torch.ones(3), {"a": [1]}
    got = worker.decode(grader.encode((x, d)))
    got[0].add_(0)  # written with the values it had
    assert byvalue.changed_arguments(worker) == []


def test_writing_into_a_parameter_the_check_passed_is_refused():
    grader, worker = _pair()
    w = torch.nn.Parameter(torch.ones(2))
    _call(grader, worker, (w,), lambda t: t.data.mul_(1))  # the values it had: no change
    with pytest.raises(AssertionError, match="parameter the check passed in"):
        _call(grader, worker, (w,), lambda t: t.data.mul_(3))
    assert torch.equal(w.detach(), torch.ones(2))


def test_two_parameters_sharing_a_tensor_stay_two_one_parameter_stays_one():
    grader = Codec("p", lambda h, t: ("remote", h))
    t = torch.ones(2)
    a, b = grader.parameter(t, 1), grader.parameter(t, 2)
    assert a is not b and a.data_ptr() == b.data_ptr()  # a head that was not tied again
    assert grader.parameter(t, 1) is a  # the tied one: one Parameter in both modules


def test_observations_in_the_notebook():
    q = torch.randn(2, 3, dtype=torch.bfloat16)
    with observing.observe("softmax_dtypes") as seen:
        q.softmax(-1)
        q.float().softmax(-1)
        torch.softmax(q, -1, dtype=torch.float32)
    assert seen.value == [torch.bfloat16, torch.float32, torch.float32]
    with observing.observe("peak_memory") as seen:
        data = bytearray(8 * 2**20)
    assert 8 * 2**20 <= seen.value < 16 * 2**20 and data
    with pytest.raises(KeyError, match="unknown observation"):
        with observing.observe("time"):
            pass


def test_observations_in_the_grader_are_asked_of_the_sandbox():
    asked = []

    def request(message):
        asked.append(message)
        return 7 if message["op"] == "observe" else [torch.float32]

    with observing.sandboxed(request):
        with observing.observe("softmax_dtypes") as seen:
            pass
    assert seen.value == [torch.float32]
    assert asked == [{"op": "observe", "kind": "softmax_dtypes"}, {"op": "unobserve", "i": 7}]
