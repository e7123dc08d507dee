# Generated from solutions/ch07_fast_decoding.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""The acceptance rules of speculative decoding (qwen_mini.speculative): greedy, the longest
prefix of the drafts the model agrees with and its own token after it; sampling, the rejection
rule that keeps the output distributed as the model's own (Leviathan et al., 2023).
"""

import torch


def greedy_accept(drafts: list[int], targets: list[int]) -> tuple[int, int]:
    """Greedy verification: drafts d_1 .. d_k, targets the model's choice at each position of
    the pass over [pending, d_1, .., d_k] (k + 1 ids; targets[i] is its choice for d_{i+1}'s
    place). Returns (n, token): the longest prefix of drafts the model agrees with, and the
    model's own token after it (its correction, or the bonus token when all k are kept)."""
    n = 0
    while n < len(drafts) and int(drafts[n]) == int(targets[n]):
        n += 1
    return n, int(targets[n])  # position n: after the pending token and the n kept drafts


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, token: int, generator=None
) -> tuple[int, bool]:
    """The rejection rule for one draft `token` drawn from q [V], the model's distribution p [V]:
    (the token, True) with probability min(1, p/q), else (a token drawn from max(0, p - q)
    renormalised, False). The result is distributed as p, whatever q."""
    u = torch.rand((), generator=generator, device=p.device)
    if u * q[token] < p[token]:  # u < p/q, written without dividing by a q of 0
        return token, True
    residual = (p - q).clamp(min=0)
    if not residual.sum() > 0:  # p == q up to rounding: the rejection had no mass
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator)), False
