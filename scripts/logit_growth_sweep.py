"""The full attention-logit-growth sweep of chapter 2, written to
assets/data/logit_growth_sweep.json.

Trains the chapter's tiny Qwen3-shaped model (qwen_mini.course.lab.ch02.train_tiny) on Python
source, with and without QK-Norm, at each learning rate, with fixed seeds, on one CPU thread (so
the numbers do not depend on the machine's thread count), and records per step the loss and,
every few steps, per layer and query head the largest attention logit and the attention entropy.

    PYTHONPATH=. python scripts/logit_growth_sweep.py            # the stored sweep, ~15-40 min
    PYTHONPATH=. python scripts/logit_growth_sweep.py --steps 30 --lrs 0.03 --out /tmp/x.json
    # chapter 2's seed sweep: the short runs of its live cell, three seeds, ~10-20 min
    PYTHONPATH=. python scripts/logit_growth_sweep.py --steps 100 --batch 8 --seq 64 --every 25 \
        --seeds 0 1 2 --out assets/data/logit_growth_seeds.json

tests/test_ch02_sweep.py re-runs the first steps of some runs and compares with the stored file.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import time
from pathlib import Path

import torch

from qwen_mini.config import ASSETS
from qwen_mini.course.lab.ch02 import train_tiny

OUT = ASSETS / "data" / "logit_growth_sweep.json"
SETTINGS = dict(steps=300, batch=16, seq=128, seed=0, every=5, n_stat=4)
LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


def rounded(x, digits: int = 5):
    """x (a number or nested lists) to `digits` significant digits; inf and nan become None."""
    if isinstance(x, list):
        return [rounded(v, digits) for v in x]
    return float(f"{x:.{digits}g}") if math.isfinite(x) else None


def run(qk_norm: bool, lr: float, settings: dict) -> dict:
    torch.set_num_threads(1)  # one thread: the same sums in the same order on every machine
    start = time.perf_counter()
    _, rec = train_tiny(qk_norm, lr, **settings)
    return {
        "qk_norm": qk_norm,
        "lr": lr,
        "seed": settings["seed"],
        "loss": rounded(rec["loss"]),
        "step": rec["step"],
        "max_logit": rounded(rec["max_logit"]),  # [recorded step][layer][head]
        "entropy": rounded(rec["entropy"]),  # [recorded step][layer][head], nats
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    parser.add_argument("--steps", type=int, default=SETTINGS["steps"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[SETTINGS["seed"]])
    parser.add_argument("--batch", type=int, default=SETTINGS["batch"])
    parser.add_argument("--seq", type=int, default=SETTINGS["seq"])
    parser.add_argument("--every", type=int, default=SETTINGS["every"])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--jobs", type=int, default=1, help="runs trained side by side")
    args = parser.parse_args(argv)
    settings = dict(SETTINGS, steps=args.steps, batch=args.batch, seq=args.seq, every=args.every)
    todo = [
        (qk_norm, lr, dict(settings, seed=seed))
        for seed in args.seeds
        for qk_norm in (False, True)
        for lr in args.lrs
    ]
    # each run is independent and single-threaded, so running several at once changes nothing
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        runs = pool.starmap(run, todo)
    for r in runs:
        peak = max((v for s in r["max_logit"] for layer in s for v in layer if v), default=0)
        print(
            f"seed {r['seed']} QK-Norm {'on ' if r['qk_norm'] else 'off'} lr {r['lr']:<6g} "
            f"final loss "
            f"{r['loss'][-1]} largest logit {peak:.4g} ({r['seconds']} s)"
        )
    data = {
        "about": "scripts/logit_growth_sweep.py: tiny Qwen3-shaped models on Python source",
        "torch": torch.__version__,
        "threads": 1,
        "settings": settings,
        "model": "qwen_mini.course.lab.ch02.tiny_config (2 layers, width 128, 4 query/2 KV heads)",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
