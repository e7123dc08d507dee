"""Speculative decoding: a cheap draft guesses k tokens, the model checks them in one pass.

Each round, with the model's cache holding every token before the pending one `t` (chosen,
not yet fed):

    1. the draft proposes d_1 .. d_k (and, sampling, the distributions q_i it drew them from);
    2. the model runs once over [t, d_1, .., d_k]: logits for the token after each of them;
    3. greedy: keep d_i while it is the model's own argmax after d_1 .. d_{i-1}; the first
       mismatch is replaced by the model's token, and if all k match the model adds one more
       (the bonus token). So the output is the model's greedy output, token for token.
       Sampling: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on rejection draw
       from max(0, p_i - q_i) renormalised; after k acceptances draw the bonus from p_{k+1}.
       Every token then follows the model's own distribution p (Leviathan et al., 2023);
    4. the caches forget the rejected drafts.

Forgetting: an attention layer's KV cache is truncated to the accepted length. A Gated DeltaNet
layer (and Qwen3.8's n-gram memory) has folded every token into one state and cannot go back, so
before the checking pass its state is kept aside (a reference: a pass stages new tensors and never
writes into the current ones, see qwen_mini/cache.py); when a draft is rejected, the state is put
back and the accepted tokens are fed again. That costs a second, shorter pass on rejection, but
needs no change to the layers (saving the state after every position would need a recurrence
that hands out every intermediate state).

Drafts: `MTPDraft`, the model's own multi-token-prediction head (qwen_mini.mtp), or
`ModelDraft`, a smaller model with the same tokenizer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .acceptance import accept_or_resample, greedy_accept
from .cache import Cache
from .sampling import Sampling, penalised_logits, token_probabilities


@contextmanager
def hidden_states(model):
    """Collect the model's last hidden state, after its final norm (what the head reads):
    `with hidden_states(model) as box: model(ids)`, then box["h"] [B, T, H] (with last_only, a
    pass may hand its final norm only the last position)."""
    box = {}
    final = getattr(model.model, model.arch.final_name)
    handle = final.register_forward_hook(lambda module, args, out: box.__setitem__("h", out))
    try:
        yield box
    finally:
        handle.remove()


# --- taking back what a pass added ---------------------------------------------------------------


def snapshot(cache: Cache):
    """What `rewind` needs to take `cache` back to now: its length, and a copy of the state of
    each layer that cannot truncate."""
    fixed = {i: _kept(s) for i, s in enumerate(cache.layers) if not getattr(s, "can_rewind", True)}
    return cache.length, fixed


def _kept(state):
    """A copy of a layer state as it is now. Shallow: a pass stages new tensors and commit swaps
    them in (a recurrent state) or writes only past the committed length (a KV cache), so the
    tensors a copy refers to keep describing its tokens. A state made of states (a Qwen3.8
    layer's mixer and n-gram memory) is copied part by part."""
    kept = copy.copy(state)
    for name, value in vars(state).items():
        if hasattr(value, "commit"):
            setattr(kept, name, _kept(value))
    return kept


def rewind(model, cache: Cache, saved, tokens: list[int]) -> None:
    """Bring `cache` to its `saved` snapshot plus `tokens`: truncate where every layer can,
    else restore the recurrent states and feed `tokens` again."""
    length, fixed = saved
    if not fixed:
        cache.truncate(length + len(tokens))
        return
    for i, state in enumerate(cache.layers):
        if i in fixed:
            cache.layers[i] = fixed[i]  # the state before the checking pass
        else:
            state.truncate(length)
    cache.length = length
    if tokens:
        device = next(model.parameters()).device
        model(torch.tensor([tokens], device=device), cache=cache, last_only=True)


# --- the drafts ----------------------------------------------------------------------------------


class MTPDraft:
    """Drafts with the model's MTP head: from the model's hidden state at position i and the
    token i + 1, the token i + 2; chained on its own output for the drafts after the first.

    Its cache holds one step per position whose next token is known. Steps made from drafts
    are dropped after each check and made again from the model's own hidden states."""

    def __init__(self, model):
        if getattr(model, "mtp", None) is None:
            raise ValueError(
                "draft='mtp': this model has no multi-token-prediction head (its config.json "
                "has no mtp_num_hidden_layers, or its weights carry no mtp.* tensors). Pass a "
                "smaller model with the same tokenizer as draft= instead."
            )
        self.model, self.mtp = model, model.mtp
        self.proposed = self.accepted = 0  # drafts, over the whole generation
        self.cache = self.mtp.new_cache(1)
        self.device = model.lm_head.weight.device

    def _steps(self, hidden: torch.Tensor, next_ids: list[int]) -> None:
        """MTP steps for positions with hidden states `hidden` [1, m, H] and next tokens
        `next_ids` (m); keeps the last step's output and logits for the first draft."""
        embeds = self.model.model.embed_tokens(torch.tensor([next_ids], device=self.device))
        self.g = self.mtp(embeds, hidden, self.cache)[:, -1:]  # [1, 1, H]
        self.logits = self.model.lm_head(self.g)[0, -1]  # [V]

    def start(self, prompt_ids: list[int], hidden: torch.Tensor, token: int) -> None:
        """After the prefill: `hidden` [1, m, H] of the prompt's last m positions (all, unless
        the pass gave fewer), `token` the first one chosen."""
        m = hidden.shape[1]
        self._steps(hidden, (prompt_ids[1:] + [token])[-m:])

    def propose(self, k: int, pick: Callable) -> tuple[list[int], list[torch.Tensor]]:
        """k drafts, each `pick`ed from the MTP's logits; returns them and those logits."""
        self.base = self.cache.length
        tokens, logits, g, step_logits = [], [], self.g, self.logits
        for i in range(k):
            tokens.append(pick(step_logits))
            logits.append(step_logits)
            if i < k - 1:  # chain: the MTP's own output in place of the model's hidden state
                embeds = self.model.model.embed_tokens(
                    torch.tensor([[tokens[-1]]], device=self.device)
                )
                g = self.mtp(embeds, g, self.cache)
                step_logits = self.model.lm_head(g)[0, -1]
        return tokens, logits

    def accept(self, fed: list[int], hidden: torch.Tensor, token: int) -> None:
        """The model kept `fed` (the pending token and the accepted drafts) with hidden states
        `hidden` [1, len(fed), H], and chose `token` after them."""
        self.cache.truncate(self.base)  # forget the steps made from drafts
        self._steps(hidden, fed[1:] + [token])


class ModelDraft:
    """Drafts with a smaller model of the same tokenizer, decoding greedily or sampling on its
    own cache (rewound like the model's)."""

    def __init__(self, draft, model):
        self.draft, self.vocab = draft, model.config.vocab_size
        self.proposed = self.accepted = 0  # drafts, over the whole generation
        self.cache = draft.new_cache(1)
        self.device = next(draft.parameters()).device

    def _logits(self, tokens: list[int]) -> torch.Tensor:
        """The draft's next-token logits after `tokens`, cut or padded to the model's
        vocabulary (Qwen models of one tokenizer pad their embedding to different sizes)."""
        logits = self.draft(
            torch.tensor([tokens], device=self.device), cache=self.cache, last_only=True
        )[0, -1]
        if logits.shape[0] >= self.vocab:
            return logits[: self.vocab]
        pad = logits.new_full((self.vocab - logits.shape[0],), float("-inf"))
        return torch.cat([logits, pad])

    def start(self, prompt_ids: list[int], hidden, token: int) -> None:
        self.pending, self.next_logits = token, None
        self.draft(torch.tensor([prompt_ids], device=self.device), cache=self.cache, last_only=True)

    def propose(self, k: int, pick: Callable) -> tuple[list[int], list[torch.Tensor]]:
        self.saved = snapshot(self.cache)
        tokens, logits, last = [], [], self.pending
        for _ in range(k):
            step_logits = self._logits([last])
            last = pick(step_logits)
            tokens.append(last)
            logits.append(step_logits)
        self.drafts = tokens
        return tokens, logits

    def accept(self, fed: list[int], hidden, token: int) -> None:
        # the cache holds the pending token and d_1 .. d_{k-1} (k tokens); it must hold `fed`
        held = len(self.drafts)
        if len(fed) > held:  # all accepted (or no draft): feed what it has not seen
            self._logits(fed[held:])
        else:
            rewind(self.draft, self.cache, self.saved, fed)
        self.pending = token


def make_draft(draft, model):
    """The draft object for generate's `draft=` argument: "mtp" or a loaded model."""
    from .model import CausalLM  # the draft must be a model of this package

    if isinstance(draft, str):
        if draft != "mtp":
            raise ValueError(f"draft must be 'mtp' or a loaded model, got {draft!r}.")
        return MTPDraft(model)
    if not isinstance(draft, CausalLM):
        raise TypeError(
            f"draft must be 'mtp' or a model loaded with qwen_mini.load_model, got "
            f"{type(draft).__name__}."
        )
    if draft.arch.family != model.arch.family:
        raise ValueError(
            f"the draft model ({draft.config.model_type}) uses another tokenizer than the model "
            f"({model.config.model_type}): its token ids would mean other text. Use a draft of "
            f"the same family."
        )
    devices = {next(draft.parameters()).device, next(model.parameters()).device}
    if len(devices) > 1:
        raise ValueError(
            f"the draft model and the model are on different devices "
            f"({', '.join(map(str, devices))}); load both on the same one."
        )
    return ModelDraft(draft, model)


# --- decoding ------------------------------------------------------------------------------------


def speculative_decode(
    model,
    draft,
    prompt_ids: list[int],
    max_new_tokens: int,
    draft_tokens: int,
    s: Sampling,
    generator,
    stop,
    seen: torch.Tensor,
    in_context: torch.Tensor,
) -> Iterator[int]:
    """Yield up to max_new_tokens ids continuing prompt_ids, as `decode` does with the settings
    `s`, drafting `draft_tokens` tokens a round with `draft` (MTPDraft or ModelDraft)."""
    device = next(model.parameters()).device
    greedy = s.temperature == 0

    def target(logits):  # the model's distribution after the tokens marked so far
        return token_probabilities(penalised_logits(logits.float(), seen, s, in_context), s)

    def choose(logits) -> int:  # the plain path's choice (greedy: the penalised argmax)
        if greedy:
            return int(penalised_logits(logits.float(), seen, s, in_context).argmax())
        return int(torch.multinomial(target(logits), 1, generator=generator))

    def pick(logits) -> int:  # a draft: the draft's argmax, or a sample of its distribution
        if greedy:
            return int(logits.argmax())
        return int(
            torch.multinomial(token_probabilities(logits.float(), s), 1, generator=generator)
        )

    def targets(logits, drafts) -> list[int]:
        """Greedy: the model's choice at each position of the pass, the penalties counting the
        drafts before it as kept (a choice matters only when they were)."""
        marked, context, out = seen.clone(), in_context.clone(), []
        for i in range(len(drafts) + 1):
            out.append(int(penalised_logits(logits[i].float(), marked, s, context).argmax()))
            if i < len(drafts):
                marked[drafts[i]] = context[drafts[i]] = True
        return out

    def sample_accept(logits, drafts, draft_logits) -> tuple[int, int]:
        """Sampling: the rejection rule draft by draft, the bonus token after k kept."""
        marked, context = seen.clone(), in_context.clone()

        def p(i):  # the model's distribution at position i, the kept drafts marked
            return token_probabilities(penalised_logits(logits[i].float(), marked, s, context), s)

        for n, d in enumerate(drafts):
            q = token_probabilities(draft_logits[n].float(), s)
            chosen, ok = accept_or_resample(p(n), q, d, generator)
            if not ok:
                return n, chosen
            marked[d] = context[d] = True
        return len(drafts), int(torch.multinomial(p(len(drafts)), 1, generator=generator))

    if max_new_tokens == 0:
        return
    cache, count = model.new_cache(1), 0
    with hidden_states(model) as box:
        logits = model(torch.tensor([prompt_ids], device=device), cache=cache, last_only=True)[
            0, -1
        ]
        token = choose(logits)
        draft.start(prompt_ids, box.get("h"), token)
        while True:
            seen[token] = in_context[token] = True
            yield token
            count += 1
            if token in stop or count == max_new_tokens:
                return
            # drafts past the last token wanted would be wasted
            k = min(draft_tokens, max_new_tokens - count - 1)
            drafts, draft_logits = draft.propose(k, pick)
            saved = snapshot(cache)
            ids = torch.tensor([[token] + drafts], device=device)
            logits = model(ids, cache=cache)[0]  # [k + 1, V]: after the pending token, each draft
            hidden = box.get("h")
            if greedy:  # the kept prefix and the model's own token after it
                n, chosen = greedy_accept(drafts, targets(logits, drafts))
            else:
                n, chosen = sample_accept(logits, drafts, draft_logits)
            for t in drafts[:n]:  # the kept drafts; `chosen` is the next round's pending token
                seen[t] = in_context[t] = True
                yield t
                count += 1
                if t in stop or count == max_new_tokens:
                    return
            draft.proposed, draft.accepted = draft.proposed + k, draft.accepted + n
            fed = [token] + drafts[:n]
            if n < k:  # the rejected drafts leave the caches
                rewind(model, cache, saved, fed)
            draft.accept(fed, hidden[:, : n + 1] if hidden is not None else None, chosen)
            token = chosen
