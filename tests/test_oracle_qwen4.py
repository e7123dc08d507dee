"""qwen4_exp / qwen4_exp_text (Qwen3.8-Flash-Next) against transformers on tiny random
checkpoints that transformers wrote itself, as test_oracle.py does for the other types.

What the cases vary: the number of residual streams (2, 3, 4), the index block size and budget
(2 tokens / top 2 blocks, 4 / top 2, 3 / top 1: all select, from the 6th, 12th and 4th token on),
the n-gram order (2, 3, 4) and which layers have the embedding, the DeltaNet output gate (sigmoid,
silu), the router's renormalisation, tied and untied heads, one file and several, the text-only
and the multimodal checkpoint, the attention layers written "full_attention" (as the release
writes them) and "indexed_attention" (as transformers writes them), experts one by one (as
transformers writes them) and fused (as the released checkpoints store them). Every prompt holds
eos tokens, so the n-grams restart inside it; the cached runs feed pieces shorter than the n-gram
context.

Ties at the top-k block boundary: a block's score is a sum of ReLUs, so blocks every index head
scores negatively all score exactly 0, and a boundary between two equal scores makes the kept set
(and the logits) depend on how each library breaks the tie. The seeds below were chosen so that
no boundary is within 1e-3 (`assert_boundaries_separated` checks it on every prompt), and the
tests assert that the budget really drops blocks (`assert_budget_selects`).
"""

from __future__ import annotations

import gc
import itertools
import json
import re
import resource
import shutil

import pytest
import torch
from helpers import (
    HF_CLASSES,
    greedy_reference,
    hf_config,
    loaded_pair,
    tiny_config,
    write_checkpoint,
)
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file, save_file

import qwen_mini
from qwen_mini.architectures import config_from_file
from qwen_mini.checkpoint import CheckpointError, expected_shapes, meta_model
from qwen_mini.sparse_attention import QSAIndexer

TOL = 1e-4  # max abs logit difference, float32 both sides (as test_oracle.py)
VOCAB = 256
EOS = 3
SIZE = dict(vocab_size=VOCAB, hidden_size=32, max_position_embeddings=512, eos_token_id=EOS)
GAP = 1e-3  # the smallest distance allowed between the last kept and the first dropped block

CASES = [
    pytest.param(dict(model_type="qwen4_exp_text", tied=True, shard="40KB"),
                 id="text-hc2-block2-top2-ngram3-tied-sharded"),
    # 3 streams; blocks of 4, top 2; 4-grams, one head per order (E = 3 heads x 4); two PLE
    # layers; the silu gate (output_gate_type unset); weights not renormalised; 5 shards of 128
    # rows: 26 rows each, the last 24
    pytest.param(dict(model_type="qwen4_exp_text", tied=False, hc_count=3, hc_lowrank=6,
                      indexer_budget=8, indexer_compress_ratio=4, ngram_size=4, heads_per_ngram=1,
                      ple_embed_dim=12, ple_layer_ids=[1, 3], output_gate_type=None,
                      norm_topk_prob=False, split_ngram_parts=5),
                 id="text-hc3-block4-top2-ngram4-silu-untied"),
    # multimodal; 4 streams; blocks of 3, top 1; bigrams only, 4 heads; PLE on layer 2; the
    # attention layer written "full_attention"; experts stored fused
    pytest.param(dict(model_type="qwen4_exp", tied=False, hc_count=4, indexer_budget=3,
                      indexer_compress_ratio=3, indexer_n_heads=3, ngram_size=2,
                      heads_per_ngram=4, ple_layer_ids=[2], release_names=True, fused=True,
                      seed=1),
                 id="multimodal-hc4-block3-top1-ngram2-fused"),
    # text-only, experts fused, 4 index heads of 16 (RoPE turns 4 of them)
    pytest.param(dict(model_type="qwen4_exp_text", tied=True, indexer_n_heads=4,
                      indexer_head_dim=16, fused=True, seed=1),
                 id="text-hc2-index16-fused-tied"),
]  # fmt: skip


GATE_UP = ("gate_proj", "up_proj")


def fuse_experts(folder) -> None:
    """Rewrite a single-file checkpoint's experts in the released layout: per layer
    `experts.gate_up_proj` [E, 2I, H] (each expert's gate_proj rows, then its up_proj rows) and
    `experts.down_proj` [E, H, I], in place of transformers' `experts.{e}.*.weight`."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    layers = {k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}
    for layer in layers:
        e, gate_up, down = 0, [], []
        while f"{layer}.mlp.experts.{e}.gate_proj.weight" in tensors:
            expert = f"{layer}.mlp.experts.{e}"
            gate_up.append(torch.cat([tensors.pop(f"{expert}.{p}.weight") for p in GATE_UP]))
            down.append(tensors.pop(f"{expert}.down_proj.weight"))
            e += 1
        tensors[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{layer}.mlp.experts.down_proj"] = torch.stack(down)
    assert layers  # there were experts to fuse
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=[c.values[0] for c in CASES], ids=[c.id for c in CASES])
def pair(request, tmp_path_factory):
    """(qwen_mini model, transformers model), both loaded from one saved checkpoint."""
    case = dict(request.param)
    model_type, tied = case.pop("model_type"), case.pop("tied")
    shard, fused = case.pop("shard", None), case.pop("fused", False)
    release_names = case.pop("release_names", False)
    folder = tmp_path_factory.mktemp(model_type)
    write_checkpoint(folder, model_type, tied=tied, max_shard_size=shard, **SIZE, **case)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    assert "indexed_attention" in text["layer_types"]  # transformers writes its own name
    if release_names:  # the release's config.json says "full_attention"; both libraries read it
        text["layer_types"] = [t.replace("indexed", "full") for t in text["layer_types"]]
        (folder / "config.json").write_text(json.dumps(config))
    if fused:
        fuse_experts(folder)
    assert (folder / "model.safetensors.index.json").exists() == bool(shard)
    ours, ref = loaded_pair(folder, model_type, tied)
    yield ours, ref
    del ours, ref
    gc.collect()


def prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    """Random ids with eos inside: at 5 in the first row, twice in a row at 9 and 10 in the
    others, so that n-grams restart mid-prompt and one n-gram is eos, eos."""
    ids = torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    ids[0, 5] = EOS
    ids[1:, 9:11] = EOS
    return ids


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def indexer_scores(ours, ids: torch.Tensor) -> list[tuple[QSAIndexer, torch.Tensor]]:
    """(indexer, block scores [B, T, n_blocks]) of every attention layer of `ours` over a full
    pass on `ids`, from qwen_mini's own indexer (equal to transformers' wherever the kept blocks
    agree, which the logits tests check)."""
    found = []

    def capture(indexer, args, output):
        found.append((indexer, indexer.block_scores(*args)))

    indexers = [m for m in ours.modules() if isinstance(m, QSAIndexer)]
    hooks = [m.register_forward_hook(capture) for m in indexers]
    try:
        ours(ids)
    finally:
        for h in hooks:
            h.remove()
    assert len(found) == len(indexers) >= 1
    return found


def assert_boundaries_separated(ours, ids: torch.Tensor) -> None:
    """At every query that sees more complete blocks than it keeps, the last kept block scores
    at least GAP above the first dropped one: the kept set cannot depend on a tie."""
    for indexer, scores in indexer_scores(ours, ids):
        k, r = indexer.top_blocks, indexer.ratio
        for t in range(scores.shape[1]):
            seen = (t + 1) // r
            if seen > k:
                ranked = scores[:, t, :seen].sort(dim=-1, descending=True).values
                gap = (ranked[:, k - 1] - ranked[:, k]).min().item()
                assert gap > GAP, f"query {t}: the top-{k} boundary is a near-tie ({gap:.1e})"


def assert_budget_selects(ours, ids: torch.Tensor) -> None:
    """Some query keeps fewer tokens than causal attention would let it see."""
    for indexer, scores in indexer_scores(ours, ids):
        keep = indexer.select(scores, ids.shape[1])  # [B, T, T]
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        assert (keep <= causal).all()  # never a future token
        assert (keep.sum(-1) < causal.sum(-1)).any(), "the budget drops nothing: a dense test"


@torch.inference_mode()
def test_logits_match(pair):
    ours, ref = pair
    ids = prompt(2, 24)
    assert_boundaries_separated(ours, ids)
    assert_budget_selects(ours, ids)
    assert max_diff(ours(ids), ref(ids).logits) <= TOL


@torch.inference_mode()
def test_last_only_is_last_position(pair):
    ours, _ = pair
    ids = prompt(2, 13, seed=4)
    assert max_diff(ours(ids, last_only=True), ours(ids)[:, -1:]) <= TOL


@torch.inference_mode()
def test_cached_decode_and_pieces_match_full_forward(pair):
    """1 token, 2 tokens (both shorter than the n-gram context), 5, four single tokens, then
    the remaining 12 == one full forward of transformers."""
    ours, ref = pair
    ids = prompt(2, 24, seed=2)
    assert_boundaries_separated(ours, ids)
    expected = ref(ids).logits
    cache = ours.new_cache(batch_size=2)
    cuts = [0, 1, 3, 8, 9, 10, 11, 12, 24]
    got = torch.cat([ours(ids[:, a:b], cache=cache) for a, b in itertools.pairwise(cuts)], dim=1)
    assert cache.length == 24
    assert max_diff(got, expected) <= TOL


@torch.inference_mode()
def test_cache_holds_the_raw_index_keys(pair):
    """The attention layers' caches hold one raw index key per token, equal to the indexer's
    projection of the layer input (so block keys are re-pooled, not stored)."""
    ours, _ = pair
    ids = prompt(1, 9, seed=5)
    cache = ours.new_cache(batch_size=1)
    inputs = {}

    def keep_input(indexer, args):  # (returns None: the call goes on unchanged)
        inputs[indexer] = args[0]

    indexers = [m for m in ours.modules() if isinstance(m, QSAIndexer)]
    hooks = [m.register_forward_pre_hook(keep_input) for m in indexers]
    try:
        ours(ids, cache=cache)
    finally:
        for h in hooks:
            h.remove()
    states = [s for s in cache.layers if hasattr(s, "index_keys")]
    assert len(states) == len(indexers) >= 1
    for indexer, state in zip(indexers, states, strict=True):
        raw = indexer.index_qk_proj(inputs[indexer])[..., -indexer.head_dim :]
        assert state.index_keys.shape[2] >= 9 and max_diff(state.index_keys[:, 0, :9], raw) == 0


@torch.inference_mode()
def test_greedy_generation_is_token_identical(pair):
    from qwen_mini.generation import generate_tokens

    ours, ref = pair
    ids = prompt(1, 8, seed=3)
    # eos (id 3) must stay a token like the others, so transformers is told to stop at an id
    # that no model can produce (min_new_tokens would instead forbid eos)
    sequences = greedy_reference(ref, ids, 24, TOL, eos_token_id=VOCAB)
    assert_boundaries_separated(ours, sequences)
    expected = sequences[0, 8:].tolist()
    got = list(
        generate_tokens(ours, ids[0].tolist(), max_new_tokens=24, temperature=0, eos_token_ids=[])
    )
    assert got == expected


# --- the integer buffers of the n-gram embedding -------------------------------------------------


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen4_buffers")
    write_checkpoint(folder, "qwen4_exp_text", tied=False, **SIZE)
    return folder


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t + torch.tensor([2, 0, 0]), "layer_multipliers holds"),  # another hash
        (lambda t: t.float(), "must be torch.int64"),  # stored as a float tensor
    ],
    ids=["other-multipliers", "float-buffer"],
)
def test_wrong_hash_buffers_are_refused(small_checkpoint, tmp_path, change, message):
    """The checkpoint's hash buffers are loaded and checked against the config (seed, primes):
    a changed one is refused, naming the tensor, never used for a silently different model."""
    name = "model.layers.0.ple.ple_embedding.layer_multipliers"
    for f in small_checkpoint.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors[name].dtype == torch.int64  # transformers stores them as int64
    tensors[name] = change(tensors[name])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message) as err:
        qwen_mini.load_model(tmp_path)
    assert "layer_multipliers" in str(err.value)


def test_hash_buffers_equal_transformers(small_checkpoint):
    """The multipliers, primes and offsets qwen_mini derives from the config are the ones
    transformers wrote (load_model refuses others; here the numbers themselves)."""
    ours = qwen_mini.load_model(small_checkpoint)
    stored = load_file(small_checkpoint / "model.safetensors")
    embedding = ours.model.layers[0].ple.ple_embedding
    for name, values in embedding.implied_buffers().items():
        assert stored[f"model.layers.0.ple.ple_embedding.{name}"].tolist() == values
    assert embedding.sizes == [53, 59, 61, 67]  # the first four primes from 50, written out


# --- config.json fields: implemented or refused, naming the field --------------------------------

BAD_FIELDS = [
    (dict(indexer_kv_heads=2), "indexer_kv_heads"),
    (dict(indexer_budget=5), "indexer_budget = 5 must be a multiple"),
    (dict(indexer_head_dim=2), "indexer_head_dim = 2"),  # RoPE turns 4 dims of each head
    (dict(ple_layer_ids=[4]), "ple_layer_ids [4] are not linear_attention layers"),
    (dict(ple_layer_ids=[9]), "ple_layer_ids [9] are not layers 1 to 4"),
    (dict(output_gate_type="gelu"), "output_gate_type"),
    (dict(hc_count=1), "hc_count"),
    (dict(ple_embed_dim=10), "ple_embed_dim = 10 must be a multiple"),
    (dict(eos_token_id=None), "eos_token_id must be set"),
]


BAD_IDS = ["-".join(map(str, *f.items())) for f, _ in BAD_FIELDS]  # field-value


@pytest.mark.parametrize("fields, message", BAD_FIELDS, ids=BAD_IDS)
def test_bad_fields_are_refused_as_transformers_refuses_them(fields, message):
    from qwen_mini.architectures import config_from_dict

    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_dict(tiny_config("qwen4_exp_text", **fields))
    with pytest.raises((ValueError, StrictDataclassClassValidationError)):  # so does transformers
        hf_config("qwen4_exp_text", **fields)


def test_fields_transformers_ignores_are_refused_when_they_would_differ():
    """mamba_ssm_dtype other than float32: qwen_mini keeps the DeltaNet state in float32 only."""
    from qwen_mini.architectures import config_from_dict

    with pytest.raises(ValueError, match="mamba_ssm_dtype"):
        config_from_dict(tiny_config("qwen4_exp_text", mamba_ssm_dtype="bfloat16"))


# --- the real Qwen3.8-Flash-Next, on the meta device ---------------------------------------------

REAL = qwen_mini.ASSETS / "configs" / "qwen3.8-flash-next"  # reconstructed: see PROVENANCE.md


@pytest.fixture(scope="module")
def real_model():
    """(config, our meta model with fused experts, transformers' meta model) of the release."""
    from transformers import AutoConfig

    cfg = config_from_file(REAL / "config.json")
    ours = meta_model(cfg)  # the experts held fused, one module per layer: built in seconds
    with torch.device("meta"):
        theirs = HF_CLASSES["qwen4_exp"][1](AutoConfig.from_pretrained(REAL))
    return cfg, ours, theirs


def theirs_as_stored(theirs) -> dict[str, tuple[int, ...]]:
    """transformers' text tensors under the names the checkpoint stores: its one n-gram table
    cut into split_ngram_parts shards (its conversion mapping for qwen4_exp_text: Concatenate
    on loading, Chunk on saving)."""
    parts = theirs.config.text_config.split_ngram_parts
    out = {}
    for name, t in theirs.state_dict().items():
        if name.startswith("model.visual."):
            continue
        if not name.endswith("ngram_embedding.weight"):
            out[name] = tuple(t.shape)
            continue
        for i, shard in enumerate(torch.empty(t.shape, device="meta").chunk(parts)):
            out[name.replace(".weight", f".shard_{i}.weight")] = tuple(shard.shape)
    return out


def test_real_names_and_shapes_equal_transformers(real_model):
    cfg, ours, theirs = real_model
    got = expected_shapes(cfg, ours)
    # transformers has no MTP head (it skips mtp.* on load); the release's config has one layer
    mtp = {n: shape for n, shape in got.items() if n.startswith("mtp.")}
    assert "mtp.fc.weight" in mtp and cfg.mtp_num_hidden_layers == 1
    got = {n: shape for n, shape in got.items() if n not in mtp}
    assert got == theirs_as_stored(theirs)
    assert sum(".ngram_embedding.shard_" in n for n in got) == 128  # split_ngram_parts
    assert all(p.is_meta for p in ours.parameters())  # nothing was allocated


def part_of(name: str) -> str:
    if ".ngram_embedding." in name:
        return "ngram"
    if ".mlp.experts." in name:
        return "experts"
    return "embedding" if name in ("model.embed_tokens.weight", "lm_head.weight") else "rest"


def test_real_parameter_counts_are_the_published_ones(real_model):
    """Counted on our meta model, checked against transformers' and the model card: 125B
    parameters besides a 51B n-gram embedding, 6B active per token."""
    cfg, ours, theirs = real_model
    count = {"ngram": 0, "experts": 0, "embedding": 0, "rest": 0}
    for name, p in ours.named_parameters():
        if not name.startswith("mtp."):  # neither transformers nor the card counts the MTP head
            count[part_of(name)] += p.numel()
    vision = sum(p.numel() for n, p in theirs.named_parameters() if n.startswith("model.visual."))
    total = sum(count.values())
    assert total + vision == sum(p.numel() for p in theirs.parameters()) == 177_392_830_576
    assert count["ngram"] == 51_200_245_760  # 320,001,536 rows of 160
    # a token reads its 16 n-gram rows (one per hash head, ple_embed_dim in all), k of E experts
    active = count["rest"] + count["experts"] * cfg.num_experts_per_tok // cfg.num_experts
    active += cfg.ple_embed_dim * len(cfg.ple_layer_ids)
    # the model card: "125B + 51B n-gram embedding", "6B active" (neither counts the vision
    # tower; "active" leaves out the embedding and the head, as the card says)
    assert int((total - count["ngram"]) / 1e9) == 125
    assert int(count["ngram"] / 1e9) == 51
    assert int(active / 1e9) == 6
    assert active + count["embedding"] == 7_306_997_120  # the same, the embedding and head in


def test_real_config_without_weights_says_what_is_missing_and_the_memory(real_model, tmp_path):
    """The release's config.json alone: the error names the missing weights and the memory the
    checkpoint's tensors would take, counted on a meta model, none of it allocated."""
    cfg, ours, theirs = real_model
    shutil.copy(REAL / "config.json", tmp_path / "config.json")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(CheckpointError) as err:
        qwen_mini.load_model(tmp_path)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 2**20, f"{grown} KiB allocated"  # the weights described are 350 GB
    message = str(err.value)
    assert "no weights found" in message and "model.safetensors" in message
    stored = theirs_as_stored(theirs)  # transformers' tensors, as the checkpoint names them
    # and the MTP head the config describes (transformers has none): the release carries it
    stored |= {n: s for n, s in expected_shapes(cfg, ours).items() if n.startswith("mtp.")}
    total = sum(torch.Size(s).numel() for s in stored.values())
    assert f"{len(stored):,} tensors, {total / 1e9:.1f} B parameters" in message
    assert f"{2 * total / 1e9:.1f} GB in bfloat16" in message
