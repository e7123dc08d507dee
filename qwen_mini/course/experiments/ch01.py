"""Given experiment code of chapter 1 (attention): the figures of the attention maps and of the
KV cache's size. The functions the figures show come in as arguments (the notebook passes its
own: the learner's where they pass their checks)."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import torch

KiB, MiB = 1024, 1024**2


def plot_attention_maps(attention_weights, causal_mask, seed: int = 0) -> dict:
    """The causal mask of 8 tokens, the weights of 8 random queries and keys, and those of the
    last 3 queries after 5 cached keys; returns {title: [T_q, T_k]}."""
    # random queries and keys, scaled up a little so the maps have some contrast
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(8, 16, generator=g) * 2, torch.randn(8, 16, generator=g) * 2
    maps = {
        "causal_mask(8, 8)": causal_mask(8, 8).float(),
        "weights, 8 tokens": attention_weights(q, k, causal_mask(8, 8)),
        "weights, 3 new after 5 cached": attention_weights(q[5:], k, causal_mask(3, 8)),
    }
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), gridspec_kw={"width_ratios": [1, 1, 1]})
    for ax, (title, m) in zip(axes, maps.items(), strict=True):
        ax.imshow(m, cmap="viridis", vmin=0, vmax=1)
        ax.set_title(title)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ax.set_yticks(range(m.shape[0]))
        if m.shape[0] == 3:
            ax.set_yticklabels([5, 6, 7])
    plt.tight_layout()
    plt.show()
    return maps


def plot_kv_memory(per_token: dict, gdn_total: float, max_tokens: int = 32768) -> dict:
    """Bars of the KV cache per token of each model, and the whole cache against the context
    length for Qwen3-0.6B, Qwen2.5-0.5B and Qwen3.5-0.8B (whose DeltaNet states, `gdn_total`
    bytes, do not grow); returns the curves {label: bytes per context length}."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    names = sorted(per_token, key=per_token.get)
    left.barh(names, [per_token[n] / KiB for n in names], color="tab:blue")
    for i, n in enumerate(names):
        left.text(per_token[n] / KiB, i, f" {per_token[n] / KiB:.0f}", va="center")
    left.set_xscale("log")
    left.set_xlabel("KV cache per token, KiB (bfloat16, log scale)")
    tokens = 2.0 ** torch.arange(4, math.log2(max_tokens) + 0.01, 0.125)  # 16 ... max_tokens
    curves = {
        "Qwen3-0.6B": tokens * per_token["Qwen3-0.6B"],
        "Qwen2.5-0.5B": tokens * per_token["Qwen2.5-0.5B"],
        "Qwen3.5-0.8B (KV + GDN states)": gdn_total
        + tokens * per_token["Qwen3.5-0.8B (6 full layers)"],
    }
    for label, total in curves.items():
        right.plot(tokens, total / MiB, label=label)
    right.set_xscale("log", base=2)
    right.set_xlabel("tokens in context (log scale)")
    right.set_ylabel("cache, MiB (log scale)")
    right.set_yscale("log")
    right.legend()
    plt.tight_layout()
    plt.show()
    return curves


def plot_head_maps(maps: torch.Tensor, n_rep: int = 2) -> None:
    """The attention weights [H, T, T] of each head of one layer, side by side."""
    fig, axes = plt.subplots(1, len(maps), figsize=(3.5 * len(maps), 3.4))
    for h, ax in enumerate(axes):
        ax.imshow(maps[h], cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"head {h} (KV head {h // n_rep})")
        ax.set_xlabel("key position")
    axes[0].set_ylabel("query position")
    plt.tight_layout()
    plt.show()
