"""qwen_mini against transformers at the real Qwen3-0.6B shape, on this machine, in one run.

    python bench/bench_vs_transformers.py            # the real 28 layers, ~5-10 minutes
    python bench/bench_vs_transformers.py --layers 4 # a quick smoke run

Random weights of the exact shape (assets/configs/qwen3-0.6b/config.json) are written
once as a bfloat16 model.safetensors, as released. Both libraries load that file in float32 in this
process and are timed alternately (warm-up, then the median of a few repeats), so a machine that
slows down or speeds up during the run affects both alike. Loading is measured separately in a
fresh subprocess per loader, so the memory peaks of the two cannot mix. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
# read as a path, not through qwen_mini.config: the transformers runs never import qwen_mini
CONFIG_DIR = ROOT / "assets" / "configs" / "qwen3-0.6b"
GB = 1e9


# --- the machine -----------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> str:
    import transformers

    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"Python {platform.python_version()}"
    )


def read_bandwidth() -> float:
    """Bytes per second that sum() streams from a 1 GiB tensor: what decoding needs, since a
    matrix-vector product reads each weight once and does 2 flops with it. The best of 7, as
    a limit should be: on a shared machine the slower runs measure the neighbours."""
    x = torch.ones(2**28)  # 1 GiB of float32, far beyond any cache
    x.sum()
    return x.nbytes / min(timed(x.sum) for _ in range(7))


# --- the checkpoint --------------------------------------------------------------------------


def write_checkpoint(folder: Path, layers: int | None) -> int:
    """Random bf16 weights with the real key names and shapes; returns the file size in bytes."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((CONFIG_DIR / "config.json").read_text())
    if layers:
        cfg["num_hidden_layers"] = cfg["max_window_layers"] = layers
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    with torch.device("meta"):  # names and shapes only, straight from transformers
        shapes = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).state_dict()
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, meta in shapes.items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue  # as save_pretrained writes a tied model
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(meta.shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(meta.shape, generator=g) * 0.02).to(torch.bfloat16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return (folder / "model.safetensors").stat().st_size


# --- timing ----------------------------------------------------------------------------------


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def alternate(runs: dict, repeats: int) -> dict[str, list[float]]:
    """Call each runner once to warm up, then `repeats` times, swapping the order every round."""
    for fn in runs.values():
        fn()
    results = {name: [] for name in runs}
    names = list(runs)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(runs[name]())
    return results


@torch.inference_mode()
def prefill_ours(model, ids) -> float:
    # logits of the last position only, as generation needs (transformers: logits_to_keep=1)
    return timed(lambda: model(ids, cache=model.new_cache(1), last_only=True))


@torch.inference_mode()
def prefill_hf(model, ids) -> float:
    return timed(lambda: model(ids, use_cache=True, logits_to_keep=1))


def decode_ours(model, ids, new: int) -> tuple[float, list[int]]:
    """Tokens per second after the first token, i.e. without the prefill."""
    from qwen_mini import generate_tokens

    stamps, tokens = [], []
    for token in generate_tokens(
        model, ids[0].tolist(), max_new_tokens=new, temperature=0, eos_token_ids=[]
    ):
        stamps.append(time.perf_counter())
        tokens.append(token)
    return (new - 1) / (stamps[-1] - stamps[0]), tokens


def decode_hf(model, ids, new: int) -> tuple[float, list[int]]:
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):  # called once per new token, right after its forward pass
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    stamp = Stamp()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([stamp]),
    )
    s = stamp.stamps
    return (new - 1) / (s[-1] - s[0]), out[0, ids.shape[1] :].tolist()


# --- loading, in a child process -------------------------------------------------------------


def rss_and_peak() -> tuple[int, int]:
    """(resident bytes now, peak since start or since the last reset) from /proc/self/status."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def load_child(library: str, folder: str):
    """Runs in a fresh process: import, then load the bf16 file as is and run one token."""
    if library == "qwen_mini":
        import qwen_mini

        def load():
            return qwen_mini.load_model(folder, dtype=torch.bfloat16)
    else:
        import transformers.models.qwen3.modeling_qwen3  # noqa: F401  (import cost is not load)
        from transformers import AutoModelForCausalLM

        def load():
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)

    # Not getrusage: its peak survives exec and so includes the parent's memory at fork time.
    # Writing 5 to clear_refs resets this process's peak to its current size.
    Path("/proc/self/clear_refs").write_text("5")
    baseline, _ = rss_and_peak()
    t0 = time.perf_counter()
    model = load()
    t1 = time.perf_counter()
    with torch.inference_mode():  # touches every weight once: memory-mapped pages become resident
        model(torch.tensor([[0]]))
    t2 = time.perf_counter()
    _, peak = rss_and_peak()
    print(json.dumps({"load_s": t1 - t0, "first_token_s": t2 - t0, "peak_bytes": peak - baseline}))


def measure_load(library: str, folder: Path) -> dict:
    cmd = [sys.executable, __file__, "--load-child", library, str(folder)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# --- the run ---------------------------------------------------------------------------------


def measure_speed(folder: Path, args) -> dict:
    """Prefill and decode, both libraries on the same float32 weights, alternately."""
    from transformers import AutoModelForCausalLM

    import qwen_mini

    ours = qwen_mini.load_model(folder, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    long_ids = torch.randint(0, 151_643, (1, args.prefill), generator=g)
    prompt = torch.randint(0, 151_643, (1, args.prompt), generator=g)

    print(f"prefill {args.prefill} tokens ...", flush=True)
    prefill = alternate(
        {"ours": lambda: prefill_ours(ours, long_ids), "hf": lambda: prefill_hf(hf, long_ids)},
        args.repeats,
    )
    print(f"decode {args.new} tokens after {args.prompt} ...", flush=True)
    tokens = {}

    def decode_run(name, fn, model):
        def run():
            speed, tokens[name] = fn(model, prompt, args.new)
            return speed

        return run

    decode = alternate(
        {"ours": decode_run("ours", decode_ours, ours), "hf": decode_run("hf", decode_hf, hf)},
        args.repeats,
    )
    return {"prefill": prefill, "decode": decode, "same_tokens": tokens["ours"] == tokens["hf"]}


def report(args, cfg: dict, n_params: int, file_size: int, loads, speed, bandwidth: float):
    med = statistics.median
    rows = [("", "qwen_mini", "transformers", "speed-up", "target")]

    def row(label, ours, hf, speedup, target=""):
        rows.append((label, f"{ours:.2f}", f"{hf:.2f}", f"{speedup:.2f}x", target))

    pre_o, pre_h = med(speed["prefill"]["ours"]), med(speed["prefill"]["hf"])
    dec_o, dec_h = med(speed["decode"]["ours"]), med(speed["decode"]["hf"])
    row(f"prefill {args.prefill} tokens, s", pre_o, pre_h, pre_h / pre_o, ">= 1.0x")
    row(f"decode tok/s, {args.new} after {args.prompt}", dec_o, dec_h, dec_o / dec_h, ">= 1.1x")
    load = {k: {n: med(r[k] for r in runs) for n, runs in loads.items()} for k in loads["ours"][0]}
    row("load bf16 file, s", load["load_s"]["ours"], load["load_s"]["hf"],
        load["load_s"]["hf"] / load["load_s"]["ours"])  # fmt: skip
    row("load + first token, s", load["first_token_s"]["ours"], load["first_token_s"]["hf"],
        load["first_token_s"]["hf"] / load["first_token_s"]["ours"])  # fmt: skip
    peak_o, peak_h = load["peak_bytes"]["ours"], load["peak_bytes"]["hf"]
    row("peak RSS over baseline, GB", peak_o / GB, peak_h / GB, peak_h / peak_o)
    rows.append(("  / file size", f"{peak_o / file_size:.2f}", f"{peak_h / file_size:.2f}", "",
                 "<= 1.2"))  # fmt: skip

    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    print()
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        print("  ".join(cells))
    print("speed-up: transformers time / qwen_mini time; memory: transformers / qwen_mini")

    # The decode limit: every weight is read once per token. The tied embedding is read in full
    # as the head and only one row of it as the embedding lookup: count it once, plus that row.
    per_token = (n_params + cfg["hidden_size"]) * 4
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    kv_avg = kv * (args.prompt + args.new / 2)  # the cache at the average decode length
    limit = bandwidth / (per_token + kv_avg)
    print(
        f"\ndecode limit on this machine: {bandwidth / GB:.1f} GB/s read"
        " bandwidth (best sum over 1 GiB)"
        f" / ({per_token / GB:.3f} GB float32 weights + {kv_avg / GB:.3f} GB KV cache per token)"
        f" = {limit:.2f} tok/s; qwen_mini reaches {dec_o / limit:.0%}, "
        f"transformers {dec_h / limit:.0%}"
    )
    print(f"greedy tokens identical in both libraries: {'yes' if speed['same_tokens'] else 'NO'}")
    raw = {k: speed[k] for k in ("prefill", "decode")} | {"load": loads}
    print("every measurement:", json.dumps(raw, default=lambda x: round(x, 3)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, help="fewer layers, for a quick run (default: real 28)")
    p.add_argument("--prefill", type=int, default=256, help="prefill length (default 256)")
    p.add_argument("--prompt", type=int, default=128, help="prompt before decoding (128)")
    p.add_argument("--new", type=int, default=128, help="tokens to decode (128)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after warm-up (3)")
    p.add_argument("--load-child", nargs=2, metavar=("LIBRARY", "FOLDER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.load_child:
        return load_child(*args.load_child)

    print("machine:", describe_machine(), flush=True)
    with tempfile.TemporaryDirectory(prefix="qwen-mini-bench-") as tmp:
        folder = Path(tmp)
        file_size = write_checkpoint(folder, args.layers)
        cfg = json.loads((folder / "config.json").read_text())
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            n_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        print(
            f"model: Qwen3-0.6B shape, {cfg['num_hidden_layers']} layers, {n_params:,} unique "
            f"parameters (tied head once), random weights; bf16 file {file_size / GB:.2f} GB",
            flush=True,
        )
        print("loading the bf16 file, each loader in a fresh process, twice ...", flush=True)
        loads = {"ours": [], "hf": []}
        for _ in range(2):
            for name, library in (("ours", "qwen_mini"), ("hf", "transformers")):
                loads[name].append(measure_load(library, folder))
        bandwidth = read_bandwidth()
        speed = measure_speed(folder, args)  # float32; the models are freed on return
    report(args, cfg, n_params, file_size, loads, speed, bandwidth)


if __name__ == "__main__":
    main()
