"""Given experiment code of chapter 7: an MTP head trained in the notebook on top of the frozen
Qwen3.5-0.8B stand-in, and the share of a head's drafts the model keeps.

The stand-ins were trained on narrative books of the King James Bible with Jonah held out
(scripts/train_standins.py, which uses `books` and `HELD_OUT` from here): heads learn from the
other books and are measured on Jonah.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F

from qwen_mini.config import ASSETS
from qwen_mini.course.experiments import one_thread
from qwen_mini.sampling import Sampling
from qwen_mini.speculative import hidden_states, make_draft, speculative_decode

CORPUS = ASSETS / "data" / "kjv_narratives.txt"
HELD_OUT = "Jonah"  # the book no stand-in and no head was trained on


def books() -> dict[str, str]:
    """{book: its text} from the corpus file's `=== Book ===` sections."""
    pieces = re.split(r"^=== (\w+) ===\n", CORPUS.read_text(encoding="utf-8"), flags=re.M)
    return {pieces[i]: pieces[i + 1].strip() for i in range(1, len(pieces), 2)}


class MTPData(NamedTuple):
    """What an MTP head learns from, for N windows of L + 1 tokens (t = 0 .. L - 2 in each)."""

    hidden: torch.Tensor  # [N, L - 1, H]: the model's last hidden state h_t, after its final norm
    embeds: torch.Tensor  # [N, L - 1, H]: the embedding of token t + 1
    target: torch.Tensor  # [N, L - 1]: token t + 2, as an index into `used`
    used: torch.Tensor  # [U]: the ids the training text uses, ascending


@torch.no_grad()
def mtp_data(model, tok, windows: int = 256, length: int = 64, seed: int = 0) -> MTPData:
    """`windows` windows of `length` + 1 tokens at random places in the training books, run once
    through the frozen model. The head is taken off while they run: 248,320 logits a position
    would cost a hundred times the pass, and only the hidden states are wanted."""
    ids = torch.tensor(
        [i for b, text in books().items() if b != HELD_OUT for i in tok.encode(text)]
    )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length - 1, (windows,), generator=g).tolist()
    x = torch.stack([ids[s : s + length + 1] for s in starts])  # [N, L + 1]
    head, model.lm_head = model.lm_head, torch.nn.Identity()
    try:
        with one_thread(), hidden_states(model) as box:
            model(x[:, :-1])
    finally:
        model.lm_head = head
    used = torch.unique(ids)
    index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    index[used] = torch.arange(len(used))
    embeds = model.model.embed_tokens(x[:, 1:-1]).float()
    return MTPData(box["h"][:, :-1].float(), embeds, index[x[:, 2:]], used)


def train_mtp(
    head, model, data: MTPData, steps: int = 150, batch: int = 16, lr: float = 1e-2, seed: int = 0
) -> list[tuple[int, float]]:
    """Train `head` (an MTP for the model's config, float32) with AdamW, the model frozen: from
    h_t and the embedding of t + 1, token t + 2 through the model's own head, over the rows of
    the ids the text uses. Returns (step, mean loss of the 50 steps up to it)."""
    rows = model.lm_head.weight.detach()[data.used].float()  # [U, H]
    head.float().train()
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    losses, running = [], []
    with one_thread():
        for step in range(1, steps + 1):
            pick = torch.randint(0, data.hidden.shape[0], (batch,), generator=g)
            logits = head(data.embeds[pick], data.hidden[pick]) @ rows.T  # [b, L - 1, U]
            loss = F.cross_entropy(logits.flatten(0, 1), data.target[pick].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            running.append(loss.item())
            if step % 50 == 0 or step == steps:
                losses.append((step, sum(running) / len(running)))
                running = []
    head.eval()
    return losses


@torch.inference_mode()
def kept_shares(
    model, head, tok, ks=(1, 3), prompts: int = 6, new: int = 32, text: str | None = None
) -> dict[int, float]:
    """{k: the share of `head`'s drafts the model keeps}, decoding greedily with k drafts a round
    (the package's speculative decoding, `head` in the model's place for the time) from `prompts`
    windows of 16 tokens spread over `text` (default: the held-out book), `new` tokens each."""
    ids = tok.encode(text if text is not None else books()[HELD_OUT])
    own, model.mtp = getattr(model, "mtp", None), head
    shares = {}
    try:
        for k in ks:
            proposed = accepted = 0
            for i in range(prompts):
                start = i * (len(ids) - 16) // prompts
                draft = make_draft("mtp", model)
                seen = torch.zeros(model.config.vocab_size, dtype=torch.bool)
                prompt = ids[start : start + 16]
                steps = speculative_decode(
                    model, draft, prompt, new, k, Sampling(temperature=0), None, (), seen,
                    seen.clone(),
                )  # fmt: skip
                list(steps)
                proposed, accepted = proposed + draft.proposed, accepted + draft.accepted
            shares[k] = accepted / proposed
    finally:
        model.mtp = own
    return shares
