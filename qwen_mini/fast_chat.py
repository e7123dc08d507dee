"""A chat whose replies are decoded with a compiled step or speculatively: `qwen-mini chat
--compile` and `--draft mtp|MODEL`, the chat's side of generate's `compile=` and `draft=`.

`ChatSession` (qwen_mini.chat) asks for its reply one token at a time, through `step(feed)`
(append `feed` to the context, return the next token), so that the thinking budget can insert
its closing instruction at any token. Here a step takes its token from a decoding run over the
whole conversation (`static_decode`, or `speculative_decode`, whose rounds make several tokens
at once): while the chat feeds back the token it was given, the run goes on; when the budget
inserts its instruction, the run no longer describes the context and a new one starts after it.
The tokens are those of the same settings in `generate` (greedy: ChatSession's, token for token).

Each run computes the whole conversation: the compiled step keeps its own buffers and
speculative decoding its own caches, so the KV cache is not carried from one turn to the next
(`turns[i]["reused"]` is 0). With long conversations on a slow machine, plain ChatSession's
reuse can be worth more than the faster decoding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .chat import BUDGET_STOP, ChatSession, ThinkingStream, budgeted_tokens, reply_message
from .generation import DEFAULT_DRAFT_TOKENS, check_fast_options, next_token, stream_text

# the compiled step's buffers are sized in powers of two from this length, so that a growing
# conversation recompiles once per doubling, not once per turn
STATIC_MIN_LENGTH = 1024


class FastChatSession(ChatSession):
    """ChatSession with generate's `compile=True` (or "max-autotune"), or `draft="mtp"` / a
    draft model and `draft_tokens`, refused as generate refuses them. `turns` also records,
    with a draft, the drafts proposed and accepted in each turn."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        compile: bool | str = False,
        draft=None,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        **options,
    ):
        check_fast_options(model, draft, draft_tokens, compile)  # before any work
        super().__init__(model, tokenizer, **options)
        self.compile, self.draft, self.draft_tokens = compile, draft, draft_tokens

    def _run(self, context: list[int], room: int, seen, in_context) -> Iterator[int]:
        """A decoding run continuing `context` by up to `room` tokens, its penalties marked in
        `seen` and `in_context` (kept across runs, as one reply's)."""
        model, s, stop = self.model, self.settings, self.stop_ids
        if self.compile:
            from .static_decode import compiled_step, static_decode

            def choose(logits: torch.Tensor) -> int:  # as generate's decoding loop chooses
                token = next_token(logits.float(), seen, s, self.generator, in_context)
                seen[token] = in_context[token] = True
                return token

            needed = len(context) + room
            length = max(STATIC_MIN_LENGTH, 1 << (needed - 1).bit_length())
            compiled_step(model, length, self.compile)
            return static_decode(model, context, room, choose, stop, self.compile)
        from .speculative import make_draft, speculative_decode

        self.drafter = make_draft(self.draft, model)
        k = int(self.draft_tokens)
        return speculative_decode(
            model, self.drafter, context, room, k, s, self.generator, stop, seen, in_context
        )

    def _reply(self) -> Iterator[tuple[str, str]]:
        """ChatSession._reply with the tokens of decoding runs (see the module's docstring)."""
        ids, start = self.prompt_ids(), time.perf_counter()
        limit = self.model.config.max_position_embeddings
        if len(ids) > limit:  # refused before anything runs, as ChatSession refuses it
            raise ValueError(
                f"the conversation is {len(ids)} tokens, more than this model's context of "
                f"{limit} positions (max_position_embeddings): send a shorter message or start "
                f"a new session"
            )
        seen = torch.zeros(self.model.config.vocab_size, dtype=torch.bool, device=self.device)
        in_context = seen.clone()
        stats = dict(prompt=len(ids), reused=0, generated=0, thinking=0, proposed=0, accepted=0)
        context, run, given = [], None, None  # the tokens fed so far; the run; its last token

        def count_drafts():
            if run is not None and self.draft is not None:
                stats["proposed"] += self.drafter.proposed
                stats["accepted"] += self.drafter.accepted

        def step(feed: list[int]) -> int:
            nonlocal run, given
            context.extend(feed)
            in_context[torch.tensor(feed, dtype=torch.long, device=self.device)] = True
            with torch.inference_mode():  # as generate's loops run
                if feed != [given]:  # the prompt, or the budget's instruction: a new run
                    count_drafts()
                    room = self.max_new_tokens - (len(context) - len(ids))
                    run = self._run(list(context), room, seen, in_context)
                given = next(run)
            return given

        tok = self.tokenizer
        tokens = budgeted_tokens(
            step, ids, budget=self.budget if self.thinking else None,
            forced_ids=tok.encode(BUDGET_STOP), think_id=tok.think_id,
            end_think_id=tok.end_think_id, stop_ids=self.stop_ids,
            max_new_tokens=self.max_new_tokens, thinking=self.thinking,
        )  # fmt: skip
        reply, router, inside = [], ThinkingStream(self.thinking), self.thinking

        def content():
            nonlocal inside
            for t in tokens:
                stats["generated"] += 1
                if t in (tok.think_id, tok.end_think_id):
                    inside = t == tok.think_id
                elif inside:
                    stats["thinking"] += 1
                if t not in self.stop_ids:
                    reply.append(t)
                    yield t

        for piece in stream_text(tok, content()):
            yield from router.feed(piece)
        yield from router.close()
        count_drafts()
        self.messages = self.messages + [reply_message(tok.decode(reply), self.thinking)]
        stats["computed"] = stats["prompt"]
        stats["seconds"] = time.perf_counter() - start
        self.turns.append(stats)
