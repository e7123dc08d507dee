"""On a GPU: every architecture loaded with `load_model(..., device="cuda")`, in float32 and
bfloat16, against transformers on the same GPU. Skipped where torch sees no CUDA device.

Each architecture's tiny checkpoint is written by transformers (as in tests/test_oracle.py) and
loaded by both libraries onto the GPU. float32: the logits agree within TOL, whole and with the
prompt fed in pieces through the cache, and greedy generation gives transformers' tokens (with a
lead of the best token over the runner-up far above TOL at every step, so that agreement is not
luck). bfloat16: the logits are bfloat16 and as close to float32's as transformers' own bfloat16
logits are. Then `qwen-mini generate ... --device cuda` on the two stand-ins, as a learner runs it.

tests/test_devices.py catches the same class of mistake on the CPU (a tensor made without
following its inputs); this file is the check on the device itself.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():  # before transformers is imported: the skip costs nothing
    pytest.skip("no CUDA device: tests/test_devices.py covers the CPU", allow_module_level=True)

from helpers import HF_CLASSES, greedy_reference, write_checkpoint  # noqa: E402

import qwen_mini  # noqa: E402
import qwen_mini.architectures  # noqa: E402
from qwen_mini.generation import generate_tokens  # noqa: E402

# float32 on the GPU: other kernels than the CPU's, so a little more than test_oracle's 1e-4
# (measured on an NVIDIA H200: at most 1.1e-4, with TF32 convolutions; they are off here)
TOL = 2e-4
# bfloat16: max |logits - float32 logits| may exceed transformers' own by this much (8 bits of
# mantissa: at |logits| ~4 a bf16 step is 0.016; a few steps, plus kernels that sum in another
# order); and the two libraries' bfloat16 logits differ by at most this much on average
BF16_EXTRA, BF16_MEAN = 0.1, 0.05
VOCAB = 256
SIZE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
# Qwen3.8-Flash-Next needs an eos id for its n-grams; tests/test_oracle_qwen4.py's size
QWEN4_SIZE = dict(vocab_size=VOCAB, hidden_size=32, max_position_embeddings=512, eos_token_id=3)
CASES = [
    pytest.param("qwen2", SIZE, id="qwen2"),
    pytest.param("qwen3", SIZE, id="qwen3"),
    pytest.param("qwen3_moe", SIZE, id="qwen3_moe"),
    pytest.param("qwen3_5", SIZE, id="qwen3_5"),
    pytest.param("qwen3_5_text", SIZE, id="qwen3_5_text"),
    pytest.param("qwen2_moe", SIZE, id="qwen2_moe"),
    pytest.param("qwen3_next", SIZE, id="qwen3_next"),
    pytest.param("qwen3_5_moe", SIZE, id="qwen3_5_moe"),
    pytest.param("qwen3_5_moe_text", SIZE, id="qwen3_5_moe_text"),
    pytest.param("qwen4_exp", QWEN4_SIZE, id="qwen4_exp"),
    pytest.param("qwen4_exp_text", QWEN4_SIZE, id="qwen4_exp_text"),
]
CUDA = torch.device("cuda")


def test_every_architecture_has_a_case():
    assert {c.values[0] for c in CASES} == set(qwen_mini.architectures.ARCHITECTURES)


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    """float32 products and convolutions in float32 (cuDNN would use TF32 for convolutions)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module", params=[c.values for c in CASES], ids=[c.id for c in CASES])
def models(request, tmp_path_factory):
    """{(library, dtype): model on the GPU}, all four from one checkpoint transformers wrote."""
    model_type, size = request.param
    folder = tmp_path_factory.mktemp(model_type)
    write_checkpoint(folder, model_type, tied=False, **size)
    ref_cls = HF_CLASSES[model_type][1]
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        found["ours", dtype] = qwen_mini.load_model(folder, dtype=dtype, device="cuda")
        found["ref", dtype] = ref_cls.from_pretrained(folder, dtype=dtype).to(CUDA).eval()
    yield found
    found.clear()
    gc.collect()
    torch.cuda.empty_cache()


def prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g).to(CUDA)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a.float() - b.float()).abs().max().item()


def test_everything_is_on_the_gpu(models):
    for dtype in (torch.float32, torch.bfloat16):
        ours = models["ours", dtype]
        tensors = list(ours.parameters()) + list(ours.buffers())
        assert all(t.device.type == "cuda" for t in tensors)
        assert all(t.dtype == dtype for t in ours.parameters())


@torch.inference_mode()
def test_float32_logits_match(models):
    ours, ref = models["ours", torch.float32], models["ref", torch.float32]
    ids = prompt(2, 13)  # long enough for qwen4_exp's sparse attention to select blocks
    got, want = ours(ids), ref(ids).logits
    assert got.device.type == "cuda" and got.dtype == torch.float32
    assert max_diff(got, want) <= TOL


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_cached_decode_in_pieces_is_the_whole_pass(models, dtype):
    """A prompt of 6, 4 single tokens, a piece of 5: the whole pass of transformers (float32),
    or ours whole (bfloat16, where two orders of summation differ by a few bf16 steps)."""
    ours = models["ours", dtype]
    ids = prompt(2, 15, seed=2)
    cache = ours.new_cache(batch_size=2)
    pieces = [ids[:, :6]] + [ids[:, i : i + 1] for i in range(6, 10)] + [ids[:, 10:]]
    got = torch.cat([ours(p, cache=cache) for p in pieces], dim=1)
    assert cache.length == 15 and got.dtype == dtype
    if dtype == torch.float32:
        want = models["ref", dtype](ids).logits
        assert max_diff(got, want) <= 2 * TOL * max(1.0, want.abs().max().item() / 4)
    else:
        want = ours(ids)
        assert (got.float() - want.float()).abs().mean().item() <= BF16_MEAN


@torch.inference_mode()
def test_bf16_logits_are_as_close_as_transformers(models):
    ours, ref = models["ours", torch.bfloat16], models["ref", torch.bfloat16]
    ids = prompt(2, 13)
    got, want = ours(ids), ref(ids).logits
    assert got.device.type == "cuda" and got.dtype == torch.bfloat16
    exact = models["ref", torch.float32](ids).logits
    assert max_diff(got, exact) <= max_diff(want, exact) + BF16_EXTRA
    assert (got.float() - want.float()).abs().mean().item() <= BF16_MEAN


@torch.inference_mode()
def test_greedy_generation_is_transformers(models):
    ours, ref = models["ours", torch.float32], models["ref", torch.float32]
    # seed 5: the best token leads by over 0.012 (60 TOL) at every step in every case, on a CPU
    ids = prompt(1, 8, seed=5)
    # an eos no model can produce: every case generates all 16 tokens
    expected = greedy_reference(ref, ids, 16, TOL, eos_token_id=VOCAB)[0, 8:].tolist()
    got = list(
        generate_tokens(ours, ids[0].tolist(), max_new_tokens=16, temperature=0, eos_token_ids=[])
    )
    assert got == expected


def test_bf16_generation_runs(models):
    ours, row = models["ours", torch.bfloat16], prompt(1, 8, seed=3)[0].tolist()
    for settings in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=5)):
        got = list(generate_tokens(ours, row, max_new_tokens=8, eos_token_ids=[], **settings))
        assert len(got) == 8 and all(0 <= t < VOCAB for t in got)


# --- the command line, as a learner runs it -----------------------------------------------------


@pytest.mark.parametrize("name", ["Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B"])
def test_generate_command_on_cuda(tmp_path, name):
    """`qwen-mini generate NAME "Hello" --device cuda --max-new-tokens 8` on the stand-in (the
    command run as `python -c` with qwen_mini's main, so it needs no installed script)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN_MINI_", "HF_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), QWEN_MINI_HOME=str(tmp_path))
    run_main = "import sys; from qwen_mini.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["generate", name, "Hello", "--device", "cuda", "--max-new-tokens", "8"]
    done = subprocess.run([sys.executable, "-c", run_main, *argv], env=env, text=True,
                          capture_output=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "stand-in" in done.stderr  # no weights here: the learner is told
    assert done.stdout.strip(), done.stderr  # some text came out
