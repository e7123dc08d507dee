"""Given experiment code of chapter 6 (the rest of the Qwen family): the parameter counts of the
big configs on the meta device, the decode-step timing of sparse against full attention, the
retrieval task the sparse attention is trained on (its data, its tiny model, the training of the
model and then of its indexer, the accuracy as the budget shrinks), and the tiny checkpoints the
chapter ends with. Nothing here is imported to run a model.

The blocks the chapter builds (its attention, streams and n-gram embedding) come in as arguments,
so that what runs is the notebook's.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

import qwen_mini
from qwen_mini.checkpoint import meta_model
from qwen_mini.config import Config
from qwen_mini.course.experiments import one_thread
from qwen_mini.rope import apply_partial_rope
from qwen_mini.rope_scaling import rotary_cos_sin

# --- section 1: router sparsity, counted on the meta device ---------------------------------------


def moe_counts(path: Path) -> dict:
    """Parameters of the config at `path` (a folder), built on the meta device: routed experts,
    embedding and head, n-gram tables, the rest; the total and the active count (the experts at
    k/E, the embedding and head left out, as the model cards count). The MTP head (chapter 7) is
    counted apart, as the cards count it."""
    cfg = qwen_mini.config_from_file(path / "config.json")
    model = meta_model(cfg)
    parts = {"experts": 0, "embedding": 0, "ngram": 0, "rest": 0}
    mtp = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            mtp += p.numel()
        elif ".mlp.experts." in name:
            parts["experts"] += p.numel()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            parts["embedding"] += p.numel()
        elif ".ngram_embedding." in name:
            parts["ngram"] += p.numel()
        else:
            parts["rest"] += p.numel()
    active = parts["rest"] + parts["experts"] * cfg.num_experts_per_tok // cfg.num_experts
    return dict(parts, cfg=cfg, total=sum(parts.values()), active=active, mtp=mtp)


def qwen3_moe_counts(path: Path) -> dict:
    """`moe_counts` for a Qwen3-MoE config, by chapter 3's sum: Qwen3-30B-A3B's 6,144 expert
    modules take seconds to build even on meta."""
    c = qwen_mini.config_from_file(path / "config.json")
    H, D, L, E, I = (
        c.hidden_size,
        c.head_dim,
        c.num_hidden_layers,
        c.num_experts,
        c.moe_intermediate_size,
    )
    attention = H * D * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 2 * D
    rest = L * (attention + 2 * H + E * H) + H  # + norms, router; the final norm
    experts = L * E * 3 * H * I
    embedding = c.vocab_size * H * (1 if c.tie_word_embeddings else 2)
    active = rest + experts * c.num_experts_per_tok // E
    return dict(experts=experts, embedding=embedding, ngram=0, rest=rest, cfg=c, mtp=0,
                total=experts + embedding + rest, active=active)  # fmt: skip


def print_sparsity(counts: dict) -> None:
    """One row per config: k/E, the total, the active count and its share, and both again with
    the embedding and head counted in (as Qwen3's cards count)."""
    print(f"{'config':28s} {'k/E':>11s} {'total':>8s} {'active':>7s} {'share':>6s}"
          f" {'+embedding':>10s} {'share':>6s}")  # fmt: skip
    for name, c in counts.items():
        cfg, with_embedding = c["cfg"], c["active"] + c["embedding"]
        k, E = cfg.num_experts_per_tok, cfg.num_experts
        print(f"{name:28s} {k:3d}/{E:3d} {k / E:5.2%}"
              f" {c['total'] / 1e9:7.2f}B {c['active'] / 1e9:6.2f}B {c['active'] / c['total']:6.2%}"
              f" {with_embedding / 1e9:9.2f}B {with_embedding / c['total']:6.2%}")  # fmt: skip


# --- section 2: the fused projections -------------------------------------------------------------


def copy_permuted(plain: nn.Module, fused: nn.Module, order: torch.Tensor) -> None:
    """Give the fused layer the plain layer's weights: the conv, A_log, dt_bias, norm and out_proj
    as they are, and the rows of the four stacked input projections [in_proj_qkv; in_proj_z;
    in_proj_b; in_proj_a] in `order`, split into in_proj_qkvz and in_proj_ba."""
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if not name.startswith("in_proj"):
                fused.get_parameter(name).copy_(p)
        stacked = torch.cat([plain.in_proj_qkv.weight, plain.in_proj_z.weight,
                             plain.in_proj_b.weight, plain.in_proj_a.weight])  # fmt: skip
        qkvz_rows = fused.in_proj_qkvz.weight.shape[0]
        fused.in_proj_qkvz.weight.copy_(stacked[order[:qkvz_rows]])
        fused.in_proj_ba.weight.copy_(stacked[order[qkvz_rows:]])


# --- section 4.1: which positions a query reads ---------------------------------------------------


def plot_kept(keep: torch.Tensor, top: int, ratio: int) -> None:
    """The mask keep [T, T] of the positions each query reads, black where kept."""
    plt.figure(figsize=(4, 4))
    plt.imshow(keep, cmap="Greys", interpolation="nearest")
    plt.xlabel("key position"), plt.ylabel("query position")
    plt.title(f"kept: top {top} blocks of {ratio} + the tail", fontsize=9)
    plt.show()


# --- section 4.1: the cost of a decoding step -----------------------------------------------------


def decode_step_seconds(attention: nn.Module, cfg: Config, context: int) -> float:
    """Seconds of one single-token step of `attention` after `context` cached tokens (random
    keys, values and index keys, as a prompt would leave them). The step is not committed, so
    the next call times the same step again."""
    state = getattr(attention, "_timing_state", None)
    if state is None or state.length != context:  # fill a cache of `context` tokens once
        g = torch.Generator().manual_seed(0)
        state = attention.new_state(1, torch.float32)
        shape = (1, attention.n_kv_heads, context, attention.head_dim)
        state.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        if hasattr(state, "update_index"):
            dim = attention.indexer.head_dim
            state.update_index(torch.randn(1, context, dim, generator=g))
        state.commit(context)
        attention._timing_state = state
        cos, sin = rotary_cos_sin(cfg, torch.tensor([context]), torch.float32)
        attention._timing_inputs = (torch.randn(1, 1, cfg.hidden_size, generator=g), cos, sin)
        with torch.inference_mode():  # the first step pools every block once; later ones do not
            attention(*attention._timing_inputs, state)
    with torch.inference_mode():
        start = time.perf_counter()
        attention(*attention._timing_inputs, state)
        return time.perf_counter() - start


def time_decode_steps(layers: dict, cfg: Config, contexts: list, repeats: int = 5) -> dict:
    """{name: {context: [seconds of a step] * repeats}} for each attention layer, on one thread
    (on a shared machine, waiting threads add noise), the layers alternating so that both see
    the same machine."""
    times = {name: {n: [] for n in contexts} for name in layers}
    with one_thread():
        for n in contexts:
            for _ in range(repeats):
                for name, layer in layers.items():
                    times[name][n].append(decode_step_seconds(layer, cfg, n))
    return times


def plot_decode_times(times: dict, contexts: list, budget: int) -> None:
    """Medians with bars from the fastest to the slowest repeat (of 5), printed and drawn."""
    plt.figure(figsize=(5, 3))
    for name, by_n in times.items():
        med = [sorted(by_n[n])[2] * 1e3 for n in contexts]
        lo = [m - min(by_n[n]) * 1e3 for m, n in zip(med, contexts, strict=True)]
        hi = [max(by_n[n]) * 1e3 - m for m, n in zip(med, contexts, strict=True)]
        plt.errorbar(contexts, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
        print(f"{name:6s} median ms per step:", " ".join(f"{m:6.2f}" for m in med))
    plt.axvline(budget, color="grey", ls=":", lw=1)
    plt.xscale("log", base=2), plt.xlabel("cached tokens"), plt.ylabel("ms per decoding step")
    plt.legend(fontsize=8), plt.title("one attention layer, one new token", fontsize=9)
    plt.show()


# --- section 4.1: what is lost when the needed token is not kept ----------------------------------


N_KEYS, N_VALUES = 64, 16  # a pair token is key * N_VALUES + value; query tokens come after
RETRIEVAL_VOCAB = N_KEYS * N_VALUES + N_KEYS


def retrieval_batch(batch_size: int, n_pairs: int, generator=None):
    """(ids [B, n_pairs + 1], answers [B], where [B]): n_pairs (key, value) tokens with distinct
    keys, then a query token for one of the keys; its value, and the position of its pair."""
    keys = torch.stack([torch.randperm(N_KEYS, generator=generator)[:n_pairs]
                        for _ in range(batch_size)])  # fmt: skip
    values = torch.randint(N_VALUES, (batch_size, n_pairs), generator=generator)
    where = torch.randint(n_pairs, (batch_size,), generator=generator)
    query = N_KEYS * N_VALUES + keys.gather(1, where[:, None])
    ids = torch.cat([keys * N_VALUES + values, query], dim=1)
    return ids, values.gather(1, where[:, None])[:, 0], where


class TinyRetriever(nn.Module):
    """ids [B, T] -> logits over the values [B, N_VALUES] at the last position: a pair token
    embeds as (key vector + value vector), a query as its key's query vector; one attention
    layer (`attention_cls(cfg, 0, row)`) with its residual, then a linear head."""

    def __init__(self, cfg: Config, attention_cls, row):
        super().__init__()
        H = cfg.hidden_size
        self.cfg = cfg
        self.key, self.value, self.query = (nn.Embedding(n, H) for n in (N_KEYS, N_VALUES, N_KEYS))
        self.attn = attention_cls(cfg, 0, row)
        self.head = nn.Linear(H, N_VALUES)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, H]
        pair = ids < N_KEYS * N_VALUES
        pairs = self.key(ids.clamp(max=N_KEYS * N_VALUES - 1) // N_VALUES) + self.value(
            ids.clamp(max=N_KEYS * N_VALUES - 1) % N_VALUES
        )
        queries = self.query((ids - N_KEYS * N_VALUES).clamp(min=0))
        return torch.where(pair[..., None], pairs, queries)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        cos, sin = rotary_cos_sin(self.cfg, torch.arange(ids.shape[1]), x.dtype)
        return self.head((x + self.attn(x, cos, sin))[:, -1])


def attention_per_block(model: TinyRetriever, ids: torch.Tensor) -> torch.Tensor:
    """[B, n_blocks]: the share of the last query's attention (averaged over heads) that falls
    in each complete block, computed from the layer's own queries and keys (full attention)."""
    attn, x = model.attn, model.embed(ids)
    B, T, _ = x.shape
    cos, sin = rotary_cos_sin(model.cfg, torch.arange(T), x.dtype)
    D = attn.head_dim
    q = attn.q_proj(x).view(B, T, attn.n_heads, 2 * D)[..., :D]  # the query half, not the gate
    q = apply_partial_rope(attn.q_norm(q.transpose(1, 2)), cos, sin)[:, :, -1:]  # [B, H, 1, D]
    k = attn.k_norm(attn.k_proj(x).view(B, T, attn.n_kv_heads, D).transpose(1, 2))
    k = apply_partial_rope(k, cos, sin).repeat_interleave(attn.n_heads // attn.n_kv_heads, 1)
    weights = (q @ k.transpose(-1, -2) / math.sqrt(D)).softmax(-1).mean(1)[:, 0]  # [B, T]
    r = attn.indexer.ratio
    n = T // r
    return weights[:, : n * r].view(B, n, r).sum(-1)


def retrieval_accuracy(model: TinyRetriever, ids, answers, where, top_blocks: int):
    """(accuracy, accuracy where the needed pair was read, share of queries where it was) with
    the indexer keeping `top_blocks` blocks."""
    indexer = model.attn.indexer
    saved, indexer.top_blocks = indexer.top_blocks, top_blocks
    try:
        with torch.no_grad():
            right = model(ids).argmax(-1) == answers
            x = model.embed(ids)
            cos, sin = rotary_cos_sin(model.cfg, torch.arange(ids.shape[1]), x.dtype)
            keep = indexer(x, cos, sin)[:, -1]  # [B, T]: what the query read
    finally:
        indexer.top_blocks = saved
    read = keep.gather(1, where[:, None])[:, 0]
    accuracy, where_read = right.float().mean().item(), right[read].float().mean().item()
    return accuracy, where_read, read.float().mean().item()


def train_retriever(retriever: nn.Module, cfg: Config, n_pairs: int) -> tuple[float, float]:
    """Train the retriever on the task (200 steps, every block kept), then fit its indexer's block
    scores to the attention's share of each block (60 steps of KL divergence, the attention
    frozen). Returns the last task loss and the last KL."""
    indexer_params = set(retriever.attn.indexer.parameters())
    rest = [p for p in retriever.parameters() if p not in indexer_params]
    optimizer = torch.optim.AdamW(rest, lr=3e-3)
    for _ in range(200):
        ids, answers, _ = retrieval_batch(32, n_pairs)
        loss = F.cross_entropy(retriever(ids), answers)
        optimizer.zero_grad(), loss.backward(), optimizer.step()
    task_loss = loss.item()
    # the indexer: its block scores fitted to the attention's share of each block
    optimizer = torch.optim.AdamW(indexer_params, lr=3e-3)
    for _ in range(60):
        ids, _, _ = retrieval_batch(32, n_pairs)
        with torch.no_grad():
            target = attention_per_block(retriever, ids)
            target = target / target.sum(-1, keepdim=True)
            x = retriever.embed(ids)
        cos, sin = rotary_cos_sin(cfg, torch.arange(ids.shape[1]), x.dtype)
        scores = retriever.attn.indexer.block_scores(x, cos, sin)[:, -1]  # [B, n_blocks]
        fit = F.kl_div(scores.log_softmax(-1), target, reduction="batchmean")
        optimizer.zero_grad(), fit.backward(), optimizer.step()
    return task_loss, fit.item()


def accuracy_by_budget(retriever, held_out, budgets: list, indexers: dict) -> dict:
    """{label: [retrieval_accuracy at each budget]} with each of the indexer's weights in
    `indexers` loaded in turn, on one thread; the first weights are loaded back at the end."""
    results = {}
    with one_thread():
        for label, weights in indexers.items():
            retriever.attn.indexer.load_state_dict(weights)
            results[label] = [
                retrieval_accuracy(retriever, *held_out, top_blocks=b) for b in budgets
            ]
        retriever.attn.indexer.load_state_dict(next(iter(indexers.values())))
    return results


def print_and_plot_retrieval(results: dict, budgets: list) -> None:
    """The accuracy table per indexer and budget (with the accuracy where the pair was read and
    where it was missed), and the figure."""
    print(f"{'blocks kept':>11s} " + " ".join(f"{b:>6d}" for b in budgets))
    for label, rows in results.items():
        print(f"{label:16s}")
        print(f"{'  accuracy':16s}" + " ".join(f"{a:6.3f}" for a, _, _ in rows))
        print(f"{'  pair read':16s}" + " ".join(f"{r:6.3f}" for _, _, r in rows))
        print(f"{'  acc. if read':16s}" + " ".join(f"{k:6.3f}" for _, k, _ in rows))
        missed = [(a - r * k) / (1 - r) if r < 1 else float("nan") for a, k, r in rows]
        print(f"{'  acc. if missed':16s}" + " ".join(f"{m:6.3f}" for m in missed))
    print(f"chance: {1 / N_VALUES:.3f}")
    plt.figure(figsize=(5, 3))
    for label, rows in results.items():
        plt.plot(budgets, [a for a, _, _ in rows], marker="o", label=f"accuracy, {label}")
        plt.plot(budgets, [r for _, _, r in rows], ls=":", marker=".", label=f"pair read, {label}")
    plt.axhline(1 / N_VALUES, color="grey", lw=1, ls="--", label="chance")
    plt.xscale("log", base=2), plt.xlabel("blocks kept (of 7)"), plt.ylabel("share of queries")
    plt.legend(fontsize=7), plt.show()


# --- section 5: the tiny checkpoints of the four new model types ----------------------------------


# tiny configs of the four new model types: grouped KV heads, 3 DeltaNet : 1 attention layers,
# 2 value heads per key head, experts 2 of 4 with a shared one; Flash-Next with 2 streams, an
# indexer that really selects (top 2 blocks of 2 from the 6th token on) and bigram and trigram
# tables on layer 1
_BASE = dict(vocab_size=96, max_position_embeddings=128, hidden_size=32, num_hidden_layers=4,
             num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, moe_intermediate_size=16, num_experts=4,
             num_experts_per_tok=2, shared_expert_intermediate_size=24,
             tie_word_embeddings=False, eos_token_id=3)  # fmt: skip
_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4)  # fmt: skip
TINY_CONFIGS = {
    "qwen2_moe": dict(
        _BASE,
        model_type="qwen2_moe",
        intermediate_size=48,
        decoder_sparse_step=2,
        mlp_only_layers=[2],
    ),  # fmt: skip
    "qwen3_next": dict(_BASE, **_HYBRID, model_type="qwen3_next", intermediate_size=48),
    "qwen3_5_moe_text": dict(_BASE, **_HYBRID, model_type="qwen3_5_moe_text"),
    "qwen4_exp_text": dict(
        _BASE,
        **_HYBRID,
        model_type="qwen4_exp_text",
        hc_count=2,
        hc_lowrank=8,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=8,
        indexer_budget=4,
        indexer_compress_ratio=2,
        ple_layer_ids=[1],
        ple_embed_dim=16,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=3,
        output_gate_type="sigmoid",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    ),  # fmt: skip
}


def write_tiny_checkpoint(folder: Path, model_type: str, seed: int = 0) -> None:
    """config.json and model.safetensors of the package's `model_type` at its tiny config,
    seeded random weights of std 0.1 (norm scales near 1), float32."""
    import json

    from safetensors.torch import save_file

    from qwen_mini import CausalLM
    from qwen_mini.architectures import config_from_dict

    fields = TINY_CONFIGS[model_type]
    model = CausalLM(config_from_dict(fields))
    g = torch.Generator().manual_seed(seed)
    zero_centred = model_type != "qwen2_moe"  # their norms scale by 1 + weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=g)
            near_one = "norm" in name and not zero_centred
            p.copy_(1 + noise if near_one else noise)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields, indent=1))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def against_package(
    rows: dict, ids: torch.Tensor, pieces=(5, 3, 1, 1, 6)
) -> tuple[dict, nn.Module]:
    """For each model type, a tiny checkpoint loaded twice, through `rows[model_type]` (the
    notebook's blocks) and through the package's row: the max |logit difference| of the whole
    prompt, and of the prompt fed in `pieces` through the cache, against the package's logits,
    printed. Returns ({model_type: (whole, in pieces)}, the last model built from the rows)."""
    import tempfile

    diffs = {}
    with one_thread(), tempfile.TemporaryDirectory() as tmp:
        for model_type, row in rows.items():
            folder = Path(tmp) / model_type
            write_tiny_checkpoint(folder, model_type)
            mine_model = qwen_mini.load_model(folder, dtype=torch.float32, arch=row)
            package = qwen_mini.load_model(folder, dtype=torch.float32)
            with torch.inference_mode():
                want = package(ids)
                whole = mine_model(ids)
                cache, outs, start = mine_model.new_cache(1), [], 0
                for n in pieces:
                    outs.append(mine_model(ids[:, start : start + n], cache=cache))
                    start += n
                in_pieces = torch.cat(outs, 1)
            d = diffs[model_type] = (
                (whole - want).abs().max().item(),
                (in_pieces - want).abs().max().item(),
            )
            print(f"{model_type:17s} max |logit diff| vs the package: whole prompt "
                      f"{d[0]:.1e}, in pieces {d[1]:.1e}"
                      f"  (logits up to {want.abs().max().item():.1f})")  # fmt: skip
    return diffs, mine_model
