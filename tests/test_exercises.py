"""check() / use() and the assertion helpers, on the test-only chapter 99 (tests/fixtures)."""

import re
from pathlib import Path

import pytest
import torch

from qwen_mini.course import checking as ex

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def fixture_chapter(monkeypatch):
    """Chapter 99's checks, for this file's tests only: set at import, the path reached every
    later test of the process and the kernels and jails they start."""
    monkeypatch.setenv(ex.PATH_ENV, str(FIXTURES / "checks"))


def add_one(x):
    return x + 1


def add_two(x):  # wrong: the package reference is right, so a pass would mean it tested that
    return x + 2


def add_one_float(x):  # passes the public checks, fails the hidden one (int dtype)
    return x + 1.0


def not_yet(x):
    raise NotImplementedError("ch99.add_one: replace this line with your code")


def crashes(x):
    return x.no_such_method()


@pytest.fixture(params=["learner", "solutions", "course"])
def mode(request, monkeypatch):
    monkeypatch.setenv("QWEN_MINI_CHECKS", request.param)
    return request.param


@pytest.fixture
def learner(monkeypatch):
    monkeypatch.delenv("QWEN_MINI_CHECKS", raising=False)


def test_pass_prints_the_count(learner, capsys):
    assert ex.check("ch99.add_one", add_one)
    assert capsys.readouterr().out == "✓ ch99.add_one: passed 2/2 public checks\n"


def test_wrong_object_fails_although_the_reference_is_right(learner, capsys):
    assert not ex.check("ch99.add_one", add_two)
    out = capsys.readouterr().out
    assert out.startswith("✗ ch99.add_one: public check 1 failed: add_one([1, 2]): expected 2")
    assert "got 3 (2 of 2 values differ)" in out and out.count("\n") == 1


def test_not_implemented(learner, capsys):
    assert not ex.check("ch99.add_one", not_yet)
    assert capsys.readouterr().out == "○ ch99.add_one: not implemented yet\n"


def test_learner_mode_never_raises(learner, capsys):
    assert not ex.check("ch99.add_one", crashes)
    assert "your code raised AttributeError" in capsys.readouterr().out
    assert not ex.check("ch99.no_such_exercise", add_one)
    assert "unknown exercise 'ch99.no_such_exercise'" in capsys.readouterr().out
    assert not ex.check("ch99.add_one", 42)  # not even callable


@pytest.mark.parametrize(
    "obj, status", [(add_one, "passed"), (add_two, "failed"), (not_yet, "not-implemented")]
)
def test_modes(mode, obj, status, capsys):
    raises = {
        "learner": False,
        "solutions": status != "passed",
        "course": status != "not-implemented",
    }
    if raises[mode]:
        with pytest.raises(ex.CheckError, match=f"QWEN_MINI_CHECKS={mode}"):
            ex.check("ch99.add_one", obj)
    else:
        assert bool(ex.check("ch99.add_one", obj)) is (status == "passed")


def test_unknown_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("QWEN_MINI_CHECKS", "strict")
    with pytest.raises(ValueError, match="learner, solutions, course"):
        ex.check("ch99.add_one", add_one)


def test_hidden_checks_only_when_asked():
    assert ex.run_checks("ch99.add_one", add_one_float).ok
    result = ex.run_checks("ch99.add_one", add_one_float, hidden=True)
    assert result.status == "failed" and "keeps integers integer" in result.message
    assert (result.passed, result.total) == (2, 3)


def test_checks_leave_the_learners_random_state_alone(learner, capsys):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ex.check("ch99.mean_square", lambda x, dim=-1: x.pow(2).mean(dim))
    assert torch.equal(torch.rand(3), expected)


def test_use_falls_back_to_the_reference(learner, capsys):
    class Scale:
        def __init__(self, factor):
            self.factor = factor

        def __call__(self, x):
            return x * self.factor

    class Broken(Scale):
        def __call__(self, x):
            return x

    assert ex.use("ch99.Scale", Scale) is Scale
    assert "using your ch99.Scale" in capsys.readouterr().out
    assert ex.use("ch99.Scale", Broken) is ex.reference("ch99.Scale")
    assert "using the package's ch99.Scale: yours is not passing yet" in capsys.readouterr().out
    # a second use() of the name that now holds the package's copy must not call it "yours"
    fallback = ex.use("ch99.Scale", Broken)
    assert ex.use("ch99.Scale", fallback) is fallback
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "→ using the package's ch99.Scale"


def test_registry():
    assert [e.id for e in ex.exercises("ch99")] == [
        "ch99.add_one",
        "ch99.mean_square",
        "ch99.Scale",
    ]
    assert ex.get("ch99.mean_square").points == 2


def test_expect_close_messages():
    with pytest.raises(AssertionError) as info:
        ex.expect_close("y", torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), atol=1e-3, rtol=0)
    assert str(info.value) == (
        "y: expected 2 at index [1], got 2.5 (max abs diff 0.5; tolerance 0.001 + 0·|expected|)"
    )
    with pytest.raises(AssertionError, match=r"expected shape \(2, 3\), got \(3, 2\)"):
        ex.expect_close("y", torch.zeros(3, 2), torch.zeros(2, 3))
    with pytest.raises(AssertionError, match="got None"):
        ex.expect_close("y", None, torch.zeros(2))
    with pytest.raises(AssertionError, match="got nan"):
        ex.expect_close("y", torch.tensor([float("nan")]), torch.tensor([0.0]))
    with pytest.raises(AssertionError, match="expected dtype torch.float32, got torch.bfloat16"):
        ex.expect_close("y", torch.tensor([1.0]).bfloat16(), torch.tensor([1.0]))


class Odd(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "got, expected, words",
    [
        (float("nan"), 1.0, "got nan"),  # abs(nan - 1) > tol is False: NaN must not slip through
        (float("inf"), 1.0, "got inf"),
        (torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), "got nan"),
        (torch.tensor(1.0), 1.0, "expected a Python number, got Tensor"),
        (torch.ones(2).as_subclass(Odd), torch.ones(2), "expected a tensor, got Odd"),
        (
            (torch.ones(2),),
            (torch.ones(2), torch.ones(2)),
            "expected 2 values, got tuple of length 1",
        ),
        ({"a": torch.ones(1)}, {"a": torch.ones(1), "b": torch.ones(1)}, "the key 'b' is missing"),
        ({"a": 1, "c": 2}, {"a": 1}, "unexpected key 'c'"),
        ("3", 3, "expected a Python number, got str"),
        (True, 1, "expected a Python number, got bool"),
    ],
)
def test_the_one_comparison_refuses(got, expected, words):
    with pytest.raises(AssertionError, match=re.escape(words)):
        ex.expect_close("y", got, expected, atol=1e-3, rtol=0)


def test_nan_matches_only_an_expected_nan():
    nan = torch.tensor([1.0, float("nan")])
    ex.expect_close("y", nan, nan.clone())
    ex.expect_close("y", [1.0, (2, 3)], (1.0, [2, 3]))  # lists and tuples are the same answer
    with pytest.raises(AssertionError, match=re.escape("n: expected 3, got 3.0")):
        ex.expect_equal("n", 3.0, 3)  # a count is an int


def _twice(x):
    return 2 * x


def _squared(x):
    return x * x


def _past_the_end(x):
    return x + x[len(x)]


@pytest.fixture(scope="module", autouse=True)
def _chapter_97():
    """A made-up exercise, registered only while this file's tests run: registered at import,
    it would be an earlier chapter of every fixture chapter graded in the same process."""
    ex.register("ch97.twice", reference=_twice, title="Twice")
    ex.case("ch97.twice", "a vector", lambda g: (ex.randn(4, g=g),), atol=1e-6)
    ex.case(
        "ch97.twice",
        "hand-derived",
        lambda g: (torch.ones(3),),
        expected=lambda x: torch.full((3,), 2.0),
    )
    ex.case(
        "ch97.twice", "other sizes", lambda g: (ex.randn(ex.between(g, 1, 9), g=g),), hidden=True
    )
    ex.mistake("ch97.twice", "squared: twice means x + x")(_squared)
    ex.mistake("ch97.twice", "indexed past the end: the last item is x[len(x) - 1]")(_past_the_end)
    yield
    del ex._EXERCISES["ch97.twice"]


def test_a_case_names_the_mistake_the_answer_matches():
    result = ex.run_checks("ch97.twice", _squared)
    assert result.message == "a vector failed: squared: twice means x + x"
    result = ex.run_checks("ch97.twice", lambda x: 3 * x)  # no catalogued mistake: the values
    assert result.message.startswith("a vector failed: twice: expected ")
    assert ex.run_checks("ch97.twice", lambda x: x + x, hidden=True).ok
    assert [m.name for m in ex.catalogue("ch97")] == ["_squared", "_past_the_end"]


def test_a_mistake_is_named_only_when_it_is_the_answer_on_every_case():
    """An answer that agrees with a mistake on the failing case by chance, and not on the
    exercise's other cases, is described (which value, where), not given the mistake's idea."""

    def squared_for_four(x):  # the mistake's result on "a vector", 3 x on "hand-derived"
        return x * x if x.numel() == 4 else 3 * x

    result = ex.run_checks("ch97.twice", squared_for_four)
    assert result.message.startswith("a vector failed: twice: expected "), result.message
    assert "squared" not in result.message


def test_a_crash_is_named_by_the_mistake_that_crashes_alike():
    def past_the_end(x):
        return 2 * x[x.shape[0]]

    result = ex.run_checks("ch97.twice", past_the_end)
    assert result.message.startswith("a vector failed: your code raised IndexError: "), result
    assert result.message.endswith("; indexed past the end: the last item is x[len(x) - 1]")
    other = ex.run_checks("ch97.twice", lambda x: x.no_such_method())  # crashes otherwise
    assert "AttributeError" in other.message and "indexed past" not in other.message


def test_values_without_a_name_are_the_result_and_long_lists_are_shortened():
    with pytest.raises(AssertionError, match=r"^the result: expected 2, got 3$"):
        ex.expect_equal("", 3, 2)
    with pytest.raises(AssertionError, match=r"^the result\[1\]: expected 2, got 3 "):
        ex.expect_equal("", (1, 3.0), (1, 2.0))
    expected, got = list(range(40)), list(range(40))
    got[7] = 99
    with pytest.raises(AssertionError) as raised:
        ex.expect_equal("ids", got, expected)
    message = str(raised.value)
    assert message.startswith("ids: first difference at position 7 of 40: expected 7, got 99")
    assert "(40 items in all)" in message and len(message) < 400, message
    with pytest.raises(AssertionError, match=r"^ids: expected 40 items, got 45: the first 40"):
        ex.expect_equal("ids", expected + [1, 2, 3, 4, 5], expected)


def test_hidden_inputs_come_from_the_secret_public_ones_do_not():
    seen = []

    def spy(x):
        seen.append(x.clone())
        return 2 * x

    ex.run_checks("ch97.twice", spy, hidden=True)
    ex.new_secret()
    ex.run_checks("ch97.twice", spy, hidden=True)
    public_1, _, hidden_1, public_2, _, hidden_2 = seen
    assert torch.equal(public_1, public_2)
    assert not (hidden_1.shape == hidden_2.shape and torch.equal(hidden_1, hidden_2))


def test_expect_equal_messages():
    ex.expect_equal("n", 3, 3)
    with pytest.raises(AssertionError, match=r"^shape: expected \(1, 2\), got \(2, 1\)$"):
        ex.expect_equal("shape", (2, 1), (1, 2))
    with pytest.raises(AssertionError, match="1 of 2 values differ"):
        ex.expect_equal("ids", torch.tensor([1, 2]), torch.tensor([1, 3]))


def _memory_error(x):
    raise MemoryError()  # what a huge allocation raises: an exception with no text


def test_an_exception_without_text_is_named_alone():
    assert ex.exception_text(MemoryError()) == "MemoryError"
    assert ex.exception_text(ValueError("  ")) == "ValueError"
    assert ex.exception_text(ValueError("bad size")) == "ValueError: bad size"
    assert ex.exception_text(ValueError("x" * 900), 10) == "ValueError: " + "x" * 10
    message = ex.run_checks("ch99.add_one", _memory_error).message
    assert "your code raised MemoryError" in message and "MemoryError:" not in message, message


def test_a_header_reader_that_runs_out_of_memory_is_named_without_an_empty_text(tmp_path):
    """Chapter 0's header reader explains the 8-byte prefix after the learner's exception; one
    with no text reads "raised MemoryError. The first 8 bytes…", never "MemoryError: ."."""
    message = ex.run_checks("ch00.read_safetensors_header", lambda path: _memory_error(path))
    assert "your code raised MemoryError. " in message.message, message.message
    assert ": ." not in message.message


def test_the_command_line_names_an_exception_without_text(monkeypatch, capsys):
    from qwen_mini import cli

    def run(argv):
        raise MemoryError()

    monkeypatch.setattr(cli, "run", run)
    assert cli.main(["doctor"]) == 1
    assert capsys.readouterr().err == "qwen-mini: error: MemoryError\n"
