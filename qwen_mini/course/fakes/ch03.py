"""Chapter 3's counting experts: handed to the learner's grouped dispatch and put into the
learner's MoE blocks, they count each call in `forward` itself."""

from __future__ import annotations

from torch import nn

from qwen_mini.mlp import MLP
from qwen_mini.moe import FusedExperts


class CountingExpert(nn.Sequential):
    """An expert that counts its calls in `forward` itself: a hook would not see a call of
    `expert.forward(x)`, which skips the hooks. `count` is set by the case that counts."""

    def forward(self, x):
        self.count(x.shape[0])
        return super().forward(x)

    def count(self, rows: int) -> None:
        pass


class CountedMLP(MLP):
    """A per-expert SwiGLU that counts its calls in `forward` (`count` is set by the case)."""

    def forward(self, x):
        self.count(x.shape[0])
        return super().forward(x)

    def count(self, rows: int) -> None:
        pass


class CountedFused(FusedExperts):
    """Fused experts that count the calls of each expert (`count` is set by the case)."""

    def expert(self, e, x):
        self.count(x.shape[0], e)
        return super().expert(e, x)

    def count(self, rows: int, e: int) -> None:
        pass
