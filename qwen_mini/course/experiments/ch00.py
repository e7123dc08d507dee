"""Given experiment code of chapter 0 (foundations): the figures (the bfloat16 running sum, SiLU,
RoPE's wavelengths and scores, the parameter shares, the zero-layer model's margins) and the
zero-layer model trained on a table of bigrams (the table, the training, its figure).

The blocks the chapter builds (`RMSNorm`, `ZeroLayerLM`) come in as arguments, so that what runs
is the notebook's.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from qwen_mini.course.experiments import one_thread

# --- section 3: RMSNorm in bfloat16 ---------------------------------------------------------------


def plot_running_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of squares of x [C] (bfloat16) accumulated channel by channel in bfloat16, against
    the exact one in float64, drawn. Returns (running [C + 1] from 0, exact [C])."""
    running = [torch.zeros((), dtype=torch.bfloat16)]
    for sq in x.pow(2):
        running.append(running[-1] + sq)  # accumulate in bfloat16
    running = torch.stack(running).float()
    exact = torch.cumsum(x.double().pow(2), 0)
    fig, ax = plt.subplots(figsize=(5.5, 2.6))
    ax.plot(exact, label="exact (float64)")
    ax.plot(running[1:], label="running sum in bfloat16")
    ax.set_xlabel("channels summed")
    ax.set_ylabel("sum of squares")
    ax.legend()
    plt.show()
    return running, exact


# --- section 4: the MLP ---------------------------------------------------------------------------


def plot_silu(z: torch.Tensor) -> None:
    """silu(z) = z * sigmoid(z) against relu(z) on the points z."""
    fig, ax = plt.subplots(figsize=(4.5, 2.4))
    ax.plot(z, F.silu(z), label="silu(z) = z·σ(z)")
    ax.plot(z, torch.relu(z), "--", label="relu(z)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.legend()
    plt.show()


# --- section 5: RoPE ------------------------------------------------------------------------------


def plot_wavelengths(D: int, theta: float, max_positions: int) -> None:
    """Positions per full turn of each of the D/2 pairs, at the config's base and at RoPE's
    original 10,000, with the config's context and the model card's 32,768 marked."""
    i = torch.arange(D // 2)
    wavelength = 2 * math.pi * theta ** (2 * i / D)  # positions per full turn of pair i
    fig, ax = plt.subplots(figsize=(5, 2.6))
    ax.semilogy(i, wavelength, label=f"θ = {theta:,.0f} (Qwen3)")
    ax.semilogy(i, 2 * math.pi * 10_000 ** (2 * i / D), "--", label="θ = 10,000 (original RoPE)")
    ax.axhline(max_positions, color="grey", lw=0.7)
    ax.text(
        0, max_positions * 1.5, f"max_position_embeddings {max_positions:,} (config)", fontsize=8
    )
    ax.axhline(32_768, color="grey", lw=0.7, ls=":")
    ax.text(30, 32_768 / 3, "32,768 (model card)", fontsize=8)
    ax.set_xlabel("pair i")
    ax.set_ylabel("wavelength (positions)")
    ax.legend(fontsize=8)
    plt.show()


def plot_scores(scores: torch.Tensor) -> None:
    """The scores [P, P] of one query placed at every position against one key at every
    position."""
    fig, ax = plt.subplots(figsize=(3.4, 3))
    ax.imshow(scores, cmap="RdBu")
    ax.set_xlabel("key position n")
    ax.set_ylabel("query position m")
    ax.set_title("q·k after RoPE", fontsize=9)
    plt.show()


# --- section 6: counting parameters ---------------------------------------------------------------


def plot_parameter_shares(counts: dict) -> None:
    """One bar per model: the embedding (= tied head) against the decoder layers and final norm."""
    fig, ax = plt.subplots(figsize=(6, 1.8))
    for row, c in enumerate(counts.values()):
        emb, rest = c["embed_tokens"] / 1e6, (c["layers"] + c["norm"]) / 1e6
        ax.barh(row, emb, color="C0", label="embedding (= tied head)" if row == 0 else None)
        ax.barh(
            row,
            rest,
            left=emb,
            color="C1",
            label="decoder layers + final norm" if row == 0 else None,
        )
        ax.text(
            emb / 2, row, f"{100 * emb / (emb + rest):.1f} %", ha="center", va="center", color="w"
        )
    ax.set_yticks(list(range(len(counts))), list(counts))
    ax.set_xlabel("unique parameters (millions)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    plt.show()


# --- section 7: the zero-layer model --------------------------------------------------------------


def plot_margins(margin: torch.Tensor) -> None:
    """A histogram of each token's own logit minus the best other logit."""
    fig, ax = plt.subplots(figsize=(4.5, 2.4))
    ax.hist(margin.numpy(), bins=40)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("own logit − best other logit")
    ax.set_ylabel("tokens")
    plt.show()


def bigram_counts(ids: torch.Tensor, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most frequent token ids of `ids` [T], renumbered 0..n-1: (bigrams [n, n], the count
    of each pair of neighbouring kept tokens; local [max id + 1], token id -> 0..n-1 or -1)."""
    values, freq = ids.unique(return_counts=True)
    kept = values[freq.argsort(descending=True)[:n]]  # the n most frequent token ids
    local = torch.full((int(ids.max()) + 1,), -1)
    local[kept] = torch.arange(n)  # token id -> 0..n-1, or -1 if not kept
    a, b = local[ids[:-1]], local[ids[1:]]
    pairs = (a >= 0) & (b >= 0)
    bigrams = torch.zeros(n, n)
    bigrams.index_put_((a[pairs], b[pairs]), torch.ones(int(pairs.sum())), accumulate=True)
    return bigrams, local


def train_zero_layer(
    zero_layer_lm, rms_norm, bigrams: torch.Tensor, tied: bool, steps=200, hidden=32, seed=0
) -> dict:
    """A zero-layer model over the n tokens of `bigrams` [n, n] (`zero_layer_lm(embedding, norm)`:
    the embedding as its head if tied, else a head of its own), trained full batch on the loss
    over every counted bigram (Adam at 0.05), on one thread. History: the loss per step, the
    share of tokens whose top prediction is the token itself every 20 steps, the final next-token
    probabilities [n, n] and the norm's weight."""
    n = bigrams.shape[0]
    torch.manual_seed(seed)
    emb, norm = torch.nn.Embedding(n, hidden), rms_norm(hidden)
    head = torch.nn.Linear(hidden, n, bias=False)
    zero = zero_layer_lm(emb, norm)  # embedding -> norm -> the embedding as head
    params = [emb.weight, norm.weight] + ([] if tied else [head.weight])
    opt = torch.optim.Adam(params, lr=0.05)
    every = torch.arange(n)

    def logits():  # [n, n]: row i = scores of the next token after token i
        return zero(every[None])[0] if tied else head(norm(emb(every)))

    def self_rate():
        with torch.no_grad():
            return (logits().argmax(-1) == every).float().mean().item()

    with one_thread():  # 256 x 32 matrices: more threads would cost more than they save
        history = {"step": [0], "self": [self_rate()], "loss": []}
        for step in range(1, steps + 1):
            loss = -(bigrams * logits().log_softmax(-1)).sum() / bigrams.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            history["loss"].append(loss.item())
            if step % 20 == 0:
                history["step"].append(step)
                history["self"].append(self_rate())
        with torch.no_grad():
            history["probs"] = logits().softmax(-1)
    history["norm_weight"] = norm.weight.detach().clone()
    return history


def plot_zero_layer_runs(runs: dict, floor: float) -> None:
    """The loss (with the bigram floor dotted) and the share predicting the input, per run."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 2.9))
    fig.suptitle("Zero-layer model trained on the bigrams: tied vs untied head", fontsize=10)
    for name, r in runs.items():
        ax1.plot(r["loss"], label=name)
        ax2.plot(r["step"], [100 * s for s in r["self"]], marker=".", label=name)
    ax1.axhline(floor, color="grey", lw=0.7, ls=":")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats)")
    ax1.legend(fontsize=8)
    ax1.set_title("loss (dotted: the bigram floor)", fontsize=9)
    ax2.set_xlabel("step")
    ax2.set_ylabel("% predicting the input")
    ax2.set_title("top prediction = the input token", fontsize=9)
    plt.tight_layout()
    plt.show()
