# Generated from solutions/ch07_fast_decoding.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Exercise helpers of chapter 7 (decoding fast): the bytes a decode step reads, and one greedy
draft-and-verify round on a model whose cache can truncate. Not used to run a model.
"""

import torch

from qwen_mini.acceptance import greedy_accept


def bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, in its dtype (a tied
    embedding is the head's matrix), but of an untied input embedding only the one row the step
    looks up."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # each tensor once
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    if embed is not head:  # untied: a lookup reads one row, not the table
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return total


def verify(model, cache, token: int, drafts: list[int]) -> tuple[int, int]:
    """One greedy draft-and-verify round through `cache` (whose layers can truncate): the pass
    over [token] + drafts, the kept prefix (greedy_accept), the rejected drafts taken back out of
    the cache. Returns (n kept, the model's next token, pending: not fed yet)."""
    start = cache.length
    device = next(model.parameters()).device
    logits = model(torch.tensor([[token, *drafts]], device=device), cache=cache)[0]  # [k + 1, V]
    n, following = greedy_accept(drafts, logits.argmax(-1).tolist())
    cache.truncate(start + 1 + n)  # keep the pending token and the n kept drafts
    return n, following
