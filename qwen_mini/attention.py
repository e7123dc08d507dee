# Generated from solutions/ch01_attention.ipynb, solutions/ch02_qk_norm.ipynb,
# solutions/ch05_deltanet.ipynb
# by python -m qwen_mini.course.build — edit the notebooks, not this file.

"""Causal self-attention with grouped KV heads and a KV cache (Qwen2, Qwen3), and the gated
attention of Qwen3.5 written as its difference from it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.config import Config
from qwen_mini.rope import apply_partial_rope, apply_rope


def causal_mask(t_new: int, t_total: int, device=None) -> torch.Tensor:
    """[t_new, t_total] bool, True where attention is allowed.

    The new queries sit at the end of the sequence: query i is position t_total - t_new + i and
    sees every key up to and including itself.
    """
    q_pos = torch.arange(t_total - t_new, t_total, device=device)[:, None]  # column
    k_pos = torch.arange(t_total, device=device)[None, :]  # row
    return k_pos <= q_pos  # broadcasts to [t_new, t_total]


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None):
    """q [..., T_q, D], k [..., T_k, D] -> weights [..., T_q, T_k]; each row sums to 1.

    mask: bool [T_q, T_k] (or broadcastable), True where attention is allowed.
    """
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # [..., T_q, T_k]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # exp(-inf) = 0: no weight at all
    return scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)


def attention(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention: q [..., T_q, D], k, v [..., T_k, D] -> [..., T_q, D]."""
    return attention_weights(q, k, mask) @ v


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, n_heads * D] -> [B, n_heads, T, D]."""
    B, T, _ = x.shape
    return x.view(B, T, n_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, n_heads, T, D] -> [B, T, n_heads * D]: the inverse of split_heads."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def repeat_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, T, D] -> [B, H_kv * n_rep, T, D]: each KV head serves n_rep query heads."""
    # heads 0,0,1,1,...: query head h reads KV head h // n_rep, as the checkpoint was trained
    return k.repeat_interleave(n_rep, dim=1)


class KVCache:
    """Keys and values of one attention layer for the tokens seen so far.

    Storage grows by doubling, so decoding does not copy the whole cache at every step.
    `length` only advances on `commit`, which the model calls once a forward pass has finished,
    so a failed call leaves the cache describing exactly the tokens it described before.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.shape = (batch_size, num_kv_heads, 0, head_dim)
        self.k = torch.empty(self.shape, dtype=dtype, device=device)
        self.v = torch.empty(self.shape, dtype=dtype, device=device)
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, H_kv, T, D] after the cached ones; return all keys and values so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.k.shape[2]:
            self.k, self.v = self._grow(self.k, end), self._grow(self.v, end)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def _grow(self, buf: torch.Tensor, needed: int) -> torch.Tensor:
        """A bigger buffer (`needed` slots, or double the old size, or 16), same content."""
        new = buf.new_empty(buf.shape[:2] + (max(needed, 2 * buf.shape[2], 16),) + buf.shape[3:])
        new[:, :, : self.length] = buf[:, :, : self.length]
        return new

    def commit(self, n_tokens: int) -> None:
        """The forward pass that wrote `n_tokens` new tokens has finished: they count now."""
        self.length += n_tokens

    def discard(self) -> None:
        """The forward pass failed; nothing to undo, since `length` never moved."""

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (the slots after them are written again later)."""
        self.length = n

    def nbytes(self) -> int:
        """Bytes held by the cached tokens (not the spare capacity)."""
        b, h, _, d = self.shape
        return 2 * b * h * self.length * d * self.k.element_size()


class Attention(nn.Module):
    """Grouped-query attention; QKV bias (Qwen2) and per-head QK-Norm (Qwen3) as the architecture
    row `arch` says (its `attention_biases(cfg)`, `qk_norm` and `norm`)."""

    config_fields = ("num_attention_heads", "num_key_value_heads", "head_dim")  # must be > 0

    def __init__(self, cfg: Config, layer_idx: int, arch):
        super().__init__()
        self.layer_idx = layer_idx  # its place in the model (the model hands it its own cache)
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        qkv_bias, o_bias = arch.attention_biases(cfg)
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        if arch.qk_norm:  # given: one norm over head_dim, shared by all heads
            self.q_norm = arch.norm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = arch.norm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, cache: KVCache | None = None):
        """x [B, T, hidden] -> [B, T, hidden]; cos, sin [T, head_dim] are the new positions' angles.

        With a cache (this layer's KVCache), the T new tokens also attend to the cached ones, and
        their keys and values are stored in it (the model commits them once every layer has run).
        """
        q = split_heads(self.q_proj(x), self.n_heads)  # [B, H, T, D]
        k = split_heads(self.k_proj(x), self.n_kv_heads)  # [B, H_kv, T, D]
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        if self.q_norm is not None:  # QK-Norm: after the projection, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(merge_heads(self.attend(q, k, v, cache)))

    def attend(self, q, k, v, cache: KVCache | None = None) -> torch.Tensor:
        """q [B, H, T, D], k, v [B, H_kv, T, D], rotated -> [B, H, T, D]: the T new queries attend
        to the cached keys and to the new ones up to themselves; the new keys and values go into
        the cache, if one is given."""
        T = q.shape[2]
        if cache is not None:
            k, v = cache.update(k, v)  # [B, H_kv, T_total, D]
        t_total = k.shape[2]
        if T == 1:
            mask, is_causal = None, False  # one new token sees everything cached
        elif T == t_total:
            mask, is_causal = None, True  # no cache: the plain (top-left) triangle is right
        else:
            mask, is_causal = causal_mask(T, t_total, q.device), False  # queries after a cache
        n_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)

    def new_state(self, batch_size: int, dtype: torch.dtype, device=None) -> KVCache:
        """The empty cache this layer keeps while generating (the model asks every layer)."""
        return KVCache(batch_size, self.n_kv_heads, self.head_dim, dtype, device or "cpu")


class QKVBiasAttention(Attention):
    """Qwen2 / Qwen2.5 attention: `Attention` with a bias on q_proj, k_proj and v_proj,
    none on o_proj and no QK-Norm, whatever the row's flags say. Its forward is `Attention`'s."""

    def __init__(self, cfg: Config, layer_idx: int, arch):
        super().__init__(cfg, layer_idx, arch)
        hidden, q_width = cfg.hidden_size, self.n_heads * self.head_dim
        kv_width = self.n_kv_heads * self.head_dim  # grouped KV heads: narrower than q
        self.q_proj = nn.Linear(hidden, q_width, bias=True)
        self.k_proj = nn.Linear(hidden, kv_width, bias=True)
        self.v_proj = nn.Linear(hidden, kv_width, bias=True)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)  # Qwen2: no bias on the output
        self.q_norm = self.k_norm = None  # no QK-Norm (the biases do not bound the logits)


def split_query_gate(q_proj_out: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, H * 2D] -> (q, gate) [B, T, H, D] each: per head, D query dims then D gate dims."""
    B, T, _ = q_proj_out.shape
    q, gate = q_proj_out.reshape(B, T, n_heads, -1).chunk(2, dim=-1)  # per head: query | gate
    return q, gate


class GatedAttention(Attention):
    """Qwen3.5's full attention: `Attention` with an output gate and partial RoPE (its q/k norms
    are the row's, zero-centred). q_proj makes 2 * head_dim per head: query then gate."""

    def __init__(self, cfg: Config, layer_idx: int, arch):
        super().__init__(cfg, layer_idx, arch)
        bias = self.q_proj.bias is not None
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim * 2, bias=bias)

    def forward(self, x, cos, sin, cache: KVCache | None = None):
        """x [B, T, hidden] -> [B, T, hidden]; cos, sin [T, rotary_dim] (rotary_dim <= head_dim)."""
        B, T, _ = x.shape
        q, gate = split_query_gate(self.q_proj(x), self.n_heads)  # [B, T, H, D] each
        q = self.q_norm(q.transpose(1, 2))  # [B, H, T, D]: norm before RoPE, as in Qwen3
        k = self.k_norm(split_heads(self.k_proj(x), self.n_kv_heads))  # [B, H_kv, T, D]
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        out = merge_heads(self.attend(q, k, v, cache))  # [B, T, H * D]
        out = out * torch.sigmoid(gate.reshape(B, T, -1))  # the gate: each output channel, 0..1
        return self.o_proj(out)
