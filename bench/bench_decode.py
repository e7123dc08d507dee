"""Decode speed on this machine, in one process: transformers' generate (default cache, static
cache) against qwen_mini eager, compiled (compile=True and "max-autotune") and speculative
decoding; then the Qwen3.5 stand-in drafting with its own trained MTP head.

    python bench/bench_decode.py                  # Qwen3-0.6B's width, 4 layers, bfloat16
    python bench/bench_decode.py --layers 28      # the real depth (slow on a small CPU)
    python bench/bench_decode.py --dtype float32

Random weights of Qwen3-0.6B's shape (assets/configs/qwen3-0.6b/config.json) with fewer layers,
written once with transformers and loaded by both libraries, so both run the same weights. The
speculative draft is the model's own first layers (a layer-skip draft, with the model's head):
random weights make any draft's acceptance a property of these weights only, so the acceptance
printed is this run's, not a real model's. Greedy decoding throughout; each timing is the
median of --repeats runs, taken alternately, from the first new token to the last. The decode
limit is (bytes of weights a token reads, the tied head once) / (the bandwidth sum() streams
here); each path's share of it is printed. The MTP part uses the embedded Qwen3.5 stand-in,
whose MTP head was trained on its frozen main model (assets/standins/qwen3.5-0.8b.json): its
acceptance is a tiny model's on a held-out book's sentences, not the real 0.8B's. See
bench/README.md.
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
sys.path.insert(0, str(ROOT / "bench"))

from bench_vs_transformers import read_bandwidth  # noqa: E402

# Sentences of the stand-in's held-out book (Jonah, King James Version; not in its training text).
MTP_PROMPTS = [
    "Now the word of the LORD came unto Jonah the son of Amittai, saying,",
    "But the LORD sent out a great wind into the sea, and there was a mighty tempest",
    "Then Jonah prayed unto the LORD his God out of the fish's belly,",
    "And the word of the LORD came unto Jonah the second time, saying,",
]


FIRST = []  # when the run being timed produced its first new token


def timed(fn) -> float:
    """Seconds from fn's first new token to its last: the decoding alone, not the prompt."""
    FIRST.clear()
    fn()
    return time.perf_counter() - FIRST[0]


def wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def drain(tokens) -> list[int]:
    """A generator's tokens, the first one's time noted in FIRST."""
    out = []
    for token in tokens:
        if not out:
            FIRST.append(time.perf_counter())
        out.append(token)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)

    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from qwen_mini import CausalLM, load_model
    from qwen_mini.generation import generate_tokens
    from qwen_mini.sampling import Sampling
    from qwen_mini.speculative import make_draft, speculative_decode

    torch.manual_seed(0)
    config = json.loads((ROOT / "assets/configs/qwen3-0.6b/config.json").read_text())
    config.update(num_hidden_layers=args.layers, torch_dtype="float32")
    hf = Qwen3ForCausalLM(Qwen3Config(**config)).to(dtype).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = load_model(folder, dtype=dtype)
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
        return drain(generate_tokens(ours, prompt, **greedy))

    def ours_compiled():
        return drain(generate_tokens(ours, prompt, compile=True, **greedy))

    def ours_autotuned():
        return drain(generate_tokens(ours, prompt, compile="max-autotune", **greedy))

    def ours_speculative():
        d = make_draft(draft, ours)
        s = Sampling(temperature=0)
        seen = torch.zeros(ours.config.vocab_size, dtype=torch.bool)
        with torch.inference_mode():
            out = drain(speculative_decode(ours, d, prompt, n, args.draft_tokens, s, None, (),
                                           seen, seen.clone()))  # fmt: skip
        stats["acceptance"] = d.accepted / max(d.proposed, 1)
        return out

    class FirstToken(BaseStreamer):  # generate hands it the prompt, then each new token
        def put(self, value):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 2:
                FIRST.append(time.perf_counter())

        def end(self):
            pass

    def hf_generate(**kw):
        with torch.inference_mode():
            out = hf.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                              streamer=FirstToken(), **kw)  # fmt: skip
        return out[0, args.prompt :].tolist()

    runs = {
        "transformers generate (default cache)": hf_generate,
        "transformers generate (static cache)": lambda: hf_generate(cache_implementation="static"),
        "qwen_mini eager": ours_eager,
        "qwen_mini compile=True": ours_compiled,
        'qwen_mini compile="max-autotune"': ours_autotuned,
        f"qwen_mini speculative ({args.draft_layers}-layer draft, k={args.draft_tokens})": (
            ours_speculative
        ),
    }
    want = ours_eager()
    for name, fn in runs.items():  # warm-up (compiles), and does every path give the same tokens
        print(f"warm-up {name}: {difference(ours, prompt, want, fn())}", file=sys.stderr)
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    base = statistics.median(times["transformers generate (default cache)"])
    threads = torch.get_num_threads()
    # every weight is read once per token; parameters() lists the tied head once
    per_token = sum(p.numel() * p.element_size() for p in ours.parameters())
    bandwidth = read_bandwidth()
    limit = bandwidth / per_token
    print(f"{args.layers} layers of Qwen3-0.6B's width, {args.dtype}, prompt {args.prompt}, "
          f"{n} new tokens, {threads} threads, torch {torch.__version__}")  # fmt: skip
    m = n - 1  # timed from the first new token to the last: the decoding alone
    print(f"tokens/s over the {m} tokens after the first (the prompt's pass not counted)")
    print(f"decode limit: {per_token / 1e9:.2f} GB of weights per token at "
          f"{bandwidth / 1e9:.1f} GB/s = {limit:.1f} tokens/s")  # fmt: skip
    for name, ts in times.items():
        t, spread = statistics.median(ts), (min(ts), max(ts))
        print(
            f"{name:55s} {m / t:8.1f} tokens/s ({m / spread[1]:.1f}-{m / spread[0]:.1f})  "
            f"{base / t:5.2f}x transformers default  {m / t / limit:4.0%} of the limit"
        )
    print(f"layer-skip draft acceptance: {stats['acceptance']:.0%} of drafts")
    mtp_standin(args.repeats, n)
    return 0


def difference(model, prompt: list[int], want: list[int], got: list[int]) -> str:
    """'same tokens', or where `got` leaves the eager tokens `want` and how close the eager
    logits' top two were there: a gap of a rounding step or two means a near-tie that a
    different order of summation may break the other way, not a different model."""
    i = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
    if i is None:
        return "same tokens"
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + want[:i]]), last_only=True)[0, -1].float()
    top = logits.topk(2).values
    gap = float(top[0] - top[1])
    return f"DIFFERENT tokens from token {i}, where the eager top two logits are {gap:.4f} apart"


def mtp_standin(repeats: int, n: int) -> None:
    """The Qwen3.5 stand-in, greedy: eager against its own MTP head drafting 1 and 3 tokens."""
    from qwen_mini.generation import generate_tokens
    from qwen_mini.sampling import Sampling
    from qwen_mini.speculative import make_draft, speculative_decode
    from qwen_mini.standin import load_standin
    from qwen_mini.tokenizer import load_tokenizer

    name = "Qwen/Qwen3.5-0.8B"
    model, tok = load_standin(name), load_tokenizer(name)
    prompts = [tok.encode(text) for text in MTP_PROMPTS]
    counts = {}

    def eager():
        return [list(generate_tokens(model, ids, max_new_tokens=n, temperature=0,
                                     eos_token_ids=[])) for ids in prompts]  # fmt: skip

    def mtp(k):
        def run():
            out, proposed, accepted = [], 0, 0
            for ids in prompts:
                d, s = make_draft("mtp", model), Sampling(temperature=0)
                seen = torch.zeros(model.config.vocab_size, dtype=torch.bool)
                with torch.inference_mode():
                    out.append(list(speculative_decode(model, d, ids, n, k, s, None, (), seen,
                                                       seen.clone())))  # fmt: skip
                proposed, accepted = proposed + d.proposed, accepted + d.accepted
            counts[k] = accepted / max(proposed, 1)
            return out

        return run

    runs = {"eager": eager, "MTP draft, k=1": mtp(1), "MTP draft, k=3": mtp(3)}
    want = eager()
    for label, fn in runs.items():
        got = fn()
        print(f"warm-up stand-in {label}: {'same tokens' if got == want else 'DIFFERENT tokens'}",
              file=sys.stderr)  # fmt: skip
    times = {label: [] for label in runs}
    for _ in range(repeats):
        for label, fn in runs.items():
            times[label].append(wall(fn))
    total = n * len(prompts)
    base = statistics.median(times["eager"])
    print(
        f"\nQwen3.5 stand-in ({model.config.num_hidden_layers} layers, hidden "
        f"{model.config.hidden_size}, trained MTP head), {len(prompts)} prompts x {n} tokens"
    )
    for label, ts in times.items():
        t = statistics.median(ts)
        accepted = f"  acceptance {counts[int(label[-1])]:.0%}" if label != "eager" else ""
        print(f"{label:55s} {total / t:8.1f} tokens/s  {base / t:5.2f}x eager{accepted}")


if __name__ == "__main__":
    sys.exit(main())
