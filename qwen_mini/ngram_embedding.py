# Generated from solutions/ch06_family.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""The n-gram embedding (PLE) of Qwen3.8-Flash-Next: a huge hashed table of token n-grams,
looked up (no matrix multiply) and injected into the residual streams of a few layers.

For every position t and every order n = 2 .. N (`ngram_size`), the n-gram ending at t is hashed
by `heads_per_ngram` heads, each into its own table of a prime size p_h:

    mixed = (x_t * m_0) xor (x_{t-1} * m_1) xor ... xor (x_{t-n+1} * m_{n-1})     int64, wrapping
    row_h = mixed mod p_h + offset_h                    the heads' tables sit end to end

The multipliers m_i (odd, from a SplitMix64 of the seed and the layer's place in ple_layer_ids)
and the primes (consecutive from `ngram_vocab_size_base`, each layer taking the next ones) come
with the checkpoint as int64 buffers; they are checked here against the config. An n-gram never
reaches across an end-of-sequence token: a token before an eos (or before the first token) reads
as eos. The rows of all heads are concatenated into one embedding [E] (`ple_embed_dim`).

The layer (`PLELayer`) turns it into an addition to each stream s: a value v = W_v e, gated per
stream by how well a key W_k e matches the stream, plus a dilated causal convolution (dilation N)
over the gated values, so that nearby n-grams add up:

    g_s = signed_sqrt(norm(W_k e)_s . norm(h_s) / sqrt(H));   u_s = sigmoid(g_s) v
    h_s <- h_s + u_s + silu(conv(norm(u))_s)

A layer's state: the last N - 1 token ids (the next n-grams start in them) and the last
(K - 1) * N inputs of the convolution.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.config import Config
from qwen_mini.deltanet import DeltaNetState
from qwen_mini.streams import StreamNorm

MASK64 = (1 << 64) - 1


SPLITMIX_GAMMA = 0x9E3779B97F4A7C15


def splitmix64(value: int) -> int:
    """SplitMix64's finaliser: a 64-bit integer scrambled into another (Steele et al., 2014)."""
    value = (value + SPLITMIX_GAMMA) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def hash_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd multiplier of each of the N positions of an n-gram, in layer `ple_index` (its place
    in ple_layer_ids). Below 2^63 / vocab_size, so token * multiplier never overflows int64."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    layer_seed = seed + 10007 * ple_index  # another layer, other multipliers
    return [
        2 * (splitmix64((layer_seed + SPLITMIX_GAMMA * (i + 1)) & MASK64) % half_bound) + 1
        for i in range(ngram_size)
    ]


def is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def primes_from(start: int, count: int) -> list[int]:
    """The first `count` primes >= start."""
    primes, n = [], start
    while len(primes) < count:
        primes += [n] if is_prime(n) else []
        n += 1
    return primes


def head_table_sizes(cfg: Config, ple_index: int) -> list[int]:
    """The prime table size of each hash head of layer `ple_index`: the layers take consecutive
    primes from ngram_vocab_size_base, (N - 1) * heads_per_ngram each."""
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    return primes_from(cfg.ngram_vocab_size_base, (ple_index + 1) * heads)[ple_index * heads :]


def shard_rows(rows: int, parts: int) -> list[int]:
    """How a table of `rows` rows is stored in `parts` shards: as torch.chunk cuts it, pieces of
    ceil(rows / parts) rows and a shorter last one (so sometimes fewer than `parts` pieces)."""
    size = -(-rows // parts)
    return [min(size, rows - start) for start in range(0, rows, size)]


class ShardedEmbedding(nn.Module):
    """One embedding table stored in shards (`shard_0.weight`, `shard_1.weight`, ...: the
    checkpoint's layout), looked up without ever concatenating them: the real table is 51 B
    parameters, and a concatenated copy would double the memory it takes."""

    def __init__(self, rows: int, dim: int, parts: int):
        super().__init__()
        self.sizes = shard_rows(rows, parts)
        for i, n in enumerate(self.sizes):
            self.add_module(f"shard_{i}", nn.Embedding(n, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., dim]
        shard, local = ids // self.sizes[0], ids % self.sizes[0]  # every shard but the last full
        first = self.shard_0.weight
        out = first.new_empty(*ids.shape, first.shape[1])
        for i in shard.unique().tolist():  # only the shards some id falls in
            where = shard == i
            out[where] = getattr(self, f"shard_{i}")(local[where])
        return out


def shift_within_segment(tokens: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """tokens [B, L] -> [B, L - shift]: for each position t >= shift, the token `shift` places
    back, or eos if an eos lies between (the n-gram would cross into the previous text)."""
    L = tokens.shape[1]
    back = tokens[:, : L - shift]  # x_{t - shift}
    between = torch.zeros_like(back, dtype=torch.bool)
    for j in range(1, shift):  # x_{t - j}, the tokens after it and before t
        between |= tokens[:, shift - j : L - j] == eos
    return back.masked_fill(between, eos)


class NGramEmbedding(nn.Module):
    """The hashed n-gram table of one layer: input_ids [B, T] -> embeddings [B, T, ple_embed_dim].
    Named as the checkpoint: `ngram_embedding.shard_{i}.weight` and the int64 buffers
    `layer_multipliers` [N], `ngram_heads_vocab_sizes` and `ngram_heads_offsets` [heads]."""

    def __init__(self, cfg: Config, ple_index: int):
        super().__init__()
        self.N, self.per_order = cfg.ngram_size, cfg.heads_per_ngram
        self.eos = cfg.eos_token_ids[0]  # the segment separator, as transformers takes it
        self.ple_index = ple_index
        sizes = head_table_sizes(cfg, ple_index)
        offsets = [sum(sizes[:h]) for h in range(len(sizes))]  # the heads' tables end to end
        multipliers = hash_multipliers(cfg.vocab_size, self.N, ple_index, cfg.seed)
        self.multipliers, self.sizes, self.offsets = multipliers, sizes, offsets  # as numbers
        for name, values in self.implied_buffers().items():  # stored in the checkpoint too
            self.register_buffer(name, torch.tensor(values, dtype=torch.int64))
        divisor = cfg.make_ngram_vocab_size_divisible_by
        rows = -(-sum(sizes) // divisor) * divisor  # padded up to a multiple of the divisor
        dim = cfg.ple_embed_dim // len(sizes)  # each head's share of the embedding
        self.ngram_embedding = ShardedEmbedding(rows, dim, cfg.split_ngram_parts)

    def table_rows(self, input_ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T], history [B, N-1] (the tokens before them; eos at the start) ->
        [B, T, heads]: the table row of every hash head at every position."""
        tokens = torch.cat([history, input_ids], dim=1).long()  # [B, N-1+T]
        T, m = input_ids.shape[1], self.layer_multipliers
        mixed = tokens[:, self.N - 1 :] * m[0]  # [B, T]: the n-gram of order 1 so far
        rows = []
        for n in range(2, self.N + 1):  # extend by one token back, then hash every head of n
            back = shift_within_segment(tokens, n - 1, self.eos)[:, -T:]
            mixed = mixed ^ (back * m[n - 1])
            heads = slice((n - 2) * self.per_order, (n - 1) * self.per_order)
            sizes, offsets = self.ngram_heads_vocab_sizes[heads], self.ngram_heads_offsets[heads]
            rows.append(torch.remainder(mixed[..., None], sizes) + offsets)  # [B, T, heads of n]
        return torch.cat(rows, dim=-1)

    def forward(self, input_ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        return self.ngram_embedding(self.table_rows(input_ids, history)).flatten(-2)

    def stored_problem(self) -> str | None:
        """What is wrong with the hash buffers as loaded, or None. They must be the ones the
        config implies (seed, vocab_size, ngram_vocab_size_base, the layer's place in
        ple_layer_ids): other multipliers or primes send every n-gram to rows the table was not
        trained for, a silently different model."""
        for name, want in self.implied_buffers().items():
            got = getattr(self, name)
            if got.dtype != torch.int64 or got.tolist() != want:
                return (
                    f"{name} holds {got.tolist()} ({got.dtype}), but config.json implies {want} "
                    f"(int64): config.json and the weights belong to different models"
                )
        return None

    def implied_buffers(self) -> dict[str, list[int]]:
        return {
            "layer_multipliers": self.multipliers,
            "ngram_heads_vocab_sizes": self.sizes,
            "ngram_heads_offsets": self.offsets,
        }


def dilated_causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, dilation: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution with taps `dilation` apart, continuing from a state.

    x [B, C, T]; weight [C, 1, K]; state [B, C, (K-1) * dilation], the inputs before x (zeros at
    the start). Output t reads inputs t, t - d, ..., t - (K-1) d. Returns (y [B, C, T], the new
    state: the last (K-1) * dilation inputs).
    """
    full = torch.cat([state.to(x.dtype), x], dim=-1)
    y = F.conv1d(full, weight, groups=x.shape[1], dilation=dilation)
    return y, full[:, :, full.shape[-1] - state.shape[-1] :]


class PLEState(DeltaNetState):
    """The n-gram embedding's memory: the convolution's last inputs `conv` [B, C, (K-1) N] and
    the last N-1 token ids `history` [B, N-1] (eos before the first), kept where a DeltaNet state
    keeps its recurrent matrix: staged by `update`, made current by `commit` (DeltaNetState)."""

    def __init__(self, history: torch.Tensor, conv: torch.Tensor):
        self.conv, self.recurrent = conv, history
        self.length = 0
        self.staged_conv = self.staged_recurrent = None  # what update staged, until commit

    @property
    def history(self) -> torch.Tensor:
        return self.recurrent

    def update(self, history: torch.Tensor, conv: torch.Tensor) -> None:
        self.staged_conv, self.staged_recurrent = conv, history  # as they are: ids stay integers


def signed_sqrt(x: torch.Tensor) -> torch.Tensor:
    """sign(x) sqrt(|x|), with |x| floored at 1e-6: a gate that grows slower than the dot."""
    return x.abs().clamp_min(1e-6).sqrt() * x.sign()


class PLELayer(nn.Module):
    """The n-gram embedding of one layer, added to its streams before the mixer:
    h [B, T, n, H], input_ids [B, T] -> the addition [B, T, n, H] (`layers.{i}.ple.`)."""

    def __init__(self, cfg: Config, ple_index: int):
        super().__init__()
        n, H, E = cfg.hc_count, cfg.hidden_size, cfg.ple_embed_dim
        self.n_streams, self.hidden = n, H
        self.dilation = cfg.ngram_size  # a tap per n-gram length: the n-grams side by side
        self.ple_embedding = NGramEmbedding(cfg, ple_index)
        self.key_proj = nn.Linear(E, n * H, bias=False)  # a key per stream
        self.value_proj = nn.Linear(E, H, bias=False)  # one value for all streams
        self.norm_key = StreamNorm(n, H, cfg.rms_norm_eps)
        self.norm_query = StreamNorm(n, H, cfg.rms_norm_eps)
        self.norm_conv = StreamNorm(n, H, cfg.rms_norm_eps)
        K = cfg.ple_conv_kernel_size
        self.conv1d = nn.Conv1d(
            n * H, n * H, K, groups=n * H, dilation=self.dilation, bias=False
        )  # weight [n * H, 1, K], depthwise
        self.state_len = (K - 1) * self.dilation

    def new_state(self, batch_size: int, dtype: torch.dtype, device=None) -> PLEState:
        N, C = self.ple_embedding.N, self.n_streams * self.hidden
        history = torch.full((batch_size, N - 1), self.ple_embedding.eos, device=device)
        conv = torch.zeros(batch_size, C, self.state_len, dtype=dtype, device=device)
        return PLEState(history, conv)

    def forward(self, h, input_ids, cache: PLEState | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        if cache is not None:
            history, conv_state = cache.history, cache.conv
        else:  # a new sequence: eos before it, zeros into the convolution
            fresh = self.new_state(B, h.dtype, h.device)
            history, conv_state = fresh.history, fresh.conv
        e = self.ple_embedding(input_ids, history)  # [B, T, E]
        key = self.norm_key(self.key_proj(e).unflatten(-1, (self.n_streams, self.hidden)))
        query = self.norm_query(h)  # [B, T, n, H]
        gate = signed_sqrt((key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden))
        u = torch.sigmoid(gate) * self.value_proj(e)[:, :, None]  # [B, T, n, H]
        conv_in = self.norm_conv(u).flatten(-2).transpose(1, 2)  # [B, n * H, T]
        y, new_conv = dilated_causal_conv(conv_in, self.conv1d.weight, conv_state, self.dilation)
        if cache is not None:
            ids = torch.cat([history, input_ids.to(history.dtype)], dim=1)
            cache.update(ids[:, ids.shape[1] - history.shape[1] :], new_conv)
        return u + F.silu(y).transpose(1, 2).view_as(u)
