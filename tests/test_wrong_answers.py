"""Every chapter's catalogue of typical mistakes (written once, next to its exercise's cases in
qwen_mini/course/checks/chNN.py): each mistake fails the public checks, the ones a learner runs in
the notebook, with the idea it gets wrong as the message, and fails when grading (hidden cases too);
each reference passes every case. Wrong answers that are not functions of an exercise's signature
(whole notebooks, hostile objects) stay in test_wrong_answers_chNN.py."""

import pytest

from qwen_mini.course import checking

CHAPTERS = ["ch02"]  # chapters whose exercises are written as cases and mistakes
EXERCISES = [e for chapter in CHAPTERS for e in checking.exercises(chapter)]
# (exercise id, mistake name, the wrong implementation, the idea): data for other tests too
CATALOGUE = [
    (m.exercise_id, m.name, m.fn, m.idea) for ch in CHAPTERS for m in checking.catalogue(ch)
]


@pytest.mark.parametrize(
    "exercise, name, wrong, idea", CATALOGUE, ids=[f"{e}-{n}" for e, n, _, _ in CATALOGUE]
)
def test_mistake_fails_publicly_with_its_idea(exercise, name, wrong, idea):
    public = checking.run_checks(exercise, wrong)
    assert public.status == "failed", public.line()
    assert public.message.endswith(f"failed: {idea}"), public.message
    graded = checking.run_checks(exercise, wrong, hidden=True)
    assert graded.status == "failed", graded.line()


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_reference_passes_every_case_and_has_mistakes(exercise):
    result = checking.run_checks(exercise.id, exercise.reference, hidden=True)
    assert result.ok, result.line()
    assert exercise.hidden, f"{exercise.id} has no hidden case"
    assert exercise.mistakes, f"{exercise.id} catalogues no typical mistake"
