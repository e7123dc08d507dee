"""Text generation: prefill once, then decode one token at a time with the KV cache.

Each new token is chosen from the model's logits by the sampling pipeline of
`qwen_mini.sampling` (penalties, temperature, top_k, top_p, min_p), with the settings of
`Sampling.for_model`: the arguments, else the checkpoint's generation_config.json, else greedy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from .decoding import decode
from .sampling import (  # the pipeline's halves and its error, also importable from here
    NonFiniteLogitsError,  # noqa: F401  (importable from here too)
    Sampling,
    penalised_logits,
    token_probabilities,
)
from .validation import is_whole_number

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_DRAFT_TOKENS = 3  # drafts a round of speculative decoding (qwen_mini.speculative)


def eos_ids_for(model, eos_token_ids=None) -> set[int]:
    """The ids that end generation: the argument, else generation_config, else config.json."""
    if eos_token_ids is None:
        gc = getattr(model, "generation_config", None) or {}
        eos_token_ids = gc.get("eos_token_id")
    if eos_token_ids is None:
        eos_token_ids = model.config.eos_token_ids
    ids = [eos_token_ids] if not isinstance(eos_token_ids, (list, tuple, set)) else eos_token_ids
    if not all(is_whole_number(i) for i in ids):
        raise ValueError(f"eos_token_ids must be token ids (whole numbers), got {eos_token_ids!r}.")
    return {int(i) for i in ids}


def check_ids(ids, vocab_size: int, what: str = "token ids") -> None:
    """Every id a whole number in [0, vocab_size): a float would be truncated, an id past the
    vocabulary has no embedding row."""
    wrong = [i for i in ids if not is_whole_number(i)]
    if wrong:
        raise ValueError(f"{what} must be whole numbers, got {wrong[0]!r}.")
    bad = [int(i) for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(
            f"{what} {bad[:5]} are outside this model's vocabulary of {vocab_size} ids "
            f"(0 to {vocab_size - 1}); was the text encoded with another tokenizer?"
        )


def _check_prompt(model, prompt_ids: list[int], max_new_tokens: int):
    """Fail before any work: a context overflow halfway through would waste the whole prefill."""
    cfg = model.config
    if not is_whole_number(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}.")
    if len(prompt_ids) == 0:
        raise ValueError(
            "the prompt is empty: Qwen models have no start token, so give at least "
            "one token to continue from."
        )
    check_ids(prompt_ids, cfg.vocab_size, "prompt ids")
    n, limit = len(prompt_ids), cfg.max_position_embeddings
    if n + max_new_tokens > limit:
        fix = (
            f"lower max_new_tokens to at most {limit - n}"
            if n < limit
            else f"shorten the prompt to fewer than {limit} tokens"
        )
        raise ValueError(
            f"the prompt has {n} tokens and max_new_tokens is {max_new_tokens}: "
            f"{n + max_new_tokens} tokens exceed this model's context of {limit} "
            f"positions (max_position_embeddings); {fix}."
        )


def seeded_generator(seed: int | None, device) -> torch.Generator | None:
    """A random generator on `device` started from `seed` (None: none, torch's global one is
    used); a seed torch cannot take (a float, one past 64 bits) is a ValueError naming it."""
    if seed is None:
        return None
    if not is_whole_number(seed) or not -(2**63) <= int(seed) < 2**64:
        raise ValueError(f"seed must be a whole number from -2**63 to 2**64 - 1, got {seed!r}.")
    return torch.Generator(device=device).manual_seed(int(seed))


# --- the decoding loop --------------------------------------------------------------------------


def generate_tokens(
    model,
    prompt_ids: list[int],
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    sampling: Sampling | None = None,
    seed: int | None = None,
    eos_token_ids: int | Iterable[int] | None = None,
    draft=None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    compile: bool | str = False,
    **settings,
) -> Iterator[int]:
    """Yield new token ids one at a time, continuing `prompt_ids`.

    sampling: a `Sampling`; or give its fields as keywords (temperature=0.7, top_p=0.8): those
    win key by key over the checkpoint's generation_config (see `Sampling.for_model`).
    temperature 0 means greedy (argmax). The presence penalty counts only generated tokens, not
    the prompt: Qwen recommends it against repetition in the model's own output, and counting
    the prompt would penalise the very words a question asks about. Generation stops after
    max_new_tokens or after an end-of-sequence id, which is yielded last so the caller can tell
    why it stopped. With a seed the result is reproducible; without one, sampling draws from
    torch's global generator (so `torch.manual_seed` also makes it reproducible).

    draft: speculative decoding (qwen_mini.speculative): "mtp", the model's own
    multi-token-prediction head, or a smaller loaded model with the same tokenizer, drafts
    `draft_tokens` tokens that the model checks in one pass. Greedy output is the same token
    for token; sampled output follows the same distribution (not the same draws for a seed).
    compile: decode with a preallocated cache and a fixed-shape step compiled by torch.compile
    (qwen_mini.static_decode; the first call compiles, which takes a while). True gives the
    eager tokens (in bfloat16 it keeps the eager rounding of each operation, though a matrix
    product may still round differently: a token can then differ where two logits tie within
    rounding). "max-autotune" also tunes a kernel for every projection and keeps a repacked copy
    of the weights: faster, the same model, but summed in another order, so such near-ties go
    the other way more often.

    Raises ValueError at the call, before any work, when prompt + max_new_tokens do not fit the
    context: max_new_tokens is a request the learner made, so it is refused, not silently
    shortened.
    """
    # Checked here, outside the generator below, so that a mistake raises at the call and not at
    # the first next(): a generator function would defer even its first line.
    if sampling is None:
        sampling = Sampling.for_model(model, **settings)
    elif not isinstance(sampling, Sampling):
        raise TypeError(
            f"sampling must be a Sampling (or give its fields as keywords), got "
            f"{type(sampling).__name__}."
        )
    elif settings:
        sampling = sampling.with_settings(**settings)
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise TypeError(
            f"prompt ids must be a list of token ids (tokenizer.encode(text) gives one), got "
            f"{type(prompt_ids).__name__}."
        )
    prompt_ids = list(prompt_ids)
    _check_prompt(model, prompt_ids, max_new_tokens)
    prompt_ids = [int(i) for i in prompt_ids]
    stop = eos_ids_for(model, eos_token_ids)
    generator = seeded_generator(seed, next(model.parameters()).device)
    drafter = check_fast_options(model, draft, draft_tokens, compile)
    if drafter is not None:
        return _speculative(model, drafter, prompt_ids, max_new_tokens, int(draft_tokens),
                            sampling, generator, stop)  # fmt: skip
    return _decode(model, prompt_ids, max_new_tokens, sampling, generator, stop, compile)


def check_fast_options(model, draft, draft_tokens, compile):
    """Refuse, before any work, what `compile`, `draft` and `draft_tokens` cannot do with
    `model`; return the draft object (qwen_mini.speculative) for `draft`, or None."""
    if not (compile is True or compile is False or compile == "max-autotune"):  # not 1 or 0
        raise ValueError(f'compile must be False, True or "max-autotune", got {compile!r}.')
    if compile and draft is not None:
        raise ValueError("compile= and draft= cannot be combined yet; choose one.")
    if compile:
        from .static_decode import check_static

        check_static(model)  # refused at the call, as the other arguments
    if draft is None:
        return None
    if not is_whole_number(draft_tokens) or draft_tokens < 1:
        raise ValueError(f"draft_tokens must be a whole number >= 1, got {draft_tokens!r}.")
    from .speculative import make_draft  # it builds on this module's pipeline

    return make_draft(draft, model)


@torch.inference_mode()  # on a generator, torch enters the mode only while the generator runs
def _decode(
    model, prompt_ids, max_new_tokens, s: Sampling, generator, stop, compile=False
) -> Iterator[int]:
    """The decoder's `decode` loop (prefill once, then one token at a time through the cache),
    choosing each token with the sampling settings `s` (drawing from `generator`, if any)."""
    device = next(model.parameters()).device
    seen = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=device)
    in_context = seen.clone()  # the repetition penalty counts the prompt too, as transformers
    in_context[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True

    def choose(logits: torch.Tensor) -> int:
        token = next_token(logits.float(), seen, s, generator, in_context)
        seen[token] = in_context[token] = True  # for the penalties of the next steps
        return token

    if compile:
        from .static_decode import static_decode

        yield from static_decode(model, prompt_ids, max_new_tokens, choose, stop, compile)
    else:
        yield from decode(model, prompt_ids, max_new_tokens, choose, stop)


@torch.inference_mode()
def _speculative(model, drafter, prompt_ids, max_new_tokens, k, s: Sampling, generator, stop):
    """`speculative_decode` with the penalties' masks set up as `_decode` sets them."""
    from .speculative import speculative_decode

    device = next(model.parameters()).device
    seen = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=device)
    in_context = seen.clone()
    in_context[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
    yield from speculative_decode(
        model, drafter, prompt_ids, max_new_tokens, k, s, generator, stop, seen, in_context
    )


def next_token(
    logits: torch.Tensor, seen: torch.Tensor, s: Sampling, generator=None, in_context=None
) -> int:
    """Choose the next id from one position's logits [V] with the settings `s`. `seen` marks the
    generated tokens (the presence penalty), `in_context` the prompt's and the generated ones
    (the repetition penalty; default: `seen`)."""
    logits = penalised_logits(logits, seen, s, in_context)
    if s.temperature == 0:
        return int(logits.argmax())
    probs = token_probabilities(logits, s)
    return int(torch.multinomial(probs, 1, generator=generator))


# --- text in, text out --------------------------------------------------------------------------


def generate(
    model,
    tokenizer,
    prompt: str | list[int],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    *,
    sampling: Sampling | None = None,
    seed: int | None = None,
    stream: bool = False,
    eos_token_ids: int | Iterable[int] | None = None,
    draft=None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    compile: bool | str = False,
    **settings,
):
    """Continue `prompt` and return the new text (without the prompt and the end token).

    prompt: a string, encoded as it is (apply a chat template first for a chat model), or a list
        of token ids.
    sampling, or its fields as keywords (temperature, top_k, top_p, min_p, presence_penalty,
        repetition_penalty; any other setting is refused by name):
        what is not given comes from the checkpoint's generation_config.json (e.g. Qwen3-0.6B:
        temperature 0.6, top_k 20, top_p 0.95); a checkpoint without one, or with
        `do_sample: false`, decodes greedily. Pass temperature=0 to force greedy decoding.
        Explicit values win key by key (temperature=0.7 keeps the checkpoint's top_k and top_p).
    max_new_tokens: an upper bound; generation stops earlier at an end token. It is not read
        from generation_config (Qwen2.5's says 2048, far too slow for a CPU notebook).
    seed: makes sampling reproducible.
    stream: return an iterator of text pieces instead of the text; the pieces concatenate to the
        same text and never split a multi-byte character.
    eos_token_ids: the ids that end generation (default: generation_config, then config.json).
    draft, draft_tokens: speculative decoding with "mtp" or a draft model (see generate_tokens).
    compile: a compiled fixed-shape decode step (see generate_tokens).
    """
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    tokens = generate_tokens(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        eos_token_ids=eos_token_ids,
        draft=draft,
        draft_tokens=draft_tokens,
        compile=compile,
        **settings,
    )
    stop = eos_ids_for(model, eos_token_ids)
    content = (t for t in tokens if t not in stop)  # the end token is not part of the text
    if stream:
        return stream_text(tokenizer, content)
    return tokenizer.decode(list(content))


def stream_text(tokenizer, token_ids: Iterable[int]) -> Iterator[str]:
    """Turn a stream of ids into text pieces, each as soon as it is whole.

    One character can span several byte-level tokens (an emoji is 4 bytes). Decoding a partial
    character gives the replacement character U+FFFD at the end, so such pieces are held back and
    decoded again together with the next token. Only the ids since the last piece are decoded,
    which keeps streaming linear in the length of the output.
    """
    pending: list[int] = []
    for token in token_ids:
        pending.append(token)
        text = tokenizer.decode(pending)
        if not text.endswith("\ufffd"):
            if text:
                yield text
            pending = []
    if pending:  # the output ended inside a character: give what there is
        yield tokenizer.decode(pending)
