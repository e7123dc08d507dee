# Generated from solutions/ch01_attention.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""The decoder layer and the model's forward pass: embedding, layers, final norm, head.
`CausalLM.forward` (`qwen_mini.model`) runs the pass, checking its input and committing the
cache around it.
"""

import torch
from torch import nn

from qwen_mini.rope_scaling import rotary_cos_sin


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)).

    The parts come built; the layer registers each under the checkpoint's name for it: the mixer
    under `mixer_name` ("self_attn" or "linear_attn"), and `input_layernorm`, `mlp`,
    `post_attention_layernorm`.
    """

    def __init__(
        self,
        mixer_name: str,
        mixer: nn.Module,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module,
    ):
        super().__init__()
        self.mixer_name = mixer_name
        self.input_layernorm = input_layernorm
        self.add_module(mixer_name, mixer)  # a name known at run time: the checkpoint's name
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x: torch.Tensor, cos, sin, cache=None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; `cache` is this layer's state (or None)."""
        x = x + self.mixer(self.input_layernorm(x), cos, sin, cache)  # tokens exchange information
        return x + self.mlp(self.post_attention_layernorm(x))  # each token on its own


def model_forward(model, input_ids: torch.Tensor, cache=None, last_only: bool = False):
    """input_ids [B, T] -> logits [B, T, vocab] ([B, 1, vocab] with last_only)."""
    cfg, backbone = model.config, model.model
    start = cache.length if cache is not None else 0  # the new tokens follow the cached ones
    x = backbone.embed_tokens(input_ids)  # [B, T, hidden]
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    cos, sin = rotary_cos_sin(cfg, positions, x.dtype)  # [T, rotary_dim]
    for i, layer in enumerate(backbone.layers):
        x = layer(x, cos, sin, cache.layers[i] if cache is not None else None)
    x = backbone.norm(x)
    if last_only:  # before the head: the biggest matrix multiplies one row, not T
        x = x[:, -1:]
    return model.lm_head(x)  # [B, T, vocab]
