"""Given experiment code of chapter 4 (thinking and the chat template): a toy model for the
thinking budget, and the table of questions answered in each mode. The chat session the chapter
builds comes in as an argument, so that what runs is the notebook's."""

from __future__ import annotations

from collections.abc import Callable


def toy_step() -> Callable[[list], str]:
    """A stand-in for a model, on strings instead of token ids: it thinks forever ("t0", "t1",
    ...) until it sees "</think>", then answers "4" and stops with "<end>". Each call is given the
    new ids and returns the next one."""
    context = []

    def step(ids):
        context.extend(ids)
        if "<think>" not in context:
            return "<think>"
        if "</think>" not in context:
            return f"t{len(context) - context.index('<think>') - 1}"
        return "<end>" if "4" in context else "4"

    return step


def thinking_table(
    session_class, model, tokenizer, questions, modes: dict, limit: int, forced: int, per_token
) -> list[tuple]:
    """Each question in a fresh session per mode (`session_class(model, tokenizer, ...)`,
    seed 0): up to `limit` new tokens, plus the `forced` tokens of the budget's instruction in a
    budgeted mode. Printed and returned, a row per (question, mode): thinking tokens, other
    tokens, seconds, KiB of KV cache (`per_token` bytes per token) and the answer."""
    rows = []
    for question in questions:
        for mode, options in modes.items():
            extra = forced if "budget" in options else 0
            session = session_class(
                model, tokenizer, max_new_tokens=limit + extra, seed=0, **options
            )
            list(session.send(question))
            t, answer = session.turns[-1], session.messages[-1]["content"]
            kib = t["generated"] * per_token / 1024
            think, other = t["thinking"], t["generated"] - t["thinking"]
            rows.append((question[:22], mode, think, other, t["seconds"], kib, answer))
    print(f"{'question':22} {'mode':12} {'think':>5} {'other':>5} {'s':>5} {'KV KiB':>7}  answer")
    for q, mode, think, other, secs, kib, answer in rows:
        print(f"{q:22} {mode:12} {think:5} {other:5} {secs:5.1f} {kib:7.0f}  {answer[:40]!r}")
    return rows
