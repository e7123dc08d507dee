"""The MoE blocks and the load-balancing loss against transformers (the oracle) on tiny random
weights: Qwen3-MoE's sparse block, the shared-expert block of Qwen3-Next and Qwen3.5-MoE in both
expert layouts, and `load_balancing_loss_func`."""

import pytest
import torch
from helpers import randomize
from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig, Qwen3NextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeSparseMoeBlock,
    load_balancing_loss_func,
)
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from qwen_mini import moe
from qwen_mini.course.lab import ch03 as lab

H, I, I_SHARED = 32, 24, 40


def _hf_config(config_cls, E, k, norm=True, **extra):
    cfg = config_cls(
        hidden_size=H,
        moe_intermediate_size=I,
        num_experts=E,
        num_experts_per_tok=k,
        **({} if norm is None else {"norm_topk_prob": norm}),
        **extra,
    )
    cfg._experts_implementation = "eager"  # the reference loop, not a fused kernel
    return cfg


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights of scale 1/sqrt(fan_in), router logits spread enough that routing is not flat."""
    randomize(module, seed, std=1.0, fan_in=True, scales={"gate.weight": 3.0})


def _per_expert_state(hf_block) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors written out one expert at a time, the layout of the
    Qwen3-MoE and Qwen3-Next checkpoints (transformers' conversion: gate_up_proj[e] is the
    expert's gate_proj rows followed by its up_proj rows)."""
    state = {k: v for k, v in hf_block.state_dict().items() if not k.startswith("experts.")}
    gate_up, down = hf_block.experts.gate_up_proj, hf_block.experts.down_proj
    inter = down.shape[-1]
    for e in range(gate_up.shape[0]):
        state[f"experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        state[f"experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        state[f"experts.{e}.down_proj.weight"] = down[e]
    return state


def _input(seed: int, B=3, T=7, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(B, T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


CASES = [(4, 1, True), (4, 2, True), (4, 2, False), (8, 3, True), (8, 3, False), (16, 8, True)]


@pytest.mark.parametrize("E, k, norm", CASES)
def test_sparse_block_matches_qwen3_moe(E, k, norm):
    hf = Qwen3MoeSparseMoeBlock(_hf_config(Qwen3MoeConfig, E, k, norm)).eval()
    _randomize(hf, seed=E * 10 + k)
    ours = moe.SparseMoeBlock(H, I, E, k, norm_topk_prob=norm)
    ours.load_state_dict(_per_expert_state(hf), strict=True)  # names = checkpoint keys
    x = _input(k)
    with torch.no_grad():
        want, got = hf(x), ours(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the routing is not trivial: several experts are used and renormalisation matters
    _, experts_idx = moe.route(ours.router_logits(x), k, norm)
    assert experts_idx.unique().numel() > min(E - 1, 2)


def test_renormalisation_changes_the_output():
    """norm_topk_prob on and off give different blocks: the tests above can tell them apart."""
    hf = Qwen3MoeSparseMoeBlock(_hf_config(Qwen3MoeConfig, 8, 2, True)).eval()
    _randomize(hf, seed=1)
    ours = moe.SparseMoeBlock(H, I, 8, 2, norm_topk_prob=False)
    ours.load_state_dict(_per_expert_state(hf))
    x = _input(0)
    with torch.no_grad():
        assert (ours(x) - hf(x)).abs().max() > 1e-2


@pytest.mark.parametrize("E, k, norm", [(4, 2, True), (8, 3, False), (16, 4, True)])
@pytest.mark.parametrize("fused", [False, True])
def test_shared_expert_block_matches_qwen3_next(E, k, norm, fused):
    cfg = _hf_config(Qwen3NextConfig, E, k, norm, shared_expert_intermediate_size=I_SHARED)
    hf = Qwen3NextSparseMoeBlock(cfg).eval()
    _randomize(hf, seed=E + k)
    ours = moe.SharedExpertMoeBlock(H, I, E, k, I_SHARED, norm_topk_prob=norm, fused=fused)
    state = hf.state_dict() if fused else _per_expert_state(hf)
    ours.load_state_dict(state, strict=True)
    x = _input(E)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("E, k", [(4, 2), (8, 2), (16, 8)])
def test_fused_shared_expert_block_matches_qwen3_5_moe(E, k):
    """Qwen3.5-MoE checkpoints store the experts fused ([E, 2I, H] and [E, H, I], no .weight
    suffix) and always renormalise the top-k weights."""
    cfg = _hf_config(Qwen3_5MoeTextConfig, E, k, None, shared_expert_intermediate_size=I_SHARED)
    hf = Qwen3_5MoeSparseMoeBlock(cfg).eval()
    _randomize(hf, seed=3 * E + k)
    ours = moe.SharedExpertMoeBlock(H, I, E, k, I_SHARED, norm_topk_prob=True, fused=True)
    assert sorted(ours.state_dict()) == sorted(hf.state_dict())
    assert ours.experts.gate_up_proj.shape == (E, 2 * I, H)
    assert ours.experts.down_proj.shape == (E, H, I)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = _input(E + 1)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-5)


def test_shared_expert_gate_is_a_sigmoid():
    """Zeroing the routed experts leaves sigmoid(gate(x)) * shared_expert(x), by hand."""
    block = moe.SharedExpertMoeBlock(H, I, 4, 2, I_SHARED)
    with torch.no_grad():
        for p in block.experts.parameters():
            p.zero_()
    x = _input(5)
    with torch.no_grad():
        g = x @ block.shared_expert_gate.weight.T  # [B, T, 1]
        want = block.shared_expert(x) / (1 + torch.exp(-g))
        torch.testing.assert_close(block(x), want, atol=1e-6, rtol=1e-6)


def test_sparse_block_bfloat16_close_to_transformers():
    hf = Qwen3MoeSparseMoeBlock(_hf_config(Qwen3MoeConfig, 8, 2, True)).eval()
    _randomize(hf, seed=2)
    ours = moe.SparseMoeBlock(H, I, 8, 2)
    ours.load_state_dict(_per_expert_state(hf))
    hf, ours = hf.bfloat16(), ours.bfloat16()
    x = _input(3, dtype=torch.bfloat16)
    with torch.no_grad():
        want, got = hf(x), ours(x)
    assert got.dtype == torch.bfloat16
    # same routing (the router softmax is float32 in both); experts summed in another order
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# --- routing --------------------------------------------------------------------------------------


def test_route_equals_softmax_over_the_top_k_logits():
    """softmax over all E -> top-k -> renormalise == softmax over the k largest logits; without
    renormalisation the weights sum to less than 1."""
    logits = torch.randn(50, 16, generator=torch.Generator().manual_seed(0)) * 2
    weights, idx = moe.route(logits, 4, norm_topk_prob=True)
    top = logits.topk(4, dim=-1)
    assert torch.equal(idx, top.indices)
    torch.testing.assert_close(weights, torch.softmax(top.values, -1), atol=1e-6, rtol=1e-6)
    raw, _ = moe.route(logits, 4, norm_topk_prob=False)
    assert (raw.sum(-1) < 1 - 1e-3).all()


def test_route_softmax_in_float32_for_bfloat16_logits():
    logits = (torch.randn(64, 8, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    weights, idx = moe.route(logits, 2)
    want = torch.softmax(logits.float().topk(2, -1).values, -1).bfloat16()
    assert weights.dtype == torch.bfloat16
    assert torch.equal(idx, logits.float().topk(2, -1).indices)
    torch.testing.assert_close(weights, want, atol=0, rtol=0)


# --- load balancing -------------------------------------------------------------------------------


@pytest.mark.parametrize("E, k, layers, N", [(4, 1, 1, 10), (8, 2, 3, 17), (16, 4, 2, 33)])
def test_load_balancing_loss_matches_transformers(E, k, layers, N):
    g = torch.Generator().manual_seed(E + k)
    logits = [torch.randn(N, E, generator=g) * 2 for _ in range(layers)]
    want = load_balancing_loss_func(tuple(logits), E, k)
    torch.testing.assert_close(lab.load_balancing_loss(logits, k), want, atol=1e-6, rtol=1e-6)
    for one in logits:  # per layer: the same function on one layer
        torch.testing.assert_close(
            lab.load_balancing_loss([one], k), load_balancing_loss_func((one,), E, k)
        )


def test_what_f_sums_to():
    """f_e is the fraction of TOKENS routed to e, so sum_e f_e = k (not 1): a perfectly balanced
    router scores k. Hand-built: token i strongly prefers experts i, i+1, ..., i+k-1 (mod E)."""
    E, k = 8, 3
    logits = torch.zeros(E, E)
    for i in range(E):
        for j in range(k):
            logits[i, (i + j) % E] = 5.0
    counts, prob_sums, n = lab.routing_statistics(logits, k)
    assert n == E and counts.sum() == E * k
    assert torch.equal(counts, torch.full((E,), float(k)))  # every expert serves k tokens
    torch.testing.assert_close(prob_sums, torch.ones(E))  # cyclic symmetry: P_e = 1/E
    torch.testing.assert_close(lab.load_balancing_loss([logits], k), torch.tensor(float(k)))
    torch.testing.assert_close(load_balancing_loss_func((logits,), E, k), torch.tensor(float(k)))


def test_global_batch_loss_counts_over_all_micro_batches():
    """Two micro-batches from two 'domains', each sending every token to its own expert: each
    micro-batch alone is maximally unbalanced, the global batch is balanced."""
    E, k, N = 2, 1, 6
    domain_a = torch.tensor([[4.0, 0.0]]).repeat(N, 1)
    domain_b = torch.tensor([[0.0, 4.0]]).repeat(N, 1)
    micro = [[domain_a], [domain_b]]
    global_loss = lab.global_load_balancing_loss(micro, k)
    # oracle: transformers' loss on the global batch (the micro-batches concatenated)
    want = load_balancing_loss_func((torch.cat([domain_a, domain_b]),), E, k)
    torch.testing.assert_close(global_loss, want)
    # by hand: f = (1/2, 1/2), P = (1/2, 1/2) -> E * sum f P = 1; one micro-batch alone:
    # f = (1, 0), P = (p, 1 - p) with p = sigmoid(4) -> 2p
    torch.testing.assert_close(global_loss, torch.tensor(1.0))
    p = torch.sigmoid(torch.tensor(4.0))
    per_micro = torch.stack([lab.load_balancing_loss(m, k) for m in micro]).mean()
    torch.testing.assert_close(per_micro, 2 * p)


@pytest.mark.parametrize("layers", [1, 3])
def test_global_batch_loss_matches_transformers_on_the_concatenation(layers):
    E, k = 8, 2
    g = torch.Generator().manual_seed(layers)
    micro = [[torch.randn(n, E, generator=g) for _ in range(layers)] for n in (5, 9, 7)]
    joined = tuple(torch.cat([m[layer] for m in micro]) for layer in range(layers))
    torch.testing.assert_close(
        lab.global_load_balancing_loss(micro, k),
        load_balancing_loss_func(joined, E, k),
        atol=1e-6,
        rtol=1e-6,
    )


# --- the expert split -----------------------------------------------------------------------------


@pytest.mark.parametrize("E", [1, 2, 4, 8])
def test_split_mlp_with_every_expert_at_unit_weight_is_the_dense_mlp(E):
    from qwen_mini.mlp import MLP

    dense = MLP(H, 48)
    _randomize(dense, seed=E)
    experts = lab.split_mlp(dense, E)
    assert len(experts) == E
    assert experts[0].gate_proj.weight.shape == (48 // E, H)
    assert experts[0].down_proj.weight.shape == (H, 48 // E)
    x = _input(E).reshape(-1, H)
    ones = torch.ones(x.shape[0], E)
    every = torch.arange(E).expand(x.shape[0], E)
    with torch.no_grad():
        torch.testing.assert_close(
            moe.grouped_dispatch(x, ones, every, experts), dense(x), atol=1e-5, rtol=1e-5
        )


def test_split_mlp_rejects_an_uneven_split():
    from qwen_mini.mlp import MLP

    with pytest.raises(ValueError, match="not divisible"):
        lab.split_mlp(MLP(H, 48), 5)
