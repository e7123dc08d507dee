"""What a model remembers of the tokens it has seen: one state per layer.

An attention layer keeps the keys and values of every token (`attention.KVCache`); a Gated
DeltaNet layer keeps a fixed-size recurrent state and the last inputs of its convolution. The
model asks each layer's mixer for a fresh state (`mixer.new_state(...)`), hands each layer its own
state during a forward pass, and only when every layer has run does it `commit` the pass. A state
therefore stages what a pass writes and never changes what it has committed until then: a pass
that fails halfway (a bad token id, an interrupted cell, a context overflow) is `discard`ed and
the cache describes exactly the tokens it described before.

A layer state has:
    length             tokens committed
    commit(n_tokens)   make what the last pass wrote part of the state
    discard()          forget what the last pass wrote
    truncate(n)        keep only the first n tokens (a recurrent state can only keep all of them:
                       it has folded every token into one matrix; set `can_rewind = False`)
    nbytes()           bytes held for the committed tokens
"""

from __future__ import annotations


class Cache:
    """One state per layer (`layers[i]`) and the number of tokens they describe (`length`)."""

    def __init__(self, layers: list, batch_size: int):
        self.layers = layers
        self.batch_size = batch_size
        self.length = 0

    def commit(self, n_tokens: int) -> None:
        """The pass over `n_tokens` new tokens finished in every layer: keep what it wrote."""
        for state in self.layers:
            state.commit(n_tokens)
        self.length += n_tokens

    def discard(self) -> None:
        """The pass failed: forget whatever the layers wrote during it."""
        for state in self.layers:
            state.discard()

    def truncate(self, n: int) -> None:
        """Keep only the first `n` tokens, e.g. to reuse a shared prefix of the next prompt."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}.")
        fixed = [i for i, s in enumerate(self.layers) if not getattr(s, "can_rewind", True)]
        if n != self.length and fixed:
            raise ValueError(
                f"layer {fixed[0]} keeps a recurrent state, which holds every token folded into "
                f"one matrix: it cannot go back to {n} of its {self.length} tokens. Start a new "
                f"cache (model.new_cache()) and feed the prefix again."
            )
        for state in self.layers:  # checked above, so no layer is left half-changed
            state.truncate(n)
        self.length = n

    def nbytes(self) -> int:
        """Bytes the layers hold for the tokens seen so far (not spare capacity)."""
        return sum(state.nbytes() for state in self.layers)
