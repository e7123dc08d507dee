"""Given experiment code of chapter 3 (mixture of experts): the timing of three ways to get
tokens to their experts; the simulation of micro-batch against global-batch balancing (its
domains, training and figure); and the split of a trained dense FFN into experts (the split
layer, the model rebuilt around it, the tiny byte-level model it is measured on, the sweep over
k, the loads per expert). The dispatch functions, the router, the balancing losses and the
splitting come in as arguments (the notebook passes its own)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.checkpoint import without_init
from qwen_mini.course.experiments import one_thread
from qwen_mini.model import CausalLM


def call_times(f, *args, repeat=5) -> list[float]:
    """Seconds of `repeat` calls of f(*args), after one warm-up call, sorted."""
    times = []
    with torch.no_grad():
        f(*args)
        for _ in range(repeat):
            start = time.perf_counter()
            f(*args)
            times.append(time.perf_counter() - start)
    return sorted(times)


def time_dispatch(methods, route, expert, H: int, I: int, sizes=(16, 64, 256)) -> dict:
    """{(E, method name, N): sorted seconds of 5 calls} for E = 8 and 64 experts (k = 2) of
    `expert(H, I)`, N tokens of random inputs and routes; drawn as medians with bars from the
    fastest to the slowest call, and printed as a table."""
    sizes, timing = list(sizes), {}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, E in zip(axes, (8, 64), strict=True):
        experts = nn.ModuleList(expert(H, I) for _ in range(E))
        for f in methods:
            for N in sizes:
                x = torch.randn(N, H)
                w, idx = route(torch.randn(N, E), 2, True)
                timing[E, f.__name__, N] = call_times(f, x, w, idx, experts)
            ms = torch.tensor([timing[E, f.__name__, N] for N in sizes]) * 1e3  # [sizes, repeats]
            median = ms.median(dim=1).values
            ax.errorbar(
                sizes,
                median,
                yerr=[median - ms.min(dim=1).values, ms.max(dim=1).values - median],
                fmt="o-",
                capsize=3,
                label=f.__name__,
            )
        ax.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="ms", title=f"E = {E}, k = 2")
        ax.set_xticks(sizes, [str(n) for n in sizes], minor=False)
        ax.minorticks_off()
    axes[0].legend()
    plt.tight_layout()
    plt.show()
    print(f"{'E':>3} {'N':>4}   median ms (fastest-slowest) of 5 calls")
    for E in (8, 64):
        for N in sizes:
            cells = []
            for f in methods:
                t = [1e3 * s for s in timing[E, f.__name__, N]]
                name = f.__name__.removeprefix("dispatch_")
                cells.append(f"{name} {t[2]:6.2f} ({t[0]:.2f}-{t[-1]:.2f})")
            print(f"{E:3d} {N:4d}   " + "   ".join(cells))
    return timing


# --- section 5: balancing per micro-batch or over the global batch --------------------------------


def domains(n_domains=4, hidden=16, batch=64, seed=0) -> SimpleNamespace:
    """The simulated data: n_domains clusters of inputs [hidden] around their own centres, each
    with its own target (a random linear map), and one generator that every batch draws from (so
    the runs that share it see a continuing stream)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n_domains, hidden, generator=g) * 2
    targets = torch.randn(n_domains, hidden, hidden, generator=g) / hidden**0.5
    return SimpleNamespace(centres=centres, targets=targets, g=g, batch=batch, n=n_domains)


def domain_batch(task: SimpleNamespace, d: int):
    """(x [batch, H], y [batch, H]) of domain d."""
    x = task.centres[d] + torch.randn(task.batch, task.centres.shape[1], generator=task.g)
    return x, x @ task.targets[d].T


def train_router(task, balance: str, route, dispatch, micro_loss, global_loss,
                 experts=8, k=2, alpha=0.5, steps=200):  # fmt: skip
    """An MoE layer of `experts` linear experts, top-k (`route`, `dispatch`), trained (Adam at
    1e-2, one thread) on one micro-batch per domain a step plus alpha times the balancing loss:
    the mean of `micro_loss` per micro-batch, or `global_loss` over them all. Returns (usage
    [domains, experts]: the share of each domain's routing slots per expert, the task MSE)."""
    torch.manual_seed(1)
    H = task.centres.shape[1]
    router = nn.Linear(H, experts, bias=False)
    layer = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(experts))
    opt = torch.optim.Adam([*router.parameters(), *layer.parameters()], lr=1e-2)

    with one_thread():
        for _ in range(steps):
            loss, micro = 0.0, []
            for d in range(task.n):  # one micro-batch per domain
                x, y = domain_batch(task, d)
                logits = router(x)
                w, idx = route(logits, k, True)
                loss = loss + F.mse_loss(dispatch(x, w, idx, layer), y) / task.n
                micro.append([logits])
            if balance == "micro-batch":
                aux = torch.stack([micro_loss(m, k) for m in micro]).mean()
            else:
                aux = global_loss(micro, k)
            opt.zero_grad()
            (loss + alpha * aux).backward()
            opt.step()
    usage, mse = torch.zeros(task.n, experts), 0.0
    with torch.no_grad():
        for d in range(task.n):
            x, y = domain_batch(task, d)
            w, idx = route(router(x), k, True)
            usage[d] = torch.bincount(idx.flatten(), minlength=experts) / idx.numel()
            mse += F.mse_loss(dispatch(x, w, idx, layer), y).item() / task.n
    return usage, mse


def print_and_plot_usage(results: dict) -> None:
    """Per balancing: the task MSE, a domain's share on its 2 most used experts, the overall
    load per expert; and the usage [domains, experts] drawn."""
    fig, axes = plt.subplots(1, len(results), figsize=(10, 2.8))
    for ax, (name, (usage, mse)) in zip(axes, results.items(), strict=True):
        ax.imshow(usage, cmap="Blues", vmin=0, vmax=0.5)
        ax.set(title=f"{name} balancing: task MSE {mse:.3f}", xlabel="expert", ylabel="domain")
        top2 = usage.topk(2, dim=-1).values.sum(-1).mean()
        overall = (usage.mean(0) * 100).round().int().tolist()
        print(
            f"{name:13s} balancing: task MSE {mse:.3f}; a domain's share on its 2 most used "
            f"experts {top2:.0%}; overall load per expert {overall} %"
        )
    plt.tight_layout()
    plt.show()


# --- section 6: a dense FFN split into experts ----------------------------------------------------


class SplitFFN(nn.Module):
    """A dense MLP split into E experts (by `split_mlp`); each token runs k of them, each at
    weight 1 (through `dispatch`).

    choose="all": every expert (k = E), the dense FFN exactly. choose="activations": the k experts
    whose intermediate activations silu(gate x) * up x are largest for this token. choose="random":
    k experts at random."""

    def __init__(self, mlp, num_experts: int, k: int, choose: str, split_mlp, dispatch):
        super().__init__()
        self.experts = split_mlp(mlp, num_experts)
        self.k, self.choose, self.dispatch = k, choose, dispatch
        self.generator = torch.Generator().manual_seed(0)
        self.last_choice = None  # [N, k] experts chosen in the last forward pass

    def scores(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, E]
        return torch.stack(
            [(F.silu(e.gate_proj(x)) * e.up_proj(x)).norm(dim=-1) for e in self.experts], dim=-1
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        N, E = flat.shape[0], len(self.experts)
        if self.choose == "all":
            idx = torch.arange(E).expand(N, E)
        elif self.choose == "activations":
            idx = self.scores(flat).topk(self.k, dim=-1).indices
        else:
            idx = torch.rand(N, E, generator=self.generator).argsort(dim=-1)[:, : self.k]
        self.last_choice = idx
        ones = torch.ones(idx.shape, dtype=x.dtype)
        return self.dispatch(flat, ones, idx, self.experts).view(x.shape)


def with_ffns(model, make):
    """The model's weights in a model built with make(dense MLP of layer i) as layer i's FFN:
    the row's mlp block replaced; every other tensor is the model's own (no copy)."""
    ffns = [make(layer.mlp) for layer in model.model.layers]  # built here, with real weights
    row = model.arch.with_blocks(mlp=lambda cfg, i, arch: ffns[i])
    with torch.device("meta"), without_init():  # the rest: shapes only, filled just below
        new = CausalLM(model.config, arch=row)
    weights = new.state_dict()  # the new FFNs' tensors (and meta placeholders for the rest)
    weights.update({k: w for k, w in model.state_dict().items() if ".mlp." not in k})
    new.load_state_dict(weights, strict=True, assign=True)
    return new.eval()


class Zero(nn.Module):
    """No feed-forward at all: the layer's FFN branch adds nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def train_bytes(model, train_data: torch.Tensor, steps: int = 150) -> float:
    """Small initial weights (every matrix N(0, 0.02): small first logits), then AdamW at 3e-3 on
    batches of 16 random windows of 64 bytes, one thread. Returns the seconds it took."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    g_data = torch.Generator().manual_seed(0)

    start = time.perf_counter()
    with one_thread():
        for _ in range(steps):
            at = torch.randint(len(train_data) - 65, (16,), generator=g_data)
            x = torch.stack([train_data[i : i + 64] for i in at])
            y = torch.stack([train_data[i + 1 : i + 65] for i in at])
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    return time.perf_counter() - start


def loss_on(model, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean next-byte cross-entropy of the model on inputs x [B, T] and targets y [B, T]."""
    with torch.no_grad():
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


def split_sweep(model, split_ffn, ks: list, num_experts: int, loss) -> dict:
    """{choose: [loss(the model with every FFN split into num_experts, k of them per token)
    for k in ks]} for the experts chosen by activations and at random, one thread."""

    sweep = {}
    with one_thread():
        for choose in ("activations", "random"):
            sweep[choose] = [
                loss(with_ffns(model, lambda mlp, k=k, c=choose: split_ffn(mlp, num_experts, k, c)))
                for k in ks
            ]
    return sweep


def plot_sweep(sweep: dict, ks: list, num_experts: int, dense: float, no_ffn: float) -> None:
    """The loss per k for each way of choosing, with the dense and the no-FFN losses."""
    plt.figure(figsize=(6, 3.5))
    for choose, losses in sweep.items():
        plt.plot(ks, losses, "o-", label=f"k experts chosen by {choose}")
    plt.axhline(dense, color="gray", ls="--", label="dense FFN")
    plt.axhline(no_ffn, color="red", ls=":", label="no FFN at all")
    plt.gca().invert_xaxis()
    plt.xlabel(f"experts per token k (of {num_experts})")
    plt.ylabel("held-out loss (nats/byte)")
    plt.legend()
    plt.show()


def real_split_losses(model, tok, split_ffn) -> dict:
    """The next-token loss of `model` on a fixed paragraph, dense and with every FFN split into
    8 experts, k of them chosen by activations or at random."""
    paragraph = (
        "A mixture-of-experts layer keeps many feed-forward networks and lets a small router "
        "decide, token by token, which few of them to run. The model grows in what it stores "
        "without growing in what each token costs."
    )
    para = torch.tensor([tok.encode(paragraph)])

    def paragraph_loss(m) -> float:
        with torch.no_grad():
            return F.cross_entropy(m(para)[0, :-1], para[0, 1:]).item()

    real = {"dense": paragraph_loss(model)}
    for choose in ("activations", "random"):
        for k in (8, 4, 2, 1):
            split = with_ffns(model, lambda mlp, k=k, c=choose: split_ffn(mlp, 8, k, c))
            real[f"{choose} k={k}"] = paragraph_loss(split)
    return real


def plot_loads(choices: list, num_experts: int, k: int) -> None:
    """The share of tokens f_e per expert in each layer's last choices [N, k], and pooled."""
    fig, axes = plt.subplots(1, len(choices) + 1, figsize=(11, 2.6), sharey=True)
    loads = [torch.bincount(c.flatten(), minlength=num_experts) / len(c) for c in choices]
    panels = [(f"layer {i}", f) for i, f in enumerate(loads)] + [
        ("pooled", sum(loads) / len(loads))
    ]
    for ax, (name, f) in zip(axes, panels, strict=True):
        ax.bar(range(num_experts), f.numpy())
        ax.axhline(k / num_experts, color="gray", ls="--")
        ax.set(title=f"{name}: busiest expert {f.max() / (k / num_experts):.1f}x the mean",
               xlabel="expert")  # fmt: skip
    axes[0].set_ylabel("f_e")
    plt.tight_layout()
    plt.show()
