"""The Qwen2 / Qwen3 dense decoder. Module names follow the checkpoint keys exactly, so a
checkpoint's state dict loads with no renaming: `model.layers.3.self_attn.q_proj.weight`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention, KVCache
from .config import Config
from .foundations import MLP, RMSNorm, rope_cos_sin


def linear_all_threads(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T + bias, as F.linear, with every CPU thread in float32.

    In float32 on CPU, torch hands a product with one row (a decoding step) to a BLAS
    matrix-vector call that runs on one core: on a 2-core machine the weights stream at half
    the speed the memory allows. Splitting the weight's rows into one block per thread and
    multiplying the blocks as a batch lets torch run them side by side: up to 2x faster for one
    row, equal to F.linear up to float32 summation order (bench/README.md). bfloat16 already
    uses every thread.
    """
    n = torch.get_num_threads()
    worth_it = x.device.type == "cpu" and x.dtype == torch.float32 and n > 1
    if not worth_it or weight.shape[0] % n or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    rows = x.reshape(1, -1, x.shape[-1]).expand(n, -1, -1)  # [n, rows, in], no copy
    blocks = weight.view(n, -1, weight.shape[1])  # [n, out / n, in], no copy
    out = torch.bmm(rows, blocks.transpose(1, 2))  # [n, rows, out / n]
    out = out.transpose(0, 1).reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class ThreadedLinear(nn.Linear):
    """nn.Linear multiplying with `linear_all_threads`: same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_all_threads(x, self.weight, self.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache=None):  # [B, T, hidden] -> [B, T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """input_ids [B, T] -> logits [B, T, vocab]; pass a cache from `new_cache` to continue."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The chapters build every projection as a plain nn.Linear; for decoding speed on CPU
        # the package's model multiplies with every thread (the learner's modules need not).
        for module in self.modules():
            if type(module) is nn.Linear:
                module.__class__ = ThreadedLinear

    def new_cache(self, batch_size: int = 1) -> KVCache:
        cfg, w = self.config, self.model.embed_tokens.weight
        return KVCache(
            cfg.num_hidden_layers,
            batch_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype=w.dtype,
            device=w.device,
        )

    def forward(
        self, input_ids: torch.Tensor, cache: KVCache | None = None, last_only: bool = False
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
        if cache is not None and cache.shape[0] != B:
            raise ValueError(f"the cache was made for batch size {cache.shape[0]}, not {B}.")
        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        positions = torch.arange(start, start + T, device=input_ids.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache)
        if cache is not None:
            cache.length += T  # only now: a failed pass leaves the cache as it was
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x))  # [B, T, vocab] (T = 1 with last_only)
