"""Qwen Sparse Attention: one decode step of the indexed attention layer vs full (gated)
attention at the same shape, as the cached context grows; the package's and transformers',
alternating in one process. The layer of Qwen3.8-Flash-Next: hidden 2560, 24 query / 2 KV heads
of 256, an indexer of 4 heads of 128 keeping 2048 tokens in blocks of 4.

    python bench/bench_sparse_attention.py                   # 2k, 8k, 32k cached tokens
    python bench/bench_sparse_attention.py --contexts 2048 --steps 3     # a quick run

The caches are filled directly with random keys, values and raw index keys (speed does not
depend on the values), float32, batch 1. Each figure is the median of `--steps` steps, each step
adding its token to the cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen4ExpTextConfig
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention
from transformers.models.qwen4_exp.modeling_qwen4_exp import (
    Qwen4ExpTextAttention,
    Qwen4ExpTextRotaryEmbedding,
)

from qwen_mini.architectures import ARCHITECTURES, config_from_dict
from qwen_mini.attention import GatedAttention
from qwen_mini.rope_scaling import rotary_cos_sin
from qwen_mini.sparse_attention import IndexedAttention

SHAPE = dict(
    vocab_size=256,
    hidden_size=2560,
    num_hidden_layers=1,
    layer_types=["full_attention"],
    num_attention_heads=24,
    num_key_value_heads=2,
    head_dim=256,
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=2048,
    indexer_compress_ratio=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    eos_token_id=1,
)


def median_step(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours(layer, cfg, n: int, steps: int, indexed: bool) -> float:
    """Median seconds of one decode step of our `layer` after n cached tokens."""
    g = torch.Generator().manual_seed(0)
    cache = layer.new_state(1, torch.float32)
    kv = (1, layer.n_kv_heads, n, layer.head_dim)
    cache.update(torch.randn(kv, generator=g), torch.randn(kv, generator=g))
    if indexed:
        cache.update_index(torch.randn(1, n, layer.indexer.head_dim, generator=g))
    cache.commit(n)
    x = torch.randn(1, 1, cfg.hidden_size, generator=g)

    def step():
        cos, sin = rotary_cos_sin(cfg, torch.tensor([cache.length]))
        layer(x, cos, sin, cache)
        cache.commit(1)

    return median_step(step, steps)


def theirs(layer, hf_cfg, rotary, n: int, steps: int, indexed: bool) -> float:
    """Median seconds of one decode step of transformers' `layer` after n cached tokens."""
    g = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=hf_cfg)
    kv = (1, hf_cfg.num_key_value_heads, n, hf_cfg.head_dim)
    cache.update(torch.randn(kv, generator=g), torch.randn(kv, generator=g), 0)
    if indexed:
        cache.update_indexer(torch.randn(1, n, hf_cfg.indexer_head_dim, generator=g), 0)
    x = torch.randn(1, 1, hf_cfg.hidden_size, generator=g)

    def step():
        t = cache.get_seq_length()
        # the indexer reads the angles of every position (block starts), the attention the last
        positions = torch.arange(0 if indexed else t, t + 1).view(1, 1, -1).expand(3, 1, -1)
        mask = torch.ones(1, 1, 1, t + 1, dtype=torch.bool)
        layer(x, rotary(x, positions), attention_mask=mask, past_key_values=cache)

    return median_step(step, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    cfg = config_from_dict({"model_type": "qwen4_exp_text", **SHAPE})
    arch = ARCHITECTURES["qwen4_exp_text"]
    our_indexed, our_full = IndexedAttention(cfg, 0, arch), GatedAttention(cfg, 0, arch)
    hf_cfg = Qwen4ExpTextConfig(**SHAPE)
    hf_cfg._attn_implementation = "sdpa"
    their_indexed, their_full = Qwen4ExpTextAttention(hf_cfg, 0), Qwen3_5Attention(hf_cfg, 0)
    rotary = Qwen4ExpTextRotaryEmbedding(hf_cfg)
    print(f"threads {torch.get_num_threads()}; ms per decode step (median of {args.steps})")
    print("cached   qwen_mini indexed / full    transformers indexed / full")
    for n in args.contexts:
        row = [
            ours(our_indexed, cfg, n, args.steps, True),
            ours(our_full, cfg, n, args.steps, False),
            theirs(their_indexed, hf_cfg, rotary, n, args.steps, True),
            theirs(their_full, hf_cfg, rotary, n, args.steps, False),
        ]
        print(f"{n:>6}   " + "   ".join(f"{1e3 * t:8.2f}" for t in row))


if __name__ == "__main__":
    main()
