"""Given experiment code of chapter 2 (QKV bias against QK-Norm): the spread of the bias terms
per layer, the stored sweep's statistics and plot, the data and figures of the three interactive
views, and the comparison of models with QK-Norm intact and removed.

Where a measurement uses an exercise (`logit_stats`, `distinct_weights`), the notebook passes its
own version in (the learner's where it passes its checks), so what is measured is what they wrote.
"""

from __future__ import annotations

import math
from dataclasses import replace

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from qwen_mini.attention import repeat_kv, split_heads
from qwen_mini.course.lab.ch02 import capture_attention_inputs, probe_logits
from qwen_mini.model import CausalLM
from qwen_mini.rope import apply_rope

# --- section 2: the bias terms, with and without RoPE ---------------------------------------------


def plot_rope_bias(rb: torch.Tensor) -> None:
    """The b_q·b_k term after RoPE [T, T]: as a map (query i, key j <= i), and against distance."""
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.2))
    ax[0].imshow(rb.tril(), cmap="RdBu_r")
    ax[0].set_title("b_q·b_k term after RoPE (query i, key j ≤ i)")
    ax[0].set_xlabel("key j")
    ax[0].set_ylabel("query i")
    ax[1].plot(rb[-1].flip(0))
    ax[1].set_xlabel("distance i - j")
    ax[1].set_title("the same term against distance")
    plt.tight_layout()
    plt.show()


def causal_weights(parts: dict, visible: torch.Tensor, D: int, drop: str | None = None):
    """The attention weights [Tq, Tk] of the sum of the logit terms `parts`, scaled by 1/sqrt(D),
    the keys a query cannot see (`visible` False) masked; the term `drop` left out."""
    logits = sum(v for name, v in parts.items() if name != drop) / math.sqrt(D)
    return logits.masked_fill(~visible, -math.inf).softmax(-1)


def spread_over_keys(term: torch.Tensor, visible: torch.Tensor, D: int) -> float:
    """The std of the scaled term along each row's visible keys, averaged over the rows: 0 for a
    term the softmax cancels (the same for every key of a row)."""
    s = (term / math.sqrt(D)).masked_fill(~visible, float("nan"))
    centred = s - s.nanmean(-1, keepdim=True)
    return float(centred.pow(2).nanmean(-1).sqrt().mean())


# --- section 2: what the biases add to the logits, layer by layer ---------------------------------


def bias_spread(model, ids: torch.Tensor) -> list[dict]:
    """Per layer: the std over keys of each term of the scaled logits (causal rows), mean over
    rows and heads. The terms: content, query_bias, key_bias, bias_bias (after RoPE)."""
    inputs = {}
    hooks = capture_attention_inputs(model, inputs)
    with torch.no_grad():
        model(ids[None])
    for h in hooks:
        h.remove()
    out = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x, cos, sin = inputs[i]
        n_rep = attn.n_heads // attn.n_kv_heads
        with torch.no_grad():
            qx = apply_rope(split_heads(F.linear(x, attn.q_proj.weight), attn.n_heads), cos, sin)
            kx = apply_rope(split_heads(F.linear(x, attn.k_proj.weight), attn.n_kv_heads), cos, sin)
            T = x.shape[1]
            bq = apply_rope(attn.q_proj.bias.view(attn.n_heads, 1, -1).expand(-1, T, -1), cos, sin)
            bk = apply_rope(
                attn.k_proj.bias.view(attn.n_kv_heads, 1, -1).expand(-1, T, -1), cos, sin
            )
            kx, bk = repeat_kv(kx, n_rep)[0], repeat_kv(bk[None], n_rep)[0]
            qx, scale = qx[0], attn.head_dim**-0.5
            parts = {
                "content": qx @ kx.mT,
                "query_bias": qx @ bk.mT,
                "key_bias": bq @ kx.mT,
                "bias_bias": bq @ bk.mT,
            }
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        row = {}
        for name, s in parts.items():
            s = (s * scale).masked_fill(~mask, float("nan"))[:, 1:]  # rows with >= 2 keys
            mean = s.nanmean(-1, keepdim=True)
            row[name] = float(((s - mean) ** 2).nanmean(-1).sqrt().mean())
        out.append(row)
    return out


# --- section 3: the stored sweep ------------------------------------------------------------------


def final_loss(r) -> float:
    """Mean of a run's last 20 steps (inf where a step diverged to inf/nan)."""
    last = r["loss"][-20:]
    return math.inf if None in last else sum(last) / len(last)


def peak_logit(r) -> float:
    """The largest logit over all recorded steps, layers and heads of a run."""
    return max(v if v is not None else math.inf for s in r["max_logit"] for l in s for v in l)


def low_entropy(r) -> float:
    """The entropy of the sharpest head at a run's last recorded step."""
    return min(v for l in r["entropy"][-1] for v in l)


def plot_sweep(runs: dict, lrs: list) -> None:
    """Loss against learning rate, and the largest logit and sharpest head's entropy per step,
    with QK-Norm and without; `runs` {(qk_norm, lr): run}."""
    fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
    for qk, style in [(False, "tab:red"), (True, "tab:blue")]:
        label = "QK-Norm" if qk else "no QK-Norm"
        ax[0].plot(lrs, [final_loss(runs[(qk, lr)]) for lr in lrs], "o-", color=style, label=label)
        for lr in lrs:
            r = runs[(qk, lr)]
            shade = 0.25 + 0.75 * lrs.index(lr) / (len(lrs) - 1)
            peaks = [max(v for l in s for v in l) for s in r["max_logit"]]
            ents = [min(v for l in s for v in l) for s in r["entropy"]]
            kw = dict(color=style, alpha=shade, label=f"{label}, lr {lr:g}")
            ax[1].plot(r["step"], peaks, **kw)
            ax[2].plot(r["step"], ents, **kw)
    ax[0].set(
        xscale="log",
        xlabel="learning rate",
        ylabel="final training loss (last 20 steps)",
        title="(a) loss against learning rate",
    )
    ax[1].set(
        yscale="log",
        xlabel="step",
        ylabel="largest attention logit",
        title="(b) largest logit (any layer, head)",
    )
    ax[2].set(xlabel="step", ylabel="entropy (nats)", title="(c) entropy of the sharpest head")
    ax[0].legend()
    ax[2].legend(fontsize=6, ncol=2)
    plt.tight_layout()
    plt.show()


def print_sweep_table(runs: dict, lrs: list) -> None:
    """Per rate, off and on: the final loss, the largest logit, the sharpest head's entropy."""
    print(f"{'lr':>7} | {'final loss':>21} | {'largest logit':>21} | {'sharpest-head entropy':>21}")
    print(f"{'':>7} | {'off':>10} {'on':>10} | {'off':>10} {'on':>10} | {'off':>10} {'on':>10}")
    for lr in lrs:
        off, on = runs[(False, lr)], runs[(True, lr)]
        print(
            f"{lr:7g} | {final_loss(off):10.3f} {final_loss(on):10.3f} | {peak_logit(off):10.4g} "
            f"{peak_logit(on):10.4g} | {low_entropy(off):10.3f} {low_entropy(on):10.3f}"
        )


def print_seed_table(seed_runs: dict, lrs: list, seeds: list) -> dict:
    """Per rate and seed: the largest logit off / on and the loss gap off - on. Returns {lr: the
    number of seeds on which QK-Norm ends at the lower loss}."""
    print(f"{'lr':>7} | largest logit off / on (per seed)       | loss off - on (per seed)")
    lower_with_norm = {}
    for lr in lrs:
        off = [seed_runs[(False, lr, s)] for s in seeds]
        on = [seed_runs[(True, lr, s)] for s in seeds]
        gaps_s = [final_loss(a) - final_loss(b) for a, b in zip(off, on, strict=True)]
        lower_with_norm[lr] = sum(g > 0 for g in gaps_s)
        peaks = "  ".join(
            f"{peak_logit(a):7.0f}/{peak_logit(b):3.0f}" for a, b in zip(off, on, strict=True)
        )
        print(f"{lr:7g} | {peaks} | " + "  ".join(f"{g:+.3f}" for g in gaps_s))
    return lower_with_norm


# --- view 1: a training step, a layer and a head --------------------------------------------------


def training_step_view(live: dict, step_index: int, layer: int, head: int) -> dict:
    """What view 1 draws, for each live run {name: (model, record)}: attention weights, logits,
    and the largest-logit curve up to the marker."""
    out = {}
    for name, (_, rec) in live.items():
        logits = rec["probe_logits"][step_index][layer, head]  # [T, T], -inf above the diagonal
        out[name] = {
            "step": rec["step"][step_index],
            "weights": logits.softmax(-1),
            "logits": logits[torch.isfinite(logits)],
            "curve": [s[layer][head] for s in rec["max_logit"]],
        }
    return out


def draw_training_step(live: dict, data: dict, layer: int, head: int):
    fig, ax = plt.subplots(2, len(data) + 1, figsize=(4 * (len(data) + 1), 6.5))
    for col, (name, d) in enumerate(data.items()):
        ax[0, col].imshow(d["weights"], cmap="Blues", vmin=0, vmax=1)
        ax[0, col].set_title(f"{name}: step {d['step']}, layer {layer}, head {head}", fontsize=9)
        ax[1, col].hist(d["logits"].numpy(), bins=40, color="tab:gray")
        ax[1, col].set_title(f"logits: max {d['logits'].max():.1f}", fontsize=9)
        steps = live[name][1]["step"]
        ax[0, -1].plot(steps, d["curve"], label=name)
        ax[0, -1].plot([d["step"]], [d["curve"][steps.index(d["step"])]], "ko")
    # symlog, not log: a head's largest logit can be negative (QK-Norm keeps them small), and a
    # log axis would drop that curve; beyond ±1 the axis is logarithmic, so the growth shows
    ax[0, -1].set_yscale("symlog", linthresh=1)
    ax[0, -1].axhline(0, color="grey", lw=0.5)
    ax[0, -1].set(title="largest logit (training batch)", xlabel="step")
    ax[0, -1].legend(fontsize=8)
    ax[1, -1].axis("off")
    plt.tight_layout()
    return fig


# --- section 4: softmax in bfloat16 ---------------------------------------------------------------


def sdpa_in_bfloat16(seed: int = 0) -> None:
    """Prints how far F.scaled_dot_product_attention on bfloat16 q, k, v [1, 2, 64, 32] (causal)
    lands from the same attention in float32 on the same inputs rounded once, and how far
    bfloat16 arithmetic step by step lands."""
    g = torch.Generator().manual_seed(seed)
    q16, k16, v16 = ((3 * torch.randn(1, 2, 64, 32, generator=g)).bfloat16() for _ in range(3))
    kernel = F.scaled_dot_product_attention(q16, k16, v16, is_causal=True).float()
    in_fp32 = F.scaled_dot_product_attention(q16.float(), k16.float(), v16.float(), is_causal=True)
    in_fp32 = in_fp32.bfloat16().float()
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    scores = (q16 @ k16.mT * 32**-0.5).masked_fill(~causal, -math.inf)
    step_by_step = (scores.softmax(-1) @ v16).float()  # every step rounded to bfloat16
    print(
        f"scaled_dot_product_attention in bfloat16: max |difference| to float32 rounded once "
        f"{(kernel - in_fp32).abs().max():.3f}, to bfloat16 step by step "
        f"{(step_by_step - in_fp32).abs().max():.3f} (outputs of size up to "
        f"{in_fp32.abs().max():.1f})"
    )


# --- view 2: scaling ‖q‖ and ‖k‖ ------------------------------------------------------------------


def pre_norm_qk(model, ids, layer):
    """One layer's attention module, its queries and (repeated) keys before QK-Norm, and its
    RoPE angles, for the token ids `ids`."""
    inputs = {}
    hooks = capture_attention_inputs(model, inputs)
    with torch.no_grad():
        model(ids[None])
    for h in hooks:
        h.remove()
    attn, (x, cos, sin) = model.model.layers[layer].self_attn, inputs[layer]
    with torch.no_grad():
        q, k = (
            split_heads(attn.q_proj(x), attn.n_heads),
            split_heads(attn.k_proj(x), attn.n_kv_heads),
        )
    return attn, q, repeat_kv(k, attn.n_heads // attn.n_kv_heads), cos, sin


def norm_scale_view(
    model, ids, scale: float, head: int = 0, *, logit_stats, distinct_weights
) -> dict:
    """Layer 0's queries and keys scaled by `scale`, with and without the layer's QK-Norm, in
    float32 and bfloat16: largest logit, entropy, weights and distinct weights of the last row
    (measured with the `logit_stats` and `distinct_weights` passed in)."""
    attn, q, k, cos, sin = pre_norm_qk(model, ids, 0)
    q, k = q * scale, k * scale
    out = {}
    with torch.no_grad():
        for norm in (True, False):
            qq, kk = (attn.q_norm(q), attn.k_norm(k)) if norm else (q, k)
            qq, kk = (
                apply_rope(qq, cos, sin)[:, head : head + 1],
                apply_rope(kk, cos, sin)[:, head : head + 1],
            )
            for dtype in (torch.float32, torch.bfloat16):
                logits = (qq.to(dtype) @ kk.to(dtype).mT).float()[0, 0] / math.sqrt(qq.shape[-1])
                logits = logits.masked_fill(
                    ~torch.ones_like(logits, dtype=torch.bool).tril(), -math.inf
                )
                m, e = logit_stats(qq.to(dtype), kk.to(dtype))
                weights = logits.to(dtype).float().softmax(-1).to(dtype).float()
                out[(norm, str(dtype).split(".")[1])] = {
                    "max_logit": float(m[0]),
                    "entropy": float(e[0]),
                    "weights": weights,
                    "distinct_last_row": distinct_weights(logits[-1], dtype),
                }
    return out


def draw_norm_scale(data: dict, scale: float, head: int):
    fig, ax = plt.subplots(1, 4, figsize=(16, 4))
    for a, ((norm, dtype), d) in zip(ax, data.items(), strict=True):
        a.imshow(d["weights"], cmap="Blues", vmin=0, vmax=1)
        a.set_title(
            f"{'QK-Norm' if norm else 'no norm'}, {dtype}, ×{scale:g}\n"
            f"max logit {d['max_logit']:.1f}, entropy {d['entropy']:.2f},\n"
            f"{d['distinct_last_row']} distinct weights in the last row",
            fontsize=9,
        )
    plt.tight_layout()
    return fig


# --- section 6: QK-Norm removed against intact ----------------------------------------------------


def without_qk_norm(model, remove_qk_norm):
    """The same weights in a model built from the model's row with qk_norm=False, the state dict
    passed through `remove_qk_norm` and loaded strictly; and how many tensors were dropped."""
    row = replace(model.arch, qk_norm=False)  # the model's row of the table, without QK-Norm
    weights = remove_qk_norm(model.state_dict())
    new = CausalLM(model.config, arch=row).to(model.lm_head.weight.dtype)
    new.load_state_dict(weights)  # strict: every parameter of the new model is filled
    new.generation_config, new.source, new.is_standin = (
        model.generation_config,
        model.source,
        model.is_standin,
    )
    return new.eval(), len(model.state_dict()) - len(weights)


def text_loss(model, ids: torch.Tensor) -> float:
    """The next-token loss of `model` on the token ids `ids`."""
    with torch.no_grad():
        return F.cross_entropy(model(ids[None])[0, :-1].float(), ids[1:]).item()


def layer_max_logits(model, ids) -> list[float]:
    return [float(l[torch.isfinite(l)].max()) for l in probe_logits(model, ids)]


def greedy_bytes(model, prompt: str, n: int = 30) -> str:
    """`prompt` continued greedily by `n` bytes (the tiny models read and write bytes)."""
    ids = torch.tensor(list(prompt.encode()))
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids[None])[0, -1].argmax()[None]])
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


def compare(models: dict, ids, continue_with) -> dict:
    """For each model: its loss on `ids` and largest logit per layer, printed with what
    `continue_with(model)` writes; returns {name: {"max_logit", "loss"}}."""
    report = {}
    for name, model in models.items():
        report[name] = {"max_logit": layer_max_logits(model, ids), "loss": text_loss(model, ids)}
        print(
            f"{name:34s} loss {report[name]['loss']:.3f}   largest logit per layer "
            + " ".join(f"{v:7.1f}" for v in report[name]["max_logit"])
        )
        print(f"{'':34s} {continue_with(model)!r}")
    return report


# --- view 3: layer and head explorer --------------------------------------------------------------


def head_explorer(explore: dict, model: str, layer: int) -> dict:
    """Per head of one layer of `explore[model]` = (intact, removed, ids): the logit range and
    the mean attention entropy, with QK-Norm intact and removed."""
    out = {}
    intact, removed, text = explore[model]
    layer = min(layer, len(intact.model.layers) - 1)
    for name, m in (("intact", intact), ("removed", removed)):
        logits = probe_logits(m, text)[layer]  # [H, T, T]
        finite = torch.where(torch.isfinite(logits), logits, torch.nan)
        p = logits.softmax(-1)
        ent = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1).mean(-1)
        out[name] = {
            "min": finite.flatten(1).nanquantile(0.0, dim=1),
            "max": finite.flatten(1).nanquantile(1.0, dim=1),
            "entropy": ent,
        }
    out["layer"] = layer
    return out


def draw_heads(data: dict, model: str, layer: int):
    fig, ax = plt.subplots(1, 2, figsize=(12, 3.6))
    for off, (name, color) in enumerate([("intact", "tab:blue"), ("removed", "tab:red")]):
        d = data[name]
        H = len(d["max"])
        xs = torch.arange(H) + 0.2 * (2 * off - 1)
        ax[0].bar(xs, d["max"] - d["min"], bottom=d["min"], width=0.4, color=color, label=name)
        ax[1].bar(xs, d["entropy"], width=0.4, color=color, label=name)
    for a in ax:  # one tick per head: heads are numbered, there is no head 0.5
        a.set_xticks(range(H))
    ax[0].set(title=f"{model}, layer {data['layer']}: logit range per head", xlabel="head")
    ax[1].set(title="mean attention entropy (nats)", xlabel="head")
    ax[0].legend()
    plt.tight_layout()
    return fig
