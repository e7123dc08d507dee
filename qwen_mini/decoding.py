# Generated from solutions/ch01_attention.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""The decoding loop: the prompt once through the KV cache, then one new token at a time.
`qwen_mini.generation` adds the sampling and the checks around it.
"""

from collections.abc import Callable, Iterator

import torch


def greedy(logits: torch.Tensor) -> int:
    """The most likely next token (logits [vocab])."""
    return int(logits.argmax())


def decode(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    choose: Callable[[torch.Tensor], int] = greedy,
    stop=(),
) -> Iterator[int]:
    """Yield up to max_new_tokens ids continuing prompt_ids, through the KV cache."""
    device = next(model.parameters()).device
    cache = model.new_cache(batch_size=1)
    ids = torch.tensor([prompt_ids], device=device)  # [1, T]: the whole prompt, once
    for _ in range(max_new_tokens):
        logits = model(ids, cache=cache, last_only=True)[0, -1]  # [vocab]
        token = choose(logits)
        yield token
        if token in stop:
            return
        ids = torch.tensor([[token]], device=device)  # [1, 1]: the cache holds the rest
