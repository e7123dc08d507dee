"""Given experiment code of chapter 5 (Gated DeltaNet): the timing of the recurrent and the
chunkwise forms. The forms and the input maker come in as arguments (the notebook passes its
own)."""

from __future__ import annotations

import time

import matplotlib.pyplot as plt
import torch


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
