"""The Qwen decoder, assembled from the blocks `qwen_mini.architectures` names for the config.

Module names follow the checkpoint keys exactly, so a checkpoint's state dict loads with no
renaming: `model.layers.3.self_attn.q_proj.weight`.
"""

from __future__ import annotations

import torch
from torch import nn

from .architectures import ARCHITECTURES, MIXER_ATTRIBUTE
from .cache import Cache
from .config import Config
from .foundations import rope_cos_sin


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: Config, layer_idx: int):
        super().__init__()
        arch = ARCHITECTURES[cfg.model_type]
        layer_type = cfg.layer_types[layer_idx]
        # the config picks the mixer; its attribute is the checkpoint's name for it
        self.mixer_name = MIXER_ATTRIBUTE[layer_type]
        self.input_layernorm = arch.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.add_module(self.mixer_name, arch.mixers[layer_type](cfg, layer_idx))
        self.post_attention_layernorm = arch.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = arch.mlp(cfg, layer_idx)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x: torch.Tensor, cos, sin, cache=None) -> torch.Tensor:  # [B, T, hidden]
        x = x + self.mixer(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Token ids -> final hidden states: embedding, the decoder layers, the final norm."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = ARCHITECTURES[cfg.model_type].norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        cfg = self.config
        start = cache.length if cache is not None else 0  # the new tokens follow the cached ones
        x = self.embed_tokens(input_ids)  # [B, T, hidden]
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.layers[i] if cache is not None else None)
        return self.norm(x)  # [B, T, hidden]


class CausalLM(nn.Module):
    """input_ids [B, T] -> logits [B, T, vocab]; pass a cache from `new_cache` to continue."""

    # set by the loader: the checkpoint's generation_config.json, where the weights came from,
    # and whether they are the embedded stand-in
    generation_config: dict
    source: str
    is_standin: bool

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.generation_config, self.source, self.is_standin = {}, "built by hand", False

    def new_cache(self, batch_size: int = 1) -> Cache:
        """An empty cache: one state per layer, of the kind that layer's mixer keeps."""
        w = self.model.embed_tokens.weight
        states = [
            layer.mixer.new_state(batch_size, w.dtype, w.device) for layer in self.model.layers
        ]
        return Cache(states, batch_size)

    def forward(
        self, input_ids: torch.Tensor, cache: Cache | None = None, last_only: bool = False
    ) -> torch.Tensor:
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        limit = self.config.max_position_embeddings
        if start + T > limit:
            raise ValueError(
                f"{start + T} tokens ({start} cached + {T} new) exceed this model's context of "
                f"{limit} positions (max_position_embeddings); shorten the prompt or start a "
                f"new cache."
            )
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"the cache was made for batch size {cache.batch_size}, not {B}.")
        try:
            x = self.model(input_ids, cache)
        except BaseException:
            if cache is not None:
                cache.discard()  # a failed pass leaves the cache as it was
            raise
        if cache is not None:
            cache.commit(T)  # only now, once every layer has run
        if last_only:
            x = x[:, -1:]
        return self.lm_head(x)  # [B, T, vocab] (T = 1 with last_only)
