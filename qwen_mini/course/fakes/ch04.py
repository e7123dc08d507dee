"""Chapter 4's fake model (handed to the learner's budgeted_tokens)."""

from __future__ import annotations

EOS, THINK, END = 0, 1, 2  # the fake vocabulary's end of text, <think> and </think>


class FakeModel:
    """Opens a think block, thinks (10, 11, ...) until </think> is in its context, then
    answers 20, 21 and stops. Records what it was fed."""

    def __init__(self, closes_after=None):
        self.context, self.closes_after = [], closes_after

    def __call__(self, ids):
        self.context += list(ids)
        if THINK not in self.context:
            return THINK
        after = self.context[self.context.index(THINK) + 1 :]
        if END not in after:
            if self.closes_after is not None and len(after) >= self.closes_after:
                return END
            return 10 + len(after)
        answer = [t for t in after[after.index(END) + 1 :] if t in (20, 21)]
        return [20, 21, EOS][min(len(answer), 2)]
