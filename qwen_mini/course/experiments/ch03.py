"""Given experiment code of chapter 3 (mixture of experts): the timing of three ways to get
tokens to their experts. The dispatch functions, the router and the expert block come in as
arguments (the notebook passes its own)."""

from __future__ import annotations

import time

import matplotlib.pyplot as plt
import torch
from torch import nn


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
