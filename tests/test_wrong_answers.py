"""Every chapter's catalogue of typical mistakes (written once, next to its exercise's cases in
qwen_mini/course/checks/chNN.py): each mistake fails the public checks, the ones a learner runs in
the notebook, with the idea it gets wrong as the message (unless marked public=False), and fails
when grading (hidden cases too); each reference passes every case. Wrong answers that are not
functions of an exercise's signature (whole notebooks, hostile objects), and those of the exercises
still checked by functions, stay in test_wrong_answers_chNN.py."""

import pytest
import torch

from qwen_mini.course import checking

CHAPTERS = ["ch00", "ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07"]
EXERCISES = [e for chapter in CHAPTERS for e in checking.exercises(chapter)]
# every catalogued mistake (exercise_id, name, fn, idea, public): data for other tests too
CATALOGUE = [m for chapter in CHAPTERS for m in checking.catalogue(chapter)]


@pytest.mark.parametrize("m", CATALOGUE, ids=lambda m: f"{m.exercise_id}-{m.name}")
def test_mistake_fails_publicly_with_its_idea(m):
    public = checking.run_checks(m.exercise_id, m.fn)
    if m.public:
        assert public.status == "failed", public.line()
        assert m.idea in public.message, public.message
    else:  # a mistake the chapter does not warn about: the hidden cases catch it
        assert public.ok, public.line()
    graded = checking.run_checks(m.exercise_id, m.fn, hidden=True)
    assert graded.status == "failed", graded.line()


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_reference_passes_every_case_and_has_mistakes(exercise):
    result = checking.run_checks(exercise.id, exercise.reference, hidden=True)
    assert result.ok, result.line()
    assert exercise.hidden, f"{exercise.id} has no hidden case"
    assert exercise.mistakes, f"{exercise.id} has no catalogued mistake"


def test_softmax_in_bfloat16_really_differs():
    """Chapter 3's float32 warning is not pedantry: weights from a bfloat16 softmax differ from
    the float32 ones after the cast."""
    wrong = checking.get("ch03.route").mistakes["route_softmax_in_bfloat16"].fn
    logits = (torch.randn(64, 16, generator=torch.Generator().manual_seed(2)) * 2).bfloat16()
    assert (
        checking.reference("ch03.route")(logits, 4, True)[0] != wrong(logits, 4, True)[0]
    ).sum() > 10


def _nan(value, seen: list):
    """`value` with every floating-point tensor in it replaced by NaNs (noted in `seen`)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        seen.append(True)
        return torch.full_like(value, float("nan"))
    if isinstance(value, tuple | list):
        return type(value)(_nan(v, seen) for v in value)
    if isinstance(value, dict):
        return {k: _nan(v, seen) for k, v in value.items()}
    return value


def _nan_answer(reference, seen: list):
    if isinstance(reference, type) and issubclass(reference, torch.nn.Module):
        return type(
            "NaNs",
            (reference,),
            {"forward": lambda s, *a, **k: _nan(super(type(s), s).forward(*a, **k), seen)},
        )
    return lambda *a, **k: _nan(reference(*a, **k), seen)


# answers without floating-point numbers (text, ids, counts, masks, headers) or whose numbers are
# an object's state (a cache, experts, a loaded model)
NO_NUMBERS = {
    "ch00.read_safetensors_header",
    "ch00.count_params",
    "ch01.causal_mask",
    "ch01.KVCache",
    "ch01.kv_bytes_per_token",
    "ch01.load_weights",
    "ch01.decode",
    "ch02.distinct_weights",
    "ch03.split_mlp",
    *(e.id for e in checking.exercises("ch04")),
    "ch06.fused_projection_order",
    "ch06.select_blocks",
    "ch06.shift_within_segment",
    "ch06.ngram_memory",
    *(e.id for e in checking.exercises("ch07")),  # byte counts, token ids and decisions
}


@pytest.mark.parametrize(
    "exercise", [e for e in EXERCISES if e.id not in NO_NUMBERS], ids=lambda e: e.id
)
def test_nan_answers_never_pass(exercise):
    """The reference's own answer with NaN in place of every number fails: no comparison lets
    NaN through where the expected value is a number."""
    seen: list = []
    result = checking.run_checks(exercise.id, _nan_answer(exercise.reference, seen), hidden=True)
    assert seen, f"{exercise.id}: no floating-point answer was replaced"
    assert result.status == "failed", result.line()


def test_an_error_in_the_learners_code_gives_the_line_of_their_cell():
    """Run in IPython as Jupyter runs a notebook: the message names the cell that raised (as
    IPython's traceback does, `In[2]`), the line and its source."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.run_cell("from qwen_mini.course.checking import run_checks\nimport torch", True)
        defined = shell.run_cell(
            "def causal_mask(T_q, T_k):\n"
            "    n = T_k - T_q\n"
            "    return torch.ones(T_q, T_k).tril(n)[T_q + 2]  # one row too far\n",
            True,
        )
        shell.run_cell('result = run_checks("ch01.causal_mask", causal_mask)', True)
        message = shell.user_ns["result"].message
    finally:
        InteractiveShell.clear_instance()
    assert "your code raised IndexError" in message, message
    cell = defined.execution_count
    assert message.endswith(
        f"(cell In[{cell}], line 3: return torch.ones(T_q, T_k).tril(n)[T_q + 2] # one row too far)"
    ), message
    # the same code outside a cell (a module of the package, a test) names no cell
    outside = checking.run_checks("ch01.causal_mask", lambda T_q, T_k: [][T_q])
    assert "your code raised IndexError" in outside.message and "cell" not in outside.message
