"""Given experiment code of chapter 5 (Gated DeltaNet): the random inputs of the two forms and
their timing, the figure of the cache sizes, the tiny model that learns when to forget (its data,
training, ablation and decay maps), and the recall experiments of section 7 (the sweep by
construction, the data, training and accuracy of the tiny recall models, their figure).

The layers and rules the chapter builds (`GatedDeltaNet`, `recurrent_step`, `decay_mask`, the
recall model) come in as arguments, so that what runs is the notebook's.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.attention import attention, causal_mask, merge_heads, split_heads
from qwen_mini.course.experiments import one_thread
from qwen_mini.course.lab.ch05 import log_decay


def deltanet_shape(hidden: int, heads: int, head_dim: int) -> SimpleNamespace:
    """The fields a GatedDeltaNet reads from a Config, for a tiny layer of `heads` heads."""
    return SimpleNamespace(
        hidden_size=hidden,
        rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
    )


# --- sections 2 and 3: the two forms on random inputs, and their timing ---------------------------


def random_inputs(T, H_k=2, ratio=2, d_k=32, d_v=16, seed=0):
    """q, k [1, T, H_k, d_k] (unit length); v [1, T, H_k * ratio, d_v]; g, beta [1, T, H_v]
    (g in (-2, 0], beta in [0, 1)); a state S0 [1, H_v, d_k, d_v]. Seeded: the same inputs for
    the same arguments."""
    g_ = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H_k, d_k, generator=g_), dim=-1)
    k = F.normalize(torch.randn(1, T, H_k, d_k, generator=g_), dim=-1)
    v = torch.randn(1, T, H_k * ratio, d_v, generator=g_)
    g = -torch.rand(1, T, H_k * ratio, generator=g_) * 2
    beta = torch.rand(1, T, H_k * ratio, generator=g_)
    S0 = torch.randn(1, H_k * ratio, d_k, d_v, generator=g_)
    return q, k, v, g, beta, S0


def call_times(form, *args, repeat=3) -> list[float]:
    """Seconds of `repeat` calls of form(*args), sorted."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        form(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)


def time_forms(recurrent, chunk, random_inputs, lengths) -> tuple[list, list, tuple]:
    """Sorted seconds of 3 calls of each form on one layer of 4 heads of 128, per length in
    `lengths` (after a first call of each, whose costs are once only), drawn as medians with bars
    from the fastest to the slowest call. Returns (recurrent times, chunk times, the inputs of
    the last length)."""
    t_rec, t_chunk = [], []
    warm_up = random_inputs(64, H_k=4, ratio=1, d_k=128, d_v=128)
    recurrent(*warm_up[:5]), chunk(*warm_up[:5])  # first-call costs
    for T in lengths:
        inputs = random_inputs(T, H_k=4, ratio=1, d_k=128, d_v=128)
        t_rec.append(call_times(recurrent, *inputs[:5]))
        t_chunk.append(call_times(chunk, *inputs[:5]))
    plt.figure(figsize=(5, 3))
    for name, times in (("recurrent", t_rec), ("chunk (C = 64)", t_chunk)):
        ms = torch.tensor(times) * 1e3  # [lengths, repeats], sorted
        plt.errorbar(
            lengths,
            ms[:, 1],
            yerr=[ms[:, 1] - ms[:, 0], ms[:, -1] - ms[:, 1]],
            fmt="o-",
            capsize=3,
            label=name,
        )
    plt.xlabel("tokens"), plt.ylabel("ms"), plt.legend()
    plt.title("one layer, 4 heads of 128")
    plt.show()
    return t_rec, t_chunk, inputs[:5]


# --- section 5: the memory a sequence keeps -------------------------------------------------------


def plot_cache_sizes(lengths: list, mib_dense: list, mib_hybrid: list) -> None:
    """Bars of MiB per sequence at each length, Qwen3-8B against Qwen3.5-0.8B, log scale."""
    plt.figure(figsize=(5, 3))
    x = range(len(lengths))
    plt.bar([i - 0.2 for i in x], mib_dense, 0.4, label="Qwen3-8B (all full attention)")
    plt.bar([i + 0.2 for i in x], mib_hybrid, 0.4, label="Qwen3.5-0.8B (6 full + 18 DeltaNet)")
    plt.xticks(list(x), [f"{n // 1024}k" for n in lengths]), plt.yscale("log")
    plt.ylabel("MiB per sequence"), plt.legend(fontsize=7), plt.show()


# --- section 6: what the decay learns -------------------------------------------------------------

# Segments, each opened by SEP, hold 3 key-value pairs and then 2 queries. The answer to a query
# is the key's value in this segment, or NONE if the key is not in it. Keys come back in later
# segments with other values, so what an earlier segment stored is stale once SEP comes.
N_KEYS = N_VALUES = 8  # tokens 0-7 are keys, 8-15 values
SEP, NONE = 16, 17


def segment_batch(batch_size, n_segments=4, generator=None):
    """ids [B, T] and targets [B, T]: the answer at each query, -100 (not scored) elsewhere."""
    ids, targets = [], []
    for _ in range(batch_size * n_segments):
        keys = torch.randperm(N_KEYS, generator=generator)[:3].tolist()
        values = torch.randint(N_KEYS, N_KEYS + N_VALUES, (3,), generator=generator).tolist()
        queries = torch.randint(0, N_KEYS, (2,), generator=generator).tolist()
        ids += [SEP, keys[0], values[0], keys[1], values[1], keys[2], values[2], *queries]
        answers = [values[keys.index(q)] if q in keys else NONE for q in queries]
        targets += [-100] * 7 + answers
    return torch.tensor(ids).view(batch_size, -1), torch.tensor(targets).view(batch_size, -1)


class TinyDeltaNetLM(nn.Module):
    """Embedding -> one Gated DeltaNet layer (`layer_class`, plus the residual) -> logits. No
    attention, no positions: the conv sees a key next to its value, the state holds the pairs."""

    def __init__(self, layer_class, vocab_size=18, hidden=64, heads=4, head_dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.shape = deltanet_shape(hidden, heads, head_dim)  # kept for the ablation
        self.linear_attn = layer_class(self.shape)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, ids):  # [B, T] -> [B, T, vocab]
        x = self.embed(ids)
        return self.head(x + self.linear_attn(x))


def decay_at(model: TinyDeltaNetLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean exp(g) per head [H] at SEP and at every other token."""
    with torch.no_grad():
        kept = log_decay(model.linear_attn, model.embed(ids)).exp()
    return kept[ids == SEP].mean(0), kept[ids != SEP].mean(0)


def train_segments(model: TinyDeltaNetLM, steps: int = 150) -> float:
    """AdamW at 1e-2 on batches of 16 fresh sequences (the global generator), on one thread;
    prints the wall-clock and processor time (the processor time is what it costs on an idle
    core). Returns the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    start, cpu_start = time.perf_counter(), time.process_time()
    with one_thread():
        for _ in range(steps):
            ids, targets = segment_batch(16)
            loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
            optimizer.zero_grad(), loss.backward(), optimizer.step()
    loss = loss.item()
    print(
        f"{steps} steps in {time.perf_counter() - start:.0f} s "
        f"({time.process_time() - cpu_start:.0f} s of processor time), last loss {loss:.3f}"
    )
    return loss


def segment_accuracy(predicted: torch.Tensor, answers: torch.Tensor) -> dict:
    """{"in this segment": (accuracy, queries), "NONE": (...)} of the predicted tokens [B, T]."""
    out = {}
    for name, where in (
        ("in this segment", answers.ge(0) & answers.ne(NONE)),
        ("NONE", answers == NONE),
    ):
        accuracy = (predicted[where] == answers[where]).float().mean().item()
        out[name] = (accuracy, where.sum().item())
    return out


def accuracy_with_keep(model: TinyDeltaNetLM, ids, answers, keep: torch.Tensor, layer_class):
    """The trained model's accuracy (key in this segment, NONE) with exp(g) at the SEP tokens set
    to `keep` [H] (an ablation; the other weights as trained)."""

    class DecayAtSEP(layer_class):
        """SEP is found as the rows of the layer's input equal to SEP's embedding (the tiny model
        feeds it directly)."""

        def forward(self, x, *args, **kwargs):
            self.at_sep = (x == sep_embedding).all(-1, keepdim=True)  # [B, T, 1]
            return super().forward(x, *args, **kwargs)

        def gates(self, b, a):
            beta, g = super().gates(b, a)  # [B, T, H]
            return beta, torch.where(self.at_sep, keep.clamp_min(1e-6).log().expand_as(g), g)

    sep_embedding = model.embed.weight[SEP].detach()
    layer = DecayAtSEP(model.shape)
    layer.load_state_dict(model.linear_attn.state_dict())
    with torch.no_grad():
        x = model.embed(ids)
        predicted = model.head(x + layer(x)).argmax(-1)
    return tuple(a for a, _ in segment_accuracy(predicted, answers).values())


def plot_decay_memory(model: TinyDeltaNetLM, ids: torch.Tensor, decay_mask) -> None:
    """Per head, what is left at t of what was written at s: exp(G_t - G_s), from the trained
    decays on `ids` [1, T] (by the notebook's `decay_mask`), with the SEP tokens dashed."""
    with torch.no_grad():
        g = log_decay(model.linear_attn, model.embed(ids))[0].T.double()  # [H, T]
    memory = decay_mask(g.cumsum(-1))  # [H, T, T]: exp(G_t - G_s) for s <= t
    fig, axes = plt.subplots(1, g.shape[0], figsize=(12, 3.2))
    for head, ax in enumerate(axes):
        ax.imshow(memory[head].float(), vmin=0, vmax=1, cmap="viridis")
        for position in (ids[0] == SEP).nonzero().flatten().tolist():
            ax.axvline(position - 0.5, color="w", ls="--", lw=0.6)
            ax.axhline(position - 0.5, color="w", ls="--", lw=0.6)
        ax.set_title(f"head {head}"), ax.set_xlabel("written at s")
    axes[0].set_ylabel("read at t")
    plt.show()


def plot_layer_decays(model, ids: list) -> None:
    """Each DeltaNet layer's mean exp(g) per value head over `ids` (a hook on every such layer)."""
    decays = []
    hook = lambda m, inp, out: decays.append(log_decay(m, inp[0]).exp())  # noqa: E731
    handles = [
        layer.mixer.register_forward_hook(hook)
        for layer in model.model.layers
        if type(layer.mixer).__name__ == "GatedDeltaNet"
    ]
    with torch.inference_mode():
        model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    mean = torch.stack([d[0].mean(0) for d in decays])  # [layers, heads]
    plt.imshow(mean, vmin=0, vmax=1, cmap="viridis"), plt.colorbar(label="mean exp(g)")
    plt.xlabel("value head"), plt.ylabel("DeltaNet layer"), plt.show()


# --- section 7: recall from a fixed state ---------------------------------------------------------


def recalled(read: torch.Tensor, values: torch.Tensor) -> float:
    """Fraction of pairs whose read [P, d_v] is nearer its own value than any other stored one."""
    return ((read @ values.T).argmax(-1) == torch.arange(len(values))).float().mean().item()


def recall_sweep(store_and_read, pairs: list, d_k: int, d_v: int, generator, draws: int = 20):
    """Mean recall over `draws` draws of P random unit keys and values, for each P in `pairs`:
    from the state (`store_and_read(keys, values)`) and from attention over the P stored keys
    (softmax sharpened by 16, as trained q and k norms do). Prints a line per P; returns the
    two lists."""
    by_state, by_attention = [], []
    for P in pairs:
        state_hits, attention_hits = [], []
        for _ in range(draws):
            keys = F.normalize(torch.randn(P, d_k, generator=generator), dim=-1)
            values = F.normalize(torch.randn(P, d_v, generator=generator), dim=-1)
            state_hits.append(recalled(store_and_read(keys, values), values))
            read = attention(16 * keys[None, None], keys[None, None], values[None, None])[0, 0]
            attention_hits.append(recalled(read, values))
        by_state.append(sum(state_hits) / draws)
        by_attention.append(sum(attention_hits) / draws)
        print(
            f"P = {P:3d} pairs: recalled from the {d_k}x{d_v} state {by_state[-1]:.2f}, "
            f"from attention over {P} stored keys {by_attention[-1]:.2f}"
        )
    return by_state, by_attention


RECALL_KEYS, RECALL_VALUES, N_QUERIES = 64, 16, 16


def recall_batch(batch_size, P, generator=None):
    """keys, values [B, P] (the pairs); queries, answers [B, N_QUERIES]."""
    keys = torch.stack(
        [torch.randperm(RECALL_KEYS, generator=generator)[:P] for _ in range(batch_size)]
    )
    values = torch.randint(0, RECALL_VALUES, (batch_size, P), generator=generator)
    asked = torch.randint(0, P, (batch_size, N_QUERIES), generator=generator)
    return keys, values, keys.gather(1, asked), values.gather(1, asked)


class CausalAttention(nn.Module):
    """Chapter 1's attention without positions: the pairs are a set, their order means nothing."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(hidden, hidden, bias=False) for _ in range(4)
        )

    def forward(self, x):  # [B, T, hidden] -> [B, T, hidden]
        q, k, v = (
            split_heads(proj(x), self.heads) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        T = x.shape[1]
        return self.o_proj(merge_heads(attention(q, k, v, causal_mask(T, T, x.device))))


def train_recall(model_class, layer_types, steps=400, seed=0):
    """`model_class(layer_types)` trained on 2-16 pairs (AdamW at 1e-2, batches of 32, one
    thread); prints the processor time."""
    torch.manual_seed(seed)
    model, generator = model_class(layer_types), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    start = time.process_time()
    with one_thread():
        for _ in range(steps):
            P = int(torch.randint(2, 17, (1,), generator=generator))
            keys, values, queries, answers = recall_batch(32, P, generator)
            loss = F.cross_entropy(model(keys, values, queries).flatten(0, 1), answers.flatten())
            optimizer.zero_grad(), loss.backward(), optimizer.step()
    seconds = time.process_time() - start
    print(f"{' + '.join(layer_types)}: {steps} steps in {seconds:.0f} s of processor time")
    return model


@torch.no_grad()
def recall_accuracy(model, P):
    """Accuracy on 256 held-out sequences of P pairs (a fixed seed)."""
    keys, values, queries, answers = recall_batch(256, P, torch.Generator().manual_seed(1))
    return (model(keys, values, queries).argmax(-1) == answers).float().mean().item()


def print_and_plot_recall(pairs, by_state, by_attention, recall_table, read_at, d_k, d_v):
    """The trained models' table (accuracy per number of pairs), then two panels: recall by
    construction (left) and by the trained models (right)."""
    print(f"{'pairs in the sequence':28s}" + "".join(f"{P:6d}" for P in read_at))
    for name, accuracies in recall_table.items():
        print(f"{name:28s}" + "".join(f"{a:6.2f}" for a in accuracies))
    print(f"(chance: {1 / RECALL_VALUES:.2f}; trained on 2-16 pairs)")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True)
    left.plot(pairs, by_state, "o-", label=f"delta rule, {d_k}x{d_v} state")
    left.plot(pairs, by_attention, "s-", label="attention over the stored keys")
    left.set_title("by construction, no training")
    for name, accuracies in recall_table.items():
        right.plot(read_at, accuracies, "o-", label=name)
    right.axvspan(2, 16, color="0.9", label="trained on")
    right.set_title("trained tiny models")
    for ax in (left, right):
        ax.set_xscale("log", base=2), ax.set_xlabel("pairs P"), ax.legend(fontsize=7)
    left.set_ylabel("fraction recalled")
    plt.show()
