# Generated from solutions/ch00_foundations.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""The SwiGLU feed-forward of every dense Qwen layer (and of each expert)."""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """SwiGLU feed-forward: gate_proj and up_proj widen x, down_proj narrows it back."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
