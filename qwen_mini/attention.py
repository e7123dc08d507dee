"""Chapter 1: causal self-attention with grouped KV heads and a KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config
from .foundations import RMSNorm, apply_rope


def repeat_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, T, D] -> [B, H_kv * n_rep, T, D]: each KV head serves n_rep query heads."""
    return k.repeat_interleave(n_rep, dim=1)


def causal_mask(t_new: int, t_total: int, device=None) -> torch.Tensor:
    """[t_new, t_total] bool, True where attention is allowed.

    The new queries sit at the end of the sequence: query i is position t_total - t_new + i and
    sees every key up to and including itself.
    """
    q_pos = torch.arange(t_total - t_new, t_total, device=device)[:, None]
    k_pos = torch.arange(t_total, device=device)[None, :]
    return k_pos <= q_pos


class KVCache:
    """Keys and values of every layer for the tokens seen so far.

    Storage grows by doubling, so decoding does not copy the whole cache at every step.
    `length` only advances once a forward pass has finished, so a failed call leaves the cache
    describing exactly the tokens it described before.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.shape = (batch_size, num_kv_heads, 0, head_dim)
        self.k = [torch.empty(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, H_kv, T, D] after the cached ones; return all keys and values so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.k[layer].shape[2]:
            self.k[layer] = self._grow(self.k[layer], end)
            self.v[layer] = self._grow(self.v[layer], end)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def _grow(self, buf: torch.Tensor, needed: int) -> torch.Tensor:
        new = buf.new_empty(buf.shape[:2] + (max(needed, 2 * buf.shape[2], 16),) + buf.shape[3:])
        new[:, :, : self.length] = buf[:, :, : self.length]
        return new

    def nbytes(self) -> int:
        """Bytes held by the cached tokens (not the spare capacity)."""
        b, h, _, d = self.shape
        return 2 * len(self.k) * b * h * self.length * d * self.k[0].element_size()


class Attention(nn.Module):
    """Grouped-query attention; optional QKV bias (Qwen2) and per-head QK-Norm (Qwen3)."""

    def __init__(self, cfg: Config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, cache: KVCache | None = None):  # x: [B, T, hidden]
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:  # QK-Norm comes before RoPE (see FACTS / chapter 2)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # [B, H_kv, T_total, D]
        t_total = k.shape[2]
        if T == 1:
            mask, is_causal = None, False  # one new token sees everything cached
        elif T == t_total:
            mask, is_causal = None, True
        else:
            mask, is_causal = causal_mask(T, t_total, x.device), False
        rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
