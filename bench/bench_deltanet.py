"""Gated DeltaNet speed: the package's chunk form vs its recurrent form vs transformers' torch
chunk reference, and decoding with the Qwen3.5-0.8B shape vs transformers. Ratios, one process.

    python bench/bench_deltanet.py                     # L = 1024, 4096, 8192; 0.8B decode
    python bench/bench_deltanet.py --lengths 1024 --layers 4 --new 8   # a quick run

Random inputs and weights (speed does not depend on the values), float32, H = 16, d = 128.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig, Qwen3_5ForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from qwen_mini.config import ASSETS
from qwen_mini.deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule
from qwen_mini.generation import generate_tokens
from qwen_mini.runtime import convert_for_runtime

CONFIG = ASSETS / "configs" / "qwen3.5-0.8b"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rule_inputs(L: int, H: int = 16, d: int = 128):
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, L, H, d, generator=g), dim=-1)
    k = F.normalize(torch.randn(1, L, H, d, generator=g), dim=-1)
    v = torch.randn(1, L, H, d, generator=g)
    decay = -torch.rand(1, L, H, generator=g) * 2
    beta = torch.rand(1, L, H, generator=g)
    return q, k, v, decay, beta


def bench_rule(lengths: list[int], repeats: int) -> None:
    print("L       chunk (s)  recurrent (s)  transformers chunk (s)  recurrent/chunk  hf/chunk")
    for L in lengths:
        x = rule_inputs(L)
        runs = {
            "chunk": lambda x=x: chunk_gated_delta_rule(*x),
            "recurrent": lambda x=x: recurrent_gated_delta_rule(*x),
            "hf": lambda x=x: torch_chunk_gated_delta_rule(*x, output_final_state=True),
        }
        times = {name: [] for name in runs}
        if L <= 1024:  # warm-up (the longer runs warm themselves)
            for fn in runs.values():
                fn()
        for r in range(repeats):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                times[name].append(timed(runs[name]))
        m = {name: statistics.median(t) for name, t in times.items()}
        print(
            f"{L:<7d} {m['chunk']:9.3f}  {m['recurrent']:13.3f}  {m['hf']:22.3f}  "
            f"{m['recurrent'] / m['chunk']:15.1f}  {m['hf'] / m['chunk']:8.2f}"
        )


def bench_decode(layers: int | None, prompt_len: int, new: int) -> None:
    import qwen_mini
    from qwen_mini.config import Config

    hf_cfg = AutoConfig.from_pretrained(CONFIG).text_config
    if layers:
        hf_cfg.num_hidden_layers = layers
        hf_cfg.layer_types = hf_cfg.layer_types[:layers]
    torch.manual_seed(0)
    ref = Qwen3_5ForCausalLM(hf_cfg).eval()
    cfg = Config.from_dict(hf_cfg.to_dict())
    ours = qwen_mini.CausalLM(cfg).eval()
    ours.load_state_dict(ref.state_dict())  # the same weights
    ours = convert_for_runtime(ours)  # what load_model runs: the threaded projections
    ids = torch.randint(0, 248_044, (1, prompt_len), generator=torch.Generator().manual_seed(1))

    def ours_run():
        tokens, start = [], None
        for i, t in enumerate(generate_tokens(ours, ids[0].tolist(), max_new_tokens=new)):
            if i == 0:
                start = time.perf_counter()
            tokens.append(t)
        return (new - 1) / (time.perf_counter() - start), tokens

    def hf_run():
        from transformers import LogitsProcessor, LogitsProcessorList

        class Clock(LogitsProcessor):
            def __init__(self):
                self.start = None

            def __call__(self, input_ids, scores):
                if self.start is None and input_ids.shape[1] == prompt_len + 1:
                    self.start = time.perf_counter()
                return scores

        clock = Clock()
        with torch.inference_mode():
            out = ref.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([clock]),
            )
        return (new - 1) / (time.perf_counter() - clock.start), out[0, prompt_len:].tolist()

    ours_run(), hf_run()  # warm-up
    a, ours_tokens = ours_run()
    b, hf_tokens = hf_run()
    same = ours_tokens == hf_tokens
    n_layers = cfg.num_hidden_layers
    print(
        f"decode, Qwen3.5-0.8B shape ({n_layers} layers), float32, {prompt_len}-token prompt, "
        f"{new} new tokens: qwen_mini {a:.2f} tok/s, transformers {b:.2f} tok/s, ratio "
        f"{a / b:.2f}x; same tokens: {same}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="cut the 0.8B to n layers")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_rule(args.lengths, args.repeats)
    if not args.skip_decode:
        bench_decode(args.layers, args.prompt, args.new)


if __name__ == "__main__":
    main()
