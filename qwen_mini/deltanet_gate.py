"""The activation of Gated DeltaNet's output gate, which Qwen3.8-Flash-Next makes a config field
(`output_gate_type`: "sigmoid" in the release; "silu", Qwen3.5's, when it is not set).

Qwen3.5 gates the normalised output of the delta rule by silu(z); a sigmoid gate is the same
norm with z squashed into (0, 1) instead. Only the norm changes: the mixer is Qwen3.5's.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import Config
from .deltanet import GatedDeltaNet
from .norms import GatedRMSNorm

GATE_ACTIVATIONS = {"silu": nn.functional.silu, "sigmoid": torch.sigmoid}


class ActivationGatedRMSNorm(GatedRMSNorm):
    """GatedRMSNorm with the gate's activation chosen: x_hat * weight * act(z), per value head."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__(dim, eps)
        self.activation = GATE_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [..., d_v] twice
        x = self.weight * self.normalize(x).to(x.dtype)
        return (x * self.activation(z.float())).to(x.dtype)  # the gate in float32


def gate_activation(cfg: Config) -> str:
    """The output gate's activation: output_gate_type, else hidden_act (silu), as transformers."""
    return cfg.output_gate_type or "silu"


def output_gated_deltanet(cfg: Config, layer_idx: int, arch=None) -> nn.Module:
    """Qwen3.5's Gated DeltaNet with the output gate of `output_gate_type`."""
    mixer = GatedDeltaNet(cfg, layer_idx, arch)
    mixer.norm = ActivationGatedRMSNorm(mixer.d_v, cfg.rms_norm_eps, gate_activation(cfg))
    return mixer


output_gated_deltanet.config_fields = GatedDeltaNet.config_fields
