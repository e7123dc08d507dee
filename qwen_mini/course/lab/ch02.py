# Generated from solutions/ch02_qk_norm.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Experiments of the QK-Norm chapter: QKV bias (Qwen2.5) against QK-Norm (Qwen3), attention-
logit statistics, and a tiny Qwen3-shaped model trained on Python source, with and without
QK-Norm, to watch the logits grow. Not used to run a model.
"""

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.architectures import ARCHITECTURES, Architecture
from qwen_mini.attention import causal_mask, repeat_kv, split_heads
from qwen_mini.config import ASSETS, Config
from qwen_mini.model import CausalLM
from qwen_mini.rope import apply_rope


def bias_logit_terms(qx: torch.Tensor, kx: torch.Tensor, b_q: torch.Tensor, b_k: torch.Tensor):
    """The four terms of (W_q x_i + b_q)·(W_k x_j + b_k), unscaled, each [T_q, T_k].

    qx [T_q, D] holds W_q x_i for every query, kx [T_k, D] holds W_k x_j for every key; b_q, b_k
    [D]. Returns {"content", "query_bias", "key_bias", "bias_bias"}: the terms
    W_q x_i·W_k x_j, W_q x_i·b_k, b_q·W_k x_j and b_q·b_k, in that order.
    """
    T_q, T_k = qx.shape[0], kx.shape[0]
    return {
        "content": qx @ kx.T,  # depends on the query and on the key
        "query_bias": (qx @ b_k)[:, None].expand(
            T_q, T_k
        ),  # one value per query: same for all keys
        "key_bias": (kx @ b_q)[None, :].expand(T_q, T_k),  # one value per key: same for all queries
        "bias_bias": (b_q @ b_k).expand(T_q, T_k),  # one number
    }


def rope_bias_term(b_q: torch.Tensor, b_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The bias-bias term once RoPE has rotated both biases: [T, T], entry (i, j) is
    (b_q rotated to position i)·(b_k rotated to position j), unscaled. cos, sin [T, D]."""
    T = cos.shape[0]
    q = apply_rope(b_q.expand(T, -1), cos, sin)  # [T, D]: row i is b_q at position i
    k = apply_rope(b_k.expand(T, -1), cos, sin)  # [T, D]: row j is b_k at position j
    return q @ k.T


def capture_attention_inputs(model: CausalLM, store: dict) -> list:
    """Hooks that keep, for each layer, the (x, cos, sin) its attention is called with, in
    store[layer index]; remove them with `h.remove()`."""

    def keep(module, args):
        store[module.layer_idx] = args[:3]

    return [layer.self_attn.register_forward_pre_hook(keep) for layer in model.model.layers]


def project_qk(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The queries and keys an attention layer compares, as its forward computes them.

    x [B, T, hidden] -> q [B, H, T, D], k [B, H_kv, T, D]: projection (with its bias, if the
    layer has one), split into heads, per-head QK-Norm (if the layer has one), then RoPE.
    """
    q = split_heads(attn.q_proj(x), attn.n_heads)  # [B, H, T, D]; a Qwen2 bias is in q_proj
    k = split_heads(attn.k_proj(x), attn.n_kv_heads)  # [B, H_kv, T, D]
    if attn.q_norm is not None:  # over each head's D numbers, before the rotation
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def logit_stats(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q, k [B, H, T, D]: per head, the largest attention logit and the
    mean entropy of the attention rows in nats, two float32 tensors [H]."""
    T, D = q.shape[-2], q.shape[-1]
    logits = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(D)  # [B, H, T, T]
    logits = logits.masked_fill(~causal_mask(T, T, q.device), float("-inf"))
    p = logits.softmax(dim=-1)
    p_log_p = torch.where(p > 0, p * p.log(), torch.zeros_like(p))  # 0 log 0 = 0
    entropy = -p_log_p.sum(dim=-1)  # [B, H, T]
    return logits.amax(dim=(0, 2, 3)), entropy.mean(dim=(0, 2))


def tiny_config(hidden: int = 128, layers: int = 2, heads: int = 4) -> Config:
    """A Qwen3-shaped byte-level model: 256 token ids (one per byte), GQA with 2 query heads per
    KV head, head_dim 32, SwiGLU 3x wide, tied embedding."""
    return Config(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
    )


def tiny_arch(
    qk_norm: bool, qkv_bias: bool = False, row: Architecture | None = None
) -> Architecture:
    """Qwen3's row (or `row`) with QK-Norm on or off; with qkv_bias, a bias on q/k/v as Qwen2.5
    has."""
    return replace(row or ARCHITECTURES["qwen3"], qk_norm=qk_norm, qkv_bias=qkv_bias)


def tiny_model(cfg: Config, arch: Architecture, seed: int = 0) -> CausalLM:
    """The package's model built from `arch`, every matrix drawn from N(0, 0.02²) (as GPT-2),
    norms at 1, biases at 0."""
    model = CausalLM(cfg, arch)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for layer in model.model.layers:  # QKV biases (Qwen2 shape) start at zero
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.zero_()
    return model


def load_corpus() -> torch.Tensor:
    """The training text as byte ids [N]: Python source from CPython's standard library (PSF
    licence, see assets/data/README.md)."""
    raw = (ASSETS / "data" / "python_stdlib_sample.txt").read_bytes()
    return torch.tensor(list(raw), dtype=torch.long)


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless (inputs, targets) [batch, seq] pairs from random windows of `data`."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq + 1)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch, 1), generator=g)
        window = data[starts + offsets]  # [batch, seq + 1]
        yield window[:, :-1], window[:, 1:]


def head_stats(model: CausalLM, inputs: dict, n: int) -> tuple[list, list]:
    """Per layer and query head: the largest logit and mean attention entropy on the first n
    sequences of the batch whose attention inputs `inputs` holds (layer -> (x, cos, sin))."""
    max_logit, entropy = [], []
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            x, cos, sin = inputs[i]
            q, k = project_qk(layer.self_attn, x[:n], cos, sin)
            m, e = logit_stats(q, repeat_kv(k, q.shape[1] // k.shape[1]))
            max_logit.append(m.tolist())
            entropy.append(e.tolist())
    return max_logit, entropy


def train_tiny(
    qk_norm: bool,
    lr: float,
    steps: int = 300,
    batch: int = 16,
    seq: int = 128,
    seed: int = 0,
    every: int = 5,
    probe: torch.Tensor | None = None,
    n_stat: int = 4,
    qkv_bias: bool = False,
    arch: Architecture | None = None,
):
    """Train a tiny model with AdamW (β = 0.9, 0.95, constant rate, no warm-up, no clipping) and
    record the loss of every step and, every `every` steps, per layer and head the largest
    attention logit and the attention entropy (and the logits on `probe` ids [T], if given).
    arch: the row to build the model from (default: `tiny_arch(qk_norm, qkv_bias)`)."""
    model = tiny_model(tiny_config(), arch or tiny_arch(qk_norm, qkv_bias), seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    inputs = {}  # layer index -> (x, cos, sin) its attention received in the last forward pass
    hooks = capture_attention_inputs(model, inputs)
    rec = {"loss": [], "step": [], "max_logit": [], "entropy": [], "probe_logits": []}
    data = batches(load_corpus(), batch, seq, seed + 1)
    for step in range(steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rec["loss"].append(loss.item())
        if step % every == 0 or step == steps - 1:
            m, e = head_stats(model, inputs, n_stat)  # the batch this step trained on
            rec["step"].append(step)
            rec["max_logit"].append(m)
            rec["entropy"].append(e)
            if probe is not None:
                rec["probe_logits"].append(probe_logits(model, probe))
    for h in hooks:
        h.remove()
    return model, rec


def probe_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The causal attention logits of every layer and query head on ids [T]: [L, H, T, T]."""
    inputs = {}
    hooks = capture_attention_inputs(model, inputs)
    with torch.no_grad():
        model(ids[None])
        out = []
        for i, layer in enumerate(model.model.layers):
            q, k = project_qk(layer.self_attn, *inputs[i])
            k = repeat_kv(k, q.shape[1] // k.shape[1])
            logits = (q @ k.transpose(-2, -1))[0] / math.sqrt(q.shape[-1])  # [H, T, T]
            out.append(logits.masked_fill(~causal_mask(len(ids), len(ids)), float("-inf")))
    for h in hooks:
        h.remove()
    return torch.stack(out)


def distinct_weights(logits: torch.Tensor, dtype: torch.dtype) -> int:
    """How many different nonzero attention weights one row of logits [T] yields when the
    logits are stored in `dtype`, the softmax is taken in float32 and the weights are stored
    in `dtype` again."""
    w = logits.to(dtype).float().softmax(dim=-1).to(dtype)
    return int(torch.unique(w[w > 0]).numel())


def remove_qk_norm(state_dict: dict) -> dict:
    """A checkpoint's state dict with QK-Norm taken out: a new dict without any attention layer's
    `q_norm` / `k_norm` weight, every other entry as it was."""
    norms = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    return {name: w for name, w in state_dict.items() if not name.endswith(norms)}
