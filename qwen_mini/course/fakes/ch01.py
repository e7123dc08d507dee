"""Chapter 1's spies: a KV cache that records what it stores, a block that records its calls, a
model that records how it is fed (handed to the learner's attention, decoder layer and decode)."""

from __future__ import annotations

import torch
from torch import nn

from qwen_mini import attention as ref
from qwen_mini.course.checking import seeded


class SpyCache(ref.KVCache):
    """The package's cache, recording what each update stores."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stored = []

    def update(self, k, v):
        self.stored.append((k.detach().clone(), v.detach().clone()))
        return super().update(k, v)


class Recorder(nn.Module):
    """A stand-in block: `proj(x)` (a Linear), recording what it was called with."""

    def __init__(self, dim: int, seed: int, mixer: bool):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(dim, dim, generator=seeded(seed)) * 0.5)
        self.mixer, self.calls = mixer, []

    def forward(self, x, *args, **kwargs):
        names = ("cos", "sin", "cache")[len(args) :]  # keywords, in the protocol's order
        args = args + tuple(kwargs[n] for n in names if n in kwargs)
        self.calls.append((x.detach().clone(), args))
        return self.proj(x)


class Watched:
    """A model that records its calls: how many tokens each call fed, with which cache."""

    def __init__(self, model):
        self.model, self.calls, self.caches = model, [], []
        self.config, self.lm_head = model.config, model.lm_head

    def parameters(self):
        return self.model.parameters()

    def new_cache(self, batch_size=1):
        cache = self.model.new_cache(batch_size)
        self.caches.append(cache)
        return cache

    def __call__(self, ids, cache=None, last_only=False):
        self.calls.append((ids.clone(), cache, last_only))
        return self.model(ids, cache=cache, last_only=last_only)

    forward = __call__
