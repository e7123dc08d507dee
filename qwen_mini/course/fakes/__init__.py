"""What a chapter's checks hand to the learner's code: spies, recorders and fake models.

They live here, not in `checks/chNN.py`, because a graded notebook runs in a sandbox that sees no
check module (their hidden cases, mistakes and generators stay out of its reach), while an object
a check passes to the learner's code crosses to the sandbox by value, where its class must be
importable (grading/byvalue.py). So a module here holds classes only, never a case's inputs.
"""
