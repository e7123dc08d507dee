"""Every architecture runs where its inputs are, and in the dtype of its weights.

Device. With torch's default device set to "meta", a tensor made without `device=` (a
`torch.arange` of frequencies, a mask, an index table) lands on "meta", which holds no data: the
first operation that mixes it with the model's CPU tensors raises, and so does copying it out.
That is the mistake which, on a GPU, raises "Expected all tensors to be on the same device", and
it shows here on the CPU. So each architecture's forward pass, cached decode (the prompt in
pieces, then single tokens), chat prefill and generation (greedy and sampled) run under that
default with the model and the inputs on the CPU, and must give what the same run gives
without it. `test_the_meta_default_catches_*` show that the check fails on code that makes a
tensor without following its inputs, so a pass means something.

Dtype. A bfloat16 model answers in bfloat16, every block of it (no float32 leaking from one
block into the next, which the next block would then run in float32), with the logits of
transformers' own bfloat16 model of the same checkpoint. The steps the prose computes in float32
(norms, the DeltaNet gates' softplus, RoPE angles) are where a bfloat16 slip shows: each moves
the logits by 0.1 to 1.9 against transformers' bfloat16 ones, where the package is within 0.05.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import HF_CLASSES, tiny_model, write_checkpoint

import qwen_mini
import qwen_mini.architectures
from qwen_mini.chat import prefill
from qwen_mini.generation import generate_tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny products

VOCAB = 128  # tests/helpers.py's tiny config

# One case per architecture (test_every_architecture_has_a_case), and the two RoPE scalings,
# which compute their own frequencies. Fields are overrides of the tiny config.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
CASES = [
    pytest.param("qwen2", {}, id="qwen2"),
    pytest.param("qwen3", {}, id="qwen3"),
    pytest.param("qwen3", {"rope_scaling": YARN}, id="qwen3-yarn"),
    pytest.param("qwen3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                 id="qwen3-linear"),
    pytest.param("qwen3_moe", {}, id="qwen3_moe"),
    pytest.param("qwen3_5", {}, id="qwen3_5"),
    pytest.param("qwen3_5_text", {}, id="qwen3_5_text"),
    pytest.param("qwen2_moe", {}, id="qwen2_moe"),
    pytest.param("qwen3_next", {}, id="qwen3_next"),
    pytest.param("qwen3_5_moe", {}, id="qwen3_5_moe"),
    pytest.param("qwen3_5_moe_text", {}, id="qwen3_5_moe_text"),
    pytest.param("qwen4_exp", {}, id="qwen4_exp"),
    pytest.param("qwen4_exp_text", {}, id="qwen4_exp_text"),
]  # fmt: skip
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]


def test_every_architecture_has_a_case():
    covered = {case.values[0] for case in CASES}
    assert covered == set(qwen_mini.architectures.ARCHITECTURES)


@contextlib.contextmanager
def meta_default():
    """torch's default device is "meta" inside, whatever happens; the one before it after."""
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(before)


def prompt(batch: int = 2, length: int = 11) -> torch.Tensor:
    """Random ids [batch, length] on the CPU: long enough for the sparse attention of qwen4_exp
    to select blocks (it keeps 2 blocks of 2 tokens from the 6th token on)."""
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def run_everything(model, ids: torch.Tensor) -> dict:
    """What the model computes from ids [2, 11], by every path a user takes."""
    out = {}
    with torch.inference_mode():
        out["forward"] = model(ids)
        out["last_only"] = model(ids, last_only=True)
        cache = model.new_cache(batch_size=2)  # a prompt in pieces, then single tokens
        pieces = [ids[:, :5], ids[:, 5:6], ids[:, 6:7], ids[:, 7:]]
        out["cached"] = torch.cat([model(p, cache=cache) for p in pieces], dim=1)
        cache, first = model.new_cache(), ids[0, :7].tolist()  # a chat: a turn, then the next
        logits, _ = prefill(model, cache, [], first)
        out["prefill"] = [logits, prefill(model, cache, first, ids[0].tolist())[0]]
    row = ids[0].tolist()
    out["greedy"] = list(
        generate_tokens(model, row, max_new_tokens=6, temperature=0, eos_token_ids=[])
    )
    sampling = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, presence_penalty=0.5)
    out["sampled"] = list(
        generate_tokens(model, row, max_new_tokens=6, seed=7, eos_token_ids=[], **sampling)
    )
    return out


def assert_same(got: dict, want: dict) -> None:
    for key, w in want.items():
        g = got[key]
        if isinstance(w, torch.Tensor):
            assert g.device == w.device and g.dtype == w.dtype, key
            assert torch.equal(g, w), f"{key}: differs by {(g - w).abs().max().item():.2e}"
        elif isinstance(w, list) and w and isinstance(w[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True)), key
        else:
            assert g == w, key


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type, fields", CASES)
def test_runs_on_its_inputs_device(model_type, fields, dtype):
    """Under a "meta" default, every path runs and gives the plain run's results exactly."""
    ids = prompt()
    # a fresh model for each run: nothing one run keeps (a table made once) serves the other
    model = tiny_model(model_type, **fields).to(dtype)
    with meta_default():
        assert torch.empty(0).device.type == "meta"  # the default really is in force
        got = run_everything(model, ids)
    assert torch.empty(0).device.type == "cpu"
    want = run_everything(tiny_model(model_type, **fields).to(dtype), ids)
    assert want["forward"].dtype == dtype and want["forward"].device.type == "cpu"
    assert_same(got, want)


@pytest.mark.parametrize("source", ["Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B", "qwen4_exp"])
def test_loading_follows_the_device_asked_for(tmp_path, monkeypatch, source):
    """load_model puts every tensor on the device it is given, whatever torch's default device
    (the stand-ins draw their weights on the CPU on purpose: the same numbers on every machine)."""
    for var in ("QWEN_MINI_WEIGHTS", "QWEN_MINI_DOWNLOAD", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)  # no real weights: the stand-in
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if "/" not in source:  # a checkpoint written by transformers, read back in bfloat16
        write_checkpoint(tmp_path, source, tied=False)
        source = tmp_path
    with meta_default():
        got = qwen_mini.load_model(source, dtype=torch.bfloat16, device="cpu")
    want = qwen_mini.load_model(source, dtype=torch.bfloat16, device="cpu")
    got, want = got.state_dict(), want.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].device == want[k].device for k in want)


# --- the check can fail: code that does not follow its inputs --------------------------------


def test_the_meta_default_catches_a_tensor_made_without_device():
    positions = torch.arange(4)  # on the CPU, made before
    with meta_default():
        made = torch.arange(0, 8, 2, dtype=torch.float32)  # no device=: lands on meta
        assert made.is_meta
        with pytest.raises((RuntimeError, NotImplementedError)):
            positions.float()[:, None] * made[None, :]  # a CPU tensor meets a meta one
        with pytest.raises(NotImplementedError, match="meta"):
            made.to(positions.device)  # made, then copied where it is needed: no data to copy


def _rope_cos_sin_without_device(positions, head_dim, theta, dtype=torch.float32):
    """rope_cos_sin as it was: the frequencies made on the default device."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _project_copying_its_order(self, x):
    """FusedGatedDeltaNet.project as it was: its permutation made on the CPU and copied to the
    input's device at every call."""
    from qwen_mini.fused_deltanet import fused_projection_order

    fused = torch.cat([self.in_proj_qkvz(x), self.in_proj_ba(x)], dim=-1)
    order = fused_projection_order(self.n_k, self.d_k, self.n_v, self.d_v)
    unfused = fused[..., order.argsort().to(x.device)]
    return unfused.split([self.conv_dim, self.n_v * self.d_v, self.n_v, self.n_v], dim=-1)


@pytest.mark.parametrize(
    "model_type, target, broken",
    [
        ("qwen3", "qwen_mini.rope_scaling.rope_cos_sin", _rope_cos_sin_without_device),
        (
            "qwen3_next",
            "qwen_mini.fused_deltanet.FusedGatedDeltaNet.project",
            _project_copying_its_order,
        ),
    ],
    ids=["rope-frequencies-on-the-default-device", "fused-order-copied-every-call"],
)
def test_the_meta_default_catches_a_broken_model(monkeypatch, model_type, target, broken):
    """The two device bugs the package had fail the test above; the plain run does not see
    them (on the CPU they are harmless, on a GPU the first forward pass raised)."""
    monkeypatch.setattr(target, broken)
    model, ids = tiny_model(model_type), prompt()
    with torch.inference_mode():
        model(ids)  # on the CPU, with the CPU default: fine
        with meta_default(), pytest.raises((RuntimeError, NotImplementedError)):
            model(ids)


# --- bfloat16 --------------------------------------------------------------------------------

TOL_BF16 = 0.05  # max |logit difference| to transformers in bfloat16: 3 steps of bf16 at 4
#                  (bf16 keeps 8 bits: at |logits| ~4 its steps are 2^-6 = 0.016 apart)


def floating_outputs_not_in(model, dtype) -> tuple[list[str], list]:
    """(found, hooks): hooks that list in `found` every module whose output holds a floating
    tensor of another dtype than `dtype`; remove the hooks after the run."""
    found = []

    def hook(module, args, output, name):
        outputs = output if isinstance(output, tuple) else (output,)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
                found.append(f"{name or type(module).__name__} gave {t.dtype}")

    handles = [
        m.register_forward_hook(lambda m, a, o, name=name: hook(m, a, o, name))
        for name, m in model.named_modules()
    ]
    return found, handles


@pytest.mark.parametrize("model_type, fields", [c for c in CASES if not c.values[1]])
def test_bf16_is_transformers_bf16(tmp_path, model_type, fields):
    """load_model(dtype=torch.bfloat16) of a float32 checkpoint: bfloat16 from every block, and
    the logits of transformers' bfloat16 model, whole and in cached pieces; the float32 model
    matches transformers' float32 one (the bf16 comparison is not of two wrong models)."""
    write_checkpoint(tmp_path, model_type, tied=False)
    ours = qwen_mini.load_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ref_cls = HF_CLASSES[model_type][1]
    ref16 = ref_cls.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ref32 = ref_cls.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = prompt()
    found, handles = floating_outputs_not_in(ours, torch.bfloat16)
    try:
        with torch.inference_mode():
            got = ours(ids)
            cache = ours.new_cache(batch_size=2)
            pieces = torch.cat([ours(ids[:, :6], cache=cache), ours(ids[:, 6:7], cache=cache),
                                ours(ids[:, 7:], cache=cache)], dim=1)  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    assert not found, f"blocks of the bf16 model answered in another dtype: {found[:5]}"
    with torch.inference_mode():
        want, want32 = ref16(ids).logits, ref32(ids).logits
        ours32 = qwen_mini.load_model(tmp_path, dtype=torch.float32)(ids)
    assert got.dtype == pieces.dtype == want.dtype == torch.bfloat16
    assert (ours32 - want32).abs().max().item() <= 1e-4
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= TOL_BF16, f"{diff:.3f} from transformers' bfloat16 logits"
    # in pieces, other sums than whole (other chunks of the delta rule): a few bf16 steps more
    diff = (pieces.float() - want.float()).abs().max().item()
    assert diff <= 4 * TOL_BF16, f"{diff:.3f} from transformers' bfloat16 logits, in pieces"
    # and both are as close to float32 as transformers' bfloat16 is
    err, ref_err = ((x.float() - want32).abs().max().item() for x in (got, want))
    assert err <= ref_err + TOL_BF16


def test_bf16_catches_a_norm_in_bf16(tmp_path, monkeypatch):
    """The bf16 comparison fails when a step the prose keeps in float32 runs in bfloat16."""
    import qwen_mini.norms

    def normalize_in_bf16(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    write_checkpoint(tmp_path, "qwen3_5_text", tied=False)
    want = HF_CLASSES["qwen3_5_text"][1].from_pretrained(tmp_path, dtype=torch.bfloat16)
    monkeypatch.setattr(qwen_mini.norms.RMSNorm, "normalize", normalize_in_bf16)
    ours = qwen_mini.load_model(tmp_path, dtype=torch.bfloat16)
    with torch.inference_mode():
        diff = (ours(prompt()).float() - want.eval()(prompt()).logits.float()).abs().max()
    assert diff > 2 * TOL_BF16
