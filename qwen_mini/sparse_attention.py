# Generated from solutions/ch06_family.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Qwen Sparse Attention (QSA), the attention of Qwen3.8-Flash-Next: each query attends only to
the few blocks of the context a small indexer scores highest, plus the tokens of the block it is
in that is not complete yet.

The indexer has `indexer_n_heads` query heads and one key head of `indexer_head_dim`, from one
projection (`index_qk_proj`). Its cache keeps the *raw* key of every position. The context is cut
into blocks of `indexer_compress_ratio` (r) tokens; a complete block b (tokens b r .. b r + r - 1)
is represented by

    k_b = RoPE(norm(mean of its r raw keys), at position b r)          mean in float32

and scored for a query q (normalised and rotated at its own position, one vector per head) as

    score_b = sum_h relu(q_h . k_b) / sqrt(d)

The query keeps the top min(budget / r, complete blocks it sees) blocks (`indexer_budget` tokens)
and every token after its last complete block (the tail, up to itself); the gated attention of
Qwen3.5 then runs masked to those tokens. The query's own block, once complete, can be dropped.
A step of decoding therefore reads at most budget + r - 1 keys and values, however long the
context: what grows is only the scoring, one small dot product per block.

ReLU scores are exactly 0 for every block all heads score negatively. Ties at the top-k
boundary are broken as transformers breaks them on the CPU: by torch.topk over exactly the
blocks a query sees (a longer row, padded with -inf, can keep another of the tied blocks).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.attention import GatedAttention, KVCache
from qwen_mini.config import Config
from qwen_mini.rope import apply_partial_rope
from qwen_mini.rope_scaling import rotary_cos_sin


def index_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B, h, T, d], keys [B, n, d] -> scores [B, T, n] (float32): for every query and block,
    sum over the heads of relu(q_h . k_b), divided by sqrt(d)."""
    dots = q.float() @ keys.float()[:, None].transpose(-1, -2)  # [B, h, T, n], in float32
    return dots.relu().sum(dim=1) / math.sqrt(q.shape[-1])  # relu per head, then the vote


def select_blocks(scores: torch.Tensor, t_all: int, ratio: int, top_blocks: int) -> torch.Tensor:
    """scores [B, T, n_blocks] of the last T of t_all positions -> keep [B, T, t_all] (bool):
    the top `top_blocks` complete blocks each query sees, and its tail (itself included)."""
    B, T, n = scores.shape
    r, device = ratio, scores.device
    q_pos = torch.arange(t_all - T, t_all, device=device)[:, None]  # [T, 1]
    complete = (q_pos + 1) // r  # [T, 1]: the blocks a query sees whole
    seen = torch.arange(n, device=device) < complete  # [T, n]
    chosen = torch.zeros(B, T, n, dtype=torch.bool, device=device)
    k = min(top_blocks, n)
    if k > 0:  # blocks it cannot see score -inf; any picked anyway are dropped by `seen`
        top = scores.masked_fill(~seen, float("-inf")).topk(k, dim=-1).indices
        chosen = chosen.scatter(-1, top, True) & seen
    k_pos = torch.arange(t_all, device=device)  # [t_all]
    tail = (k_pos >= complete * r) & (k_pos <= q_pos)  # [T, t_all]
    keep = tail.expand(B, T, t_all)
    if n:  # the tokens of the chosen blocks (positions past the last block are in none)
        block_of = (k_pos // r).clamp(max=n - 1)
        keep = keep | (chosen[..., block_of] & (k_pos < n * r))
    return keep  # [B, T, t_all]


class IndexedKVCache(KVCache):
    """An attention layer's keys and values, and the indexer's raw key of every position
    (`index_keys` [B, 1, T, d]); both advance on `commit` (see KVCache). It also keeps the key of
    each complete block once computed (`blocks`), so a decoding step pools only a new block: a
    block's key counts only while all its tokens are committed, so a failed pass or a truncation
    never leaves a stale one in use."""

    def __init__(self, batch_size, num_kv_heads, head_dim, index_dim, dtype, device="cpu"):
        super().__init__(batch_size, num_kv_heads, head_dim, dtype, device)
        self.index_keys = torch.empty(batch_size, 1, 0, index_dim, dtype=dtype, device=device)
        self.blocks = torch.empty_like(self.index_keys)  # as many slots (blocks <= tokens)
        self.n_blocks = 0  # block keys written

    def update_index(self, raw: torch.Tensor) -> torch.Tensor:
        """Store the raw index keys [B, T, d] of the new tokens; return all so far [B, T_all, d]."""
        start, end = self.length, self.length + raw.shape[1]
        if end > self.index_keys.shape[2]:
            self.index_keys = self._grow(self.index_keys, end)
            self.blocks = self._grow(self.blocks, end)
        self.index_keys[:, 0, start:end] = raw
        return self.index_keys[:, 0, :end]

    def known_blocks(self, ratio: int) -> int:
        """How many leading block keys are stored and still describe committed tokens."""
        return min(self.n_blocks, self.length // ratio)

    def update_blocks(self, start: int, keys: torch.Tensor) -> torch.Tensor:
        """Store block keys [B, n, d] from block `start` on; return all so far [B, start + n, d]."""
        end = start + keys.shape[1]
        self.blocks[:, 0, start:end] = keys
        self.n_blocks = end
        return self.blocks[:, 0, :end]

    def nbytes(self) -> int:
        b, _, _, d = self.index_keys.shape
        return super().nbytes() + b * self.length * d * self.index_keys.element_size()


class QSAIndexer(nn.Module):
    """Which cached tokens each new query attends to: x [B, T, hidden] -> keep [B, T, T_all]."""

    def __init__(self, cfg: Config, arch):
        super().__init__()
        self.cfg = cfg  # the RoPE angles of the block starts, anywhere in the context
        self.n_heads, self.head_dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio = cfg.indexer_compress_ratio
        self.top_blocks = cfg.indexer_budget // self.ratio
        d = self.head_dim
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.n_heads + 1) * d, bias=False)
        self.q_layernorm = arch.norm(d, cfg.rms_norm_eps)
        self.k_layernorm = arch.norm(d, cfg.rms_norm_eps)

    def block_keys(self, raw: torch.Tensor, first: int = 0) -> torch.Tensor:
        """raw keys [B, T_all, d] -> the key of each complete block from block `first` on
        [B, n_blocks - first, d]."""
        B, T_all, d = raw.shape
        n, r = T_all // self.ratio, self.ratio
        blocks = raw[:, first * r : n * r].reshape(B, n - first, r, d)
        pooled = blocks.float().mean(dim=2).to(raw.dtype)
        starts = torch.arange(first, n, device=raw.device) * r  # each at its first position
        cos, sin = rotary_cos_sin(self.cfg, starts, raw.dtype)  # [n - first, rotary_dim]
        return apply_partial_rope(self.k_layernorm(pooled), cos, sin)

    def block_scores(self, x, cos, sin, cache: IndexedKVCache | None = None) -> torch.Tensor:
        """scores [B, T, n_blocks] (float32) of every complete block for every new query; the
        new raw keys go into the cache."""
        B, T, _ = x.shape
        q, raw = self.index_qk_proj(x).split([self.n_heads * self.head_dim, self.head_dim], -1)
        q = self.q_layernorm(q.view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_partial_rope(q, cos, sin)  # [B, h, T, d], at the queries' positions
        if cache is not None:
            raw = cache.update_index(raw)  # [B, T_all, d]
        if cache is not None:  # only the blocks not pooled before
            known = cache.known_blocks(self.ratio)
            keys = cache.update_blocks(known, self.block_keys(raw, known))  # [B, n_blocks, d]
        else:
            keys = self.block_keys(raw)
        return index_scores(q, keys)  # [B, T, n_blocks]

    def select(self, scores: torch.Tensor, t_all: int) -> torch.Tensor:
        """scores [B, T, n_blocks] of the last T of t_all positions -> keep [B, T, t_all]:
        select_blocks on 1 for each block `chosen` keeps and 0 for the others."""
        return select_blocks(self.chosen(scores, t_all), t_all, self.ratio, self.top_blocks)

    def chosen(self, scores: torch.Tensor, t_all: int) -> torch.Tensor:
        """scores [B, T, n_blocks] -> 1.0 where a query keeps a block, else 0.0 [B, T, n_blocks].

        Blocks every head scores negatively all score exactly 0, so the top-k boundary can fall
        inside a tie, and which tied block torch.topk keeps depends on the length of the row it
        is given. As in transformers, each query's top k is taken over exactly the blocks it
        sees: the queries that see the same number of blocks (up to r in a row) in one call."""
        r, first = self.ratio, t_all - scores.shape[1]  # first: the first query's position
        chosen = torch.zeros_like(scores)
        start = first
        while start < t_all:
            seen = (start + 1) // r  # the complete blocks the query at `start` sees ...
            end = min((seen + 1) * r - 1, t_all)  # ... as do the queries up to `end`
            if seen:
                rows = slice(start - first, end - first)
                top = scores[:, rows, :seen].topk(min(self.top_blocks, seen), dim=-1).indices
                chosen[:, rows].scatter_(-1, top, 1.0)  # [B, end - start, n]
            start = end
        return chosen

    def top_blocks_of_last(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [B, 1, n_blocks] of the last position -> the blocks it keeps [B, k]. It sees
        every complete block, so no mask over the context is needed (decoding)."""
        return scores[:, 0].topk(min(self.top_blocks, scores.shape[-1]), dim=-1).indices

    def forward(self, x, cos, sin, cache: IndexedKVCache | None = None) -> torch.Tensor:
        """keep [B, T, T_all]; when decoding (one new token after a cache), the kept block ids
        [B, k] instead, so that nothing the size of the context is built."""
        scores = self.block_scores(x, cos, sin, cache)
        if cache is not None and x.shape[1] == 1:
            return self.top_blocks_of_last(scores)
        t_all = (cache.length if cache is not None else 0) + x.shape[1]
        return self.select(scores, t_all)


class IndexedAttention(GatedAttention):
    """Qwen3.5's gated attention, masked to the tokens its `indexer` keeps (QSA)."""

    config_fields = GatedAttention.config_fields + (
        "indexer_n_heads",
        "indexer_head_dim",
        "indexer_budget",
        "indexer_compress_ratio",
    )

    def __init__(self, cfg: Config, layer_idx: int, arch):
        super().__init__(cfg, layer_idx, arch)
        self.indexer = QSAIndexer(cfg, arch)
        self.keep = None  # during a forward pass, what attend may read: see QSAIndexer.forward

    def forward(self, x, cos, sin, cache: IndexedKVCache | None = None):
        """x [B, T, hidden] -> [B, T, hidden], as GatedAttention, the indexer choosing the keys."""
        self.keep = self.indexer(x, cos, sin, cache)  # before the parent stores k and v
        try:
            return super().forward(x, cos, sin, cache)
        finally:
            self.keep = None

    def attend(self, q, k, v, cache: IndexedKVCache | None = None) -> torch.Tensor:
        """q [B, H, T, D], k, v [B, H_kv, T, D] -> [B, H, T, D], each query over its kept keys."""
        if cache is not None:
            k, v = cache.update(k, v)  # [B, H_kv, T_all, D]
        # enable_gqa: query head h reads KV head h // (H / H_kv), as repeat_kv lays them out,
        # without copying each KV head H / H_kv times
        if self.keep.dim() == 2:  # decoding: read only the kept blocks and the tail
            k, v = self.kept(k, self.keep), self.kept(v, self.keep)  # [B, H_kv, n_kept, D]
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        mask = self.keep[:, None]  # [B, 1, T, T_all], causal already
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def kept(self, t: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """t [B, H_kv, T_all, D] -> the rows of the kept `blocks` [B, k] and of the incomplete
        tail [B, H_kv, k r + tail, D]: a step reads the budget, not the context. The cache is
        viewed as [B, H_kv, n_blocks, r D], so each kept block is one piece to copy; index_select
        on a 4-D view stays this cheap (on a 3-D row of it, torch copies the whole row first).
        Attention does not depend on the order of the keys, as long as values follow their keys."""
        B, H, t_all, D = t.shape
        r = self.indexer.ratio
        whole = t_all // r * r
        by_block = t[:, :, :whole].view(B, H, whole // r, r * D)  # a view: nothing copied
        picked = torch.cat([by_block[b : b + 1].index_select(2, i) for b, i in enumerate(blocks)])
        return torch.cat([picked.view(B, H, blocks.shape[1] * r, D), t[:, :, whole:]], dim=2)

    def new_state(self, batch_size: int, dtype: torch.dtype, device=None) -> IndexedKVCache:
        dims = (self.n_kv_heads, self.head_dim, self.indexer.head_dim)
        return IndexedKVCache(batch_size, *dims, dtype, device or "cpu")


def indexer_problems(t: dict) -> list[str]:
    """What the indexer needs of config.json's text fields `t` (see qwen_mini.validation)."""
    from qwen_mini.validation import _show, _size_problem

    if not {"full_attention", "indexed_attention"} & set(t.get("layer_types") or []):
        return []
    names = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget")
    names += ("indexer_compress_ratio",)
    problems = [f"{n} {_size_problem(t.get(n), 1)} (the sparse attention's indexer)"
                for n in names if _size_problem(t.get(n), 1)]  # fmt: skip
    if problems:
        return problems
    if t["indexer_kv_heads"] != 1:
        problems.append(
            f"indexer_kv_heads is {_show(t['indexer_kv_heads'])}, but Qwen Sparse Attention has "
            f"one index key head (the one the released model has)"
        )
    if t["indexer_budget"] % t["indexer_compress_ratio"]:
        problems.append(
            f"indexer_budget = {t['indexer_budget']} must be a multiple of "
            f"indexer_compress_ratio = {t['indexer_compress_ratio']} (whole blocks are kept)"
        )
    rope = t.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0))
    rotary = int((t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]) * factor)
    if rotary > t["indexer_head_dim"]:
        problems.append(
            f"RoPE turns {rotary} dimensions of each head, more than indexer_head_dim = "
            f"{t['indexer_head_dim']}: the index heads are rotated by the same angles"
        )
    return problems


IndexedAttention.config_problems = staticmethod(indexer_problems)
