"""The Qwen decoder, assembled from the blocks of an architecture row (`qwen_mini.architectures`).

Module names follow the checkpoint keys exactly, so a checkpoint's state dict loads with no
renaming: `model.layers.3.self_attn.q_proj.weight`.
"""

from __future__ import annotations

import torch
from torch import nn

from .architectures import Architecture, architecture, check_config
from .cache import Cache
from .config import Config
from .mtp import MTP


class Backbone(nn.Module):
    """What the checkpoint calls `model.`: the embedding, the decoder layers, the final norm
    (under the row's `final_name`: `norm`, or Qwen3.8's `hyper_connection_mixer`)."""

    def __init__(self, cfg: Config, arch: Architecture):
        super().__init__()
        self.config = cfg
        self.embed_tokens = arch.embedding(cfg, arch)
        layers = (arch.decoder_layer(cfg, i, arch) for i in range(cfg.num_hidden_layers))
        self.layers = nn.ModuleList(layers)
        self.add_module(arch.final_name, arch.final(cfg, arch))


class CausalLM(nn.Module):
    """input_ids [B, T] -> logits [B, T, vocab]; pass a cache from `new_cache` to continue."""

    # set by the loader: the checkpoint's generation_config.json, where the weights came from,
    # and whether they are the embedded stand-in
    generation_config: dict
    source: str
    is_standin: bool

    def __init__(self, cfg: Config, arch: Architecture | None = None):
        """The model `cfg` describes, built from the blocks of `arch` (by default the row of
        cfg.model_type; pass a row with blocks replaced to build from other blocks)."""
        super().__init__()
        arch = arch if arch is not None else architecture(cfg.model_type, "the config")
        check_config(cfg, arch, "the config")
        self.config, self.arch = cfg, arch
        self.model = Backbone(cfg, arch)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if cfg.mtp_num_hidden_layers:  # the multi-token-prediction head (`mtp.`), for drafting
            self.mtp = MTP(cfg, arch)  # registered last: the main weights keep their order
        self.generation_config, self.source, self.is_standin = {}, "built by hand", False

    def new_cache(self, batch_size: int = 1) -> Cache:
        """An empty cache: one state per layer, of the kind that layer's mixer keeps."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(
                f"new_cache: batch_size must be a whole number >= 1, got {batch_size!r}."
            )
        w = self.model.embed_tokens.weight
        # a layer that keeps more than its mixer's state (an n-gram embedding's) makes its own
        states = [
            getattr(layer, "new_state", layer.mixer.new_state)(batch_size, w.dtype, w.device)
            for layer in self.model.layers
        ]
        return Cache(states, batch_size)

    def forward(
        self, input_ids: torch.Tensor, cache: Cache | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] ([B, 1, vocab] with last_only).

        The pass is the row's `forward`: `model_forward` in qwen_mini/decoder.py (the embedding,
        the RoPE angles, each layer, the final norm, the head), or a pass a row puts in its
        place (Qwen3.8's residual streams, streams.py; yours, `with_blocks(forward=...)`).
        Around it: the input is checked first, and the cache is committed only once the whole
        pass has run (discarded if it fails), so it never describes half a pass.
        """
        self.check_input(input_ids, cache)
        try:
            logits = self.arch.forward(self, input_ids, cache, last_only)
        except BaseException:
            if cache is not None:
                cache.discard()  # a failed pass leaves the cache as it was
            raise
        if cache is not None:
            cache.commit(input_ids.shape[1])  # only now, once every layer has run
        return logits

    def check_input(self, input_ids: torch.Tensor, cache: Cache | None = None) -> None:
        """Refuse, naming what is wrong, input ids this model cannot run (not a [B, T] tensor of
        token ids in its vocabulary, or more positions than its context) and a cache that is
        not one of this model's for this batch."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(
                f"input_ids must be a torch.Tensor [batch, tokens] of token ids "
                f"(torch.tensor([[...]])), got {type(input_ids).__name__}."
            )
        if cache is not None and not (
            isinstance(cache, Cache) and len(cache.layers) == len(self.model.layers)
        ):
            raise TypeError(
                "cache must come from this model's new_cache() (one state per layer, "
                f"{len(self.model.layers)} layers), got {type(cache).__name__}."
            )
        if input_ids.dim() != 2:
            shape = list(input_ids.shape)
            raise ValueError(f"input_ids must be [batch, tokens], got shape {shape}.")
        if (
            input_ids.dtype.is_floating_point
            or input_ids.dtype.is_complex
            or (input_ids.dtype == torch.bool)
        ):
            raise ValueError(
                f"input_ids must hold whole-number token ids (torch.long), got {input_ids.dtype}."
            )
        if input_ids.numel() == 0:  # no position to compute: nothing a cache could commit
            raise ValueError(
                f"input_ids holds no tokens (shape {list(input_ids.shape)}); pass at least one "
                f"token id per row, [batch, tokens] with tokens >= 1."
            )
        V = self.config.vocab_size
        outside = (input_ids < 0) | (input_ids >= V)
        if bool(outside.any()):  # one wait for the device per pass (min and max were two)
            bad = input_ids[outside].unique()[:5].tolist()
            raise ValueError(
                f"input_ids {bad} are outside this model's vocabulary of {V} ids (0 to {V - 1}); "
                f"were they encoded with another tokenizer?"
            )
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
