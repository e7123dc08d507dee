"""Given experiment code of chapter 1 (attention): the figures of the attention maps, of the
query-to-KV-head mappings and of the KV cache's size; the decoding-time comparison; the
regrouping of a whole model's KV heads; and the two tiny models trained in sections 10 and 11
(copying, and byte-level Python read past its trained length), their data, training and tables.
The functions and blocks the experiments run come in as arguments (the notebook passes its own:
the learner's where they pass their checks)."""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from qwen_mini import ASSETS, config_from_file
from qwen_mini.checkpoint import checkpoint_name, without_init
from qwen_mini.course.experiments import one_thread
from qwen_mini.model import CausalLM

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


# --- section 4: which KV head each query head reads -----------------------------------------------


def head_mapping(repeat_kv, n_heads: int, n_kv_heads: int) -> list[int]:
    """KV head j holds the number j; after `repeat_kv`, query head h holds the KV head it reads."""
    kv_ids = torch.arange(n_kv_heads, dtype=torch.float32).view(1, n_kv_heads, 1, 1)
    return repeat_kv(kv_ids, n_heads // n_kv_heads).flatten().int().tolist()


def plot_head_mappings(repeat_kv, n_heads: int = 16, kv_counts=(16, 8, 1)) -> dict:
    """One panel per KV-head count: a line from each query head to the KV head it reads (by
    `repeat_kv`). Returns {n_kv: mapping}."""
    mappings = {n_kv: head_mapping(repeat_kv, n_heads, n_kv) for n_kv in kv_counts}
    fig, axes = plt.subplots(1, len(kv_counts), figsize=(13, 2.8))
    for ax, (n_kv, mapping) in zip(axes, mappings.items(), strict=True):
        colors = plt.cm.tab20(torch.tensor(mapping) % 20)
        ax.scatter(range(n_heads), [1] * n_heads, c=colors, s=80)
        kv_x = [(j + 0.5) * n_heads / n_kv - 0.5 for j in range(n_kv)]  # KV heads spread out
        ax.scatter(kv_x, [0] * n_kv, c=plt.cm.tab20(torch.arange(n_kv) % 20), s=80, marker="s")
        for h, j in enumerate(mapping):
            ax.plot([h, kv_x[j]], [1, 0], color=colors[h], lw=1)
        name = {n_heads: "MHA", 1: "MQA"}.get(n_kv, "GQA")
        ax.set_title(f"{name}: {n_heads} query heads, {n_kv} KV head{'s' * (n_kv > 1)}")
        ax.set_yticks([0, 1], ["KV heads", "query heads"])
        ax.set_xticks([])
        ax.set_ylim(-0.3, 1.3)
    plt.tight_layout()
    plt.show()
    return mappings


# --- section 6: cached decoding against recomputing -----------------------------------------------


def decode_time(layer, cfg, kv_cache_class, angles, use_cache: bool, n: int = 64) -> float:
    """Seconds to decode n random tokens through one attention layer: one new token against a
    cache (`kv_cache_class`, committed each step), or the whole prefix again at every step."""
    x = torch.randn(1, n, cfg.hidden_size)
    cache = kv_cache_class(1, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float32)
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in range(n):
            if use_cache:  # one new token against the cache
                layer(x[:, t : t + 1], *angles(t, 1), cache)
                cache.commit(1)
            else:  # the whole prefix again
                layer(x[:, : t + 1], *angles(0, t + 1))
    return time.perf_counter() - t0


# --- section 7: KV bytes per token ---------------------------------------------------------------


def kv_shapes(published: dict) -> tuple[dict, int, int, int]:
    """The shapes kv_bytes_per_token reads (layers with a KV cache, KV heads, head_dim): those of
    `published` {name: (layers, KV heads, head_dim)}, and those read from the shipped config
    files of Qwen3-0.6B, Qwen2.5-0.5B and Qwen3.5-0.8B (its full-attention layers only; its text
    model's fields sit under "text_config"). Also (Qwen3.5-0.8B's full layers, its DeltaNet
    layers, the bytes of one DeltaNet layer's state in float32)."""

    def shape(layers, kv_heads, head_dim):
        return SimpleNamespace(
            num_hidden_layers=layers, num_key_value_heads=kv_heads, head_dim=head_dim
        )

    configs = ASSETS / "configs"
    shapes = {name: shape(*s) for name, s in published.items()}
    shapes["Qwen3-0.6B"] = config_from_file(configs / "qwen3-0.6b" / "config.json")
    shapes["Qwen2.5-0.5B"] = config_from_file(configs / "qwen2.5-0.5b" / "config.json")
    text = json.loads((configs / "qwen3.5-0.8b" / "config.json").read_text())["text_config"]
    n_full = text["layer_types"].count("full_attention")
    n_linear = text["layer_types"].count("linear_attention")
    shapes["Qwen3.5-0.8B (6 full layers)"] = shape(
        n_full, text["num_key_value_heads"], text["head_dim"]
    )
    heads, d_k, d_v = (
        text[f] for f in ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    )
    return shapes, n_full, n_linear, heads * d_k * d_v * 4  # float32


# --- section 9: the whole model on your code ------------------------------------------------------


def weights_file_of(model) -> Path:
    """The model's safetensors file: the real checkpoint's, or the in-memory stand-in written
    out to a temporary folder (the tied head left out, as a checkpoint stores it)."""
    if not model.is_standin:
        return Path(model.source) / "model.safetensors"
    weights_file = Path(tempfile.mkdtemp()) / "model.safetensors"
    cfg = model.config
    state = {checkpoint_name(k, cfg): v for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]  # the embedding again
    save_file(state, weights_file)
    return weights_file


# --- section 9: GQA to MHA and MQA ----------------------------------------------------------------


def convert_kv_heads(model, n_kv_new: int, regroup_kv_heads):
    """The same model with n_kv_new KV heads in every attention layer: a new config, the same
    blocks, and every k_proj / v_proj weight (and bias) regrouped by `regroup_kv_heads`."""
    cfg = replace(model.config, num_key_value_heads=n_kv_new)
    kv = (".k_proj.", ".v_proj.")
    weights = {
        name: regroup_kv_heads(w, cfg.head_dim, n_kv_new) if any(p in name for p in kv) else w
        for name, w in model.state_dict().items()
    }
    with torch.device("meta"), without_init():
        new = CausalLM(cfg, arch=model.arch)
    new.load_state_dict(weights, strict=True, assign=True)
    if cfg.tie_word_embeddings:  # assign made two Parameters of one tensor: one again
        new.lm_head.weight = new.model.embed_tokens.weight
    return new.eval()


def cache_bytes(model, ids) -> int:
    """Bytes a fresh cache holds after the model has read `ids` [1, T]."""
    cache = model.new_cache(batch_size=1)
    with torch.no_grad():
        model(ids, cache=cache)
    return cache.nbytes()


def next_token_loss(logits, ids) -> float:
    """Mean cross-entropy of predicting each token of `ids` [1, T] from the ones before it."""
    return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).item()


# --- section 10: a tiny model trained to copy -----------------------------------------------------


def copy_batch(batch_size, generator, V: int = 20, N: int = 8):
    """N random tokens (2 .. V-1), the separator 1, the same N again: [B, 2N + 1]."""
    x = torch.randint(2, V, (batch_size, N), generator=generator)
    return torch.cat([x, torch.ones(batch_size, 1, dtype=torch.long), x], 1)


def copy_loss(m, ids, N: int = 8) -> float:
    """Cross-entropy of predicting each token of the copy from everything before it."""
    logits = m(ids[:, :-1])
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, N:].reshape(-1, V), ids[:, N + 1 :].reshape(-1)).item()


def train_copy(model, steps: int = 80, N: int = 8, seed: int = 1) -> float:
    """AdamW at 1e-2 on batches of 32 copy sequences (from a generator seeded `seed`), the loss
    on the copy only, on one thread. Returns the seconds it took."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size

    t0 = time.perf_counter()
    with one_thread():
        for _ in range(steps):
            ids_b = copy_batch(32, g, V, N)
            logits = model(ids_b[:, :-1])
            loss = F.cross_entropy(logits[:, N:].reshape(-1, V), ids_b[:, N + 1 :].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return time.perf_counter() - t0


def attention_maps(m, ids, attention_weights, causal_mask, split_heads, repeat_kv, apply_rope):
    """The weights [H, T, T] each head of the model's first layer computes on `ids` [1, T]: its
    input caught by a forward pre-hook, then the layer's own projections, norms and RoPE, and
    the functions passed in (the notebook's)."""
    seen = []
    attn = m.model.layers[0].self_attn
    hook = attn.register_forward_pre_hook(lambda mod, args: seen.append(args))
    with torch.no_grad():
        m(ids)
        hook.remove()
        x, cos, sin = seen[0][:3]
        q = attn.q_norm(split_heads(attn.q_proj(x), attn.n_heads))
        k = attn.k_norm(split_heads(attn.k_proj(x), attn.n_kv_heads))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = repeat_kv(k, attn.n_heads // attn.n_kv_heads)
        T = ids.shape[1]
        return attention_weights(q, k, causal_mask(T, T))[0]


# --- section 11: a byte-level model read past its trained length ----------------------------------

PYTHON_BYTES = ASSETS / "data" / "python_stdlib_sample.txt"


def windows(text: torch.Tensor, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """n random windows of the text, [n, length + 1] byte ids (inputs and the next byte)."""
    starts = torch.randint(0, len(text) - length - 1, (n, 1), generator=generator)
    return text[starts + torch.arange(length + 1)]


def train_bytes(model, text: torch.Tensor, length: int, steps: int = 200) -> float:
    """Small random matrices (std 0.02, as GPT-2 starts; the norms stay at 1), then AdamW at
    3e-3 on batches of 16 windows of `length` bytes, one thread; prints the time and the last
    loss."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0)

    t0 = time.perf_counter()
    with one_thread():
        for _ in range(steps):
            ids = windows(text, 16, length, g)
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    loss = loss.item()
    seconds = time.perf_counter() - t0
    print(f"{steps} steps at {length} tokens in {seconds:.0f} s, last loss {loss:.2f}")
    return loss


def loss_by_position(model, cfg, arch, scalings: dict, test: torch.Tensor) -> dict:
    """{name: mean loss at each position [T]} of `model`'s weights read with each RoPE scaling
    (a config that differs only in rope_scaling), over the test windows [n, T + 1]."""
    out = {}
    T = test.shape[1] - 1
    for name, scaling in scalings.items():
        model_s = CausalLM(replace(cfg, rope_scaling=scaling), arch=arch).eval()
        model_s.load_state_dict(model.state_dict())
        with torch.no_grad():
            logits = model_s(test[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), test[:, 1:].flatten(), reduction="none")
        out[name] = loss.view(len(test), T).mean(0)  # [T]: mean over the windows
    return out


def print_and_plot_positions(by_position: dict, ranges: dict, short: int) -> dict:
    """A table of the mean loss over each range of positions, per scaling, and the curves (a
    running mean of 16 positions). Returns {name: [mean loss per range]}."""
    print(f"{'mean loss at':12s}" + "".join(f"{r:>16s}" for r in ranges))
    table = {}
    for name, loss in by_position.items():
        table[name] = [loss[a:b].mean().item() for a, b in ranges.values()]
        print(f"{name:12s}" + "".join(f"{x:16.2f}" for x in table[name]))
    long = len(next(iter(by_position.values())))
    plt.figure(figsize=(6, 3))
    for name, loss in by_position.items():
        plt.plot(torch.arange(long)[15:], loss.unfold(0, 16, 1).mean(1), label=name)
    plt.axvline(short, color="grey", ls=":", lw=1)
    plt.xlabel("position"), plt.ylabel("loss (mean of 16 positions)"), plt.legend(fontsize=8)
    plt.title(f"trained on {short} tokens, read on {long}", fontsize=9)
    plt.show()
    return table
