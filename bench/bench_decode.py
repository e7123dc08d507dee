"""Decode speed on this machine, in one process: transformers' generate (default cache, static
cache) against qwen_mini eager, compiled (compile=True) and speculative decoding.

    python bench/bench_decode.py                  # Qwen3-0.6B's width, 4 layers, float32
    python bench/bench_decode.py --layers 28      # the real depth (slow on a small CPU)

Random weights of Qwen3-0.6B's shape (assets/configs/qwen3-0.6b/config.json) with fewer layers,
written once with transformers and loaded by both libraries, so both run the same weights. The
speculative draft is the model's own first layers (a layer-skip draft, with the model's head):
random weights make any draft's acceptance a property of these weights only, so the acceptance
printed is this run's, not a real model's. Greedy decoding throughout; each timing is the
median of --repeats runs, taken alternately. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qwen_mini import CausalLM, load_model
    from qwen_mini.generation import generate_tokens
    from qwen_mini.sampling import Sampling
    from qwen_mini.speculative import make_draft, speculative_decode

    torch.manual_seed(0)
    config = json.loads((ROOT / "assets/configs/qwen3-0.6b/config.json").read_text())
    config.update(num_hidden_layers=args.layers, torch_dtype="float32")
    hf = Qwen3ForCausalLM(Qwen3Config(**config)).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = load_model(folder, dtype=torch.float32)
    # the draft: the model's first layers and its embedding, final norm and head
    cfg = ours.config
    small = replace(cfg, num_hidden_layers=args.draft_layers,
                    layer_types=cfg.layer_types[: args.draft_layers])  # fmt: skip
    draft = CausalLM(small).eval()
    state = ours.state_dict()
    draft.load_state_dict({k: state[k] for k in draft.state_dict()})
    prompt = torch.randint(0, config["vocab_size"], (1, args.prompt)).tolist()[0]
    ids, n = torch.tensor([prompt]), args.new
    greedy = dict(max_new_tokens=n, temperature=0, eos_token_ids=[])
    stats = {}

    def ours_eager():
        return list(generate_tokens(ours, prompt, **greedy))

    def ours_compiled():
        return list(generate_tokens(ours, prompt, compile=True, **greedy))

    def ours_speculative():
        d = make_draft(draft, ours)
        s = Sampling(temperature=0)
        seen = torch.zeros(ours.config.vocab_size, dtype=torch.bool)
        with torch.inference_mode():
            out = list(speculative_decode(ours, d, prompt, n, args.draft_tokens, s, None, (),
                                          seen, seen.clone()))  # fmt: skip
        stats["acceptance"] = d.accepted / max(d.proposed, 1)
        return out

    def hf_generate(**kw):
        with torch.inference_mode():
            out = hf.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, **kw)
        return out[0, args.prompt :].tolist()

    runs = {
        "transformers generate (default cache)": hf_generate,
        "transformers generate (static cache)": lambda: hf_generate(cache_implementation="static"),
        "qwen_mini eager": ours_eager,
        "qwen_mini compile=True": ours_compiled,
        f"qwen_mini speculative ({args.draft_layers}-layer draft, k={args.draft_tokens})": (
            ours_speculative
        ),
    }
    want = ours_eager()
    for name, fn in runs.items():  # warm-up (compiles), and every path gives the same tokens
        got = fn()
        print(f"warm-up {name}: {'same tokens' if got == want else 'DIFFERENT tokens'}",
              file=sys.stderr)  # fmt: skip
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    base = statistics.median(times["transformers generate (default cache)"])
    threads = torch.get_num_threads()
    print(f"{args.layers} layers of Qwen3-0.6B's width, float32, prompt {args.prompt}, "
          f"{n} new tokens, {threads} threads, torch {torch.__version__}")  # fmt: skip
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:55s} {n / t:8.1f} tokens/s  {base / t:5.2f}x transformers default")
    print(f"speculative acceptance: {stats['acceptance']:.0%} of drafts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
