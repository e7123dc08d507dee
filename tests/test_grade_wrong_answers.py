"""Every wrong answer of the corpora, graded through the real grader: the same verdict as in the
notebook (0 on that exercise), and nothing else in the notebook changes.

A check runs in the notebook next to the learner's code, and in the grader across a process
boundary (the learner's code in a sandbox). Whatever the check observes must look the same from
both: a tensor changed in place, a dict with keys deleted, a head not tied again, the memory a
call allocates, the dtype a softmax computes in. So every wrong answer the corpora hold is
graded here: the wrong answers are batched into a few notebooks per chapter (notebook k holds
the k-th wrong answer of every exercise), one grading run per chapter.

The corpus is a list of (exercise id, wrong answer, idea): a wrong answer is either an object (a
function or class defined at module level of some module, or reachable from one through its
lists, tuples and dicts, or made by a factory and reached through the catalogue: the notebook
runs that module's source, as a module of its own, and takes the object from it) or notebook
source that defines the exercise's name. `corpus()` reads the chapters' catalogues of mistakes
and EXTRA.
"""

from __future__ import annotations

import csv
import inspect
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from qwen_mini.course.checking import catalogue, get, run_checks
from qwen_mini.course.grading import cli as grade
from qwen_mini.course.grading.plan import load_reference

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# Wrong answers of the kinds the grader could not see before (what the code does to its input,
# how it runs), written as a learner would, as notebook source defining the exercise's name.
EXTRA = [
    (
        "ch05.GatedRMSNorm",
        """class GatedRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x, z):
        mean_square = (x * x).sum(-1, keepdim=True) / x.shape[-1]  # in x's dtype
        x_hat = x * torch.rsqrt(mean_square + self.eps)
        return x_hat * self.weight * F.silu(z)""",
        "computed in the input's dtype",
    ),
    (
        "ch03.load_balancing_loss",
        """def load_balancing_loss(router_logits, k):
    E = router_logits[0].shape[-1]
    counts, probs, n = torch.zeros(E), torch.zeros(E), 0
    for x in router_logits:
        p = torch.softmax(x, -1, dtype=torch.float32)
        counts += torch.bincount(p.topk(k, -1).indices.reshape(-1), minlength=E)
        probs, n = probs + p.sum(0), n + x.shape[0]
    return torch.tensor(E * ((counts / n) * (probs / n)).sum().item())  # a float made a tensor""",
        "no gradient reaches the router logits",
    ),
    (
        "ch05.apply_partial_rope",
        """def apply_partial_rope(x, cos, sin):
    from qwen_mini.rope import apply_rope

    r = cos.shape[-1]  # rotates the caller's tensor itself, then returns it
    x[..., :r] = apply_rope(x[..., :r].clone(), cos, sin)
    return x""",
        "changed its input in place",
    ),
    (
        "ch04.common_prefix_length",
        """def common_prefix_length(a, b):
    return sum(x == y for x, y in zip(a, b))  # equal positions, not the prefix""",
        "the PREFIX ends at the first difference",
    ),
    (
        "ch05.split_query_gate",
        """def split_query_gate(q_proj_out, n_heads):
    q, gate = q_proj_out.chunk(2, dim=-1)  # halves, not per head
    B, T, _ = q.shape
    return q.reshape(B, T, n_heads, -1), gate.reshape(B, T, n_heads, -1)""",
        "interleaves per head",
    ),
    (
        "ch00.rms_norm",
        """class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        if x.dtype == torch.float32:
            x *= torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # the caller's x
        else:
            x = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)""",
        "changed its input in place",
    ),
    (
        "ch00.rotate_half",
        """def rotate_half(x):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].clone(), x[..., d:].clone()
    x[..., :d], x[..., d:] = -x2, x1
    return x""",
        "in place",
    ),
    (
        "ch01.attention_weights",
        """def attention_weights(q, k, mask):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(q.dtype)  # softmax in q's dtype""",
        "softmax in float32",
    ),
    (
        "ch00.read_safetensors_header",
        """def read_safetensors_header(path):
    raw = Path(path).read_bytes()  # the whole file
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])""",
        "read only the 8-byte length",
    ),
    (
        "ch03.grouped_dispatch",
        """def grouped_dispatch(x, weights, experts_idx, experts):
    out = torch.zeros_like(x)
    N, k = experts_idx.shape
    for t in range(N):  # one call per token and slot, through forward (no hooks run)
        for s in range(k):
            e = int(experts_idx[t, s])
            out[t] += weights[t, s] * experts[e].forward(x[t : t + 1])[0]
    return out""",
        "called more than once",
    ),
    (
        "ch05.recurrent_step",
        """def recurrent_step(S, q, k, v, g, beta):
    S *= g.exp()[..., None, None]  # the caller's state, decayed in place
    predicted = (k[..., None, :] @ S).squeeze(-2)
    u = beta[..., None] * (v - predicted)
    S += k[..., :, None] * u[..., None, :]
    o = (q[..., None, :] @ S).squeeze(-2)
    return o, S""",
        "changed its input in place",
    ),
    (
        "ch05.causal_conv1d",
        """def causal_conv1d(x, weight, conv_state):
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    y = F.conv1d(full, weight, groups=x.shape[1])
    K1 = conv_state.shape[-1]
    conv_state.copy_(full[:, :, full.shape[-1] - K1 :])  # rolled in place: the caller's state
    return y, conv_state""",
        "changed its input in place",
    ),
    (
        "ch02.logit_stats",
        """def logit_stats(q, k):
    T, D = q.shape[-2], q.shape[-1]
    q = q.float() if q.dtype != torch.float32 else q
    q /= math.sqrt(D)  # the caller's q, scaled in place
    logits = q @ k.float().transpose(-2, -1)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    logits = logits.masked_fill(~mask, float("-inf"))
    p = logits.softmax(dim=-1)
    p_log_p = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    return logits.amax(dim=(0, 2, 3)), (-p_log_p.sum(dim=-1)).mean(dim=(0, 2))""",
        "changed its input in place",
    ),
    (
        "ch04.split_reasoning",
        """def split_reasoning(message):
    if message.get("reasoning_content") is not None:
        return message.pop("reasoning_content"), message["content"]  # deleted from the caller's
    content = message["content"]
    if "</think>" not in content:
        return "", content
    before, after = content.split("</think>")[0], content.split("</think>")[-1]
    return before.rstrip("\\n").split("<think>")[-1].lstrip("\\n"), after.lstrip("\\n")""",
        "changed its input in place",
    ),
]

# Wrong answers that are right on the CPU in float32 and wrong where the models run: a bfloat16
# input answered in float32, a tensor made without device=, an in-place update that breaks the
# backward pass, a list where a generator yields, modules kept in a plain list (variants.py).
BF16 = "a bfloat16 input must give a bfloat16 output"
DEVICE = "not on its input's device"


def _mask_without_device(cls: str) -> str:
    """An attention class whose causal mask is made on the CPU, wherever its queries are: the
    one mistake of a wrong answer shared by ch01.Attention and ch05.GatedAttention."""
    return f"""import qwen_mini.attention as _package  # not its names: those of other exercises


class {cls}(_package.{cls}):
    def attend(self, q, k, v, cache=None):
        T = q.shape[2]
        if cache is not None:
            k, v = cache.update(k, v)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = _package.repeat_kv(k, n_rep), _package.repeat_kv(v, n_rep)
        mask = _package.causal_mask(T, k.shape[2])  # no device: the CPU, wherever q is
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)"""


EXTRA += [
    (
        "ch01.causal_mask",
        """def causal_mask(t_new, t_total, device=None):
    q_pos = torch.arange(t_total - t_new, t_total)[:, None]  # no device=
    return torch.arange(t_total)[None, :] <= q_pos""",
        DEVICE,
    ),
    (
        "ch01.attention",
        """def attention(q, k, v, mask=None):
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v.float()  # float32 out of a bfloat16 input""",
        BF16,
    ),
    (
        "ch01.regroup_kv_heads",
        """def regroup_kv_heads(w, head_dim, n_kv_new):
    n_kv = w.shape[0] // head_dim
    if max(n_kv, n_kv_new) % min(n_kv, n_kv_new):
        raise ValueError(f"{n_kv} KV heads cannot be regrouped into {n_kv_new}")
    heads = w.reshape(n_kv, head_dim, *w.shape[1:])
    if n_kv_new >= n_kv:
        heads = heads.repeat_interleave(n_kv_new // n_kv, dim=0)
    else:  # the mean in float32, never cast back
        heads = heads.reshape(n_kv_new, n_kv // n_kv_new, head_dim, *w.shape[1:]).float().mean(1)
    return heads.reshape(n_kv_new * head_dim, *w.shape[1:])""",
        BF16,
    ),
    (
        "ch01.DecoderLayer",
        """class DecoderLayer(nn.Module):
    def __init__(self, mixer_name, mixer, mlp, input_layernorm, post_attention_layernorm):
        super().__init__()
        self.mixer_name, self.input_layernorm = mixer_name, input_layernorm
        self.add_module(mixer_name, mixer)
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp

    @property
    def mixer(self):
        return getattr(self, self.mixer_name)

    def forward(self, x, cos, sin, cache=None):
        h = x + self.mixer(self.input_layernorm(x), cos, sin, cache)
        h += self.mlp(self.post_attention_layernorm(h))  # h was saved for the backward pass
        return h""",
        "the backward pass through your decoder layer fails",
    ),
    (
        "ch01.decode",
        """def decode(model, prompt_ids, max_new_tokens, choose=None, stop=()):
    choose = choose or (lambda logits: int(logits.argmax()))
    device, out = next(model.parameters()).device, []
    cache = model.new_cache(batch_size=1)
    ids = torch.tensor([prompt_ids], device=device)
    for _ in range(max_new_tokens):
        out.append(choose(model(ids, cache=cache, last_only=True)[0, -1]))
        if out[-1] in stop:
            break
        ids = torch.tensor([[out[-1]]], device=device)
    return out  # a list: every token made before the caller sees one""",
        "must yield each item as it makes it",
    ),
    (
        "ch00.rope_cos_sin",
        """def rope_cos_sin(positions, head_dim, theta, dtype=torch.float32):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # no device=
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)""",
        DEVICE,
    ),
    (
        "ch02.rope_bias_term",
        """def rope_bias_term(b_q, b_k, cos, sin):
    T, D = cos.shape
    out = torch.zeros(T, T)  # no device=

    def rotated(b):
        b1, b2 = b.chunk(2, dim=-1)
        return b * cos + torch.cat([-b2, b1], dim=-1) * sin  # [T, D]

    q, k = rotated(b_q.expand(T, D)), rotated(b_k.expand(T, D))
    for i in range(T):
        out[i] = k @ q[i]
    return out""",
        DEVICE,
    ),
    (
        "ch01.model_forward",
        """from qwen_mini.rope_scaling import rotary_cos_sin


def model_forward(model, input_ids, cache=None, last_only=False):
    backbone = model.model
    start = cache.length if cache is not None else 0
    x = backbone.embed_tokens(input_ids)
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    cos, sin = rotary_cos_sin(model.config, positions)  # float32 for a bfloat16 model
    for i, layer in enumerate(backbone.layers):
        x = layer(x, cos, sin, cache.layers[i] if cache is not None else None)
    x = backbone.norm(x)
    return model.lm_head(x[:, -1:] if last_only else x)""",
        BF16,
    ),
    (
        "ch02.project_qk",
        """def project_qk(attn, x, cos, sin):
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, attn.n_heads, -1).transpose(1, 2).float()  # float32 from here
    k = attn.k_proj(x).view(B, T, attn.n_kv_heads, -1).transpose(1, 2).float()
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)

    def rope(t):
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos.float() + torch.cat([-t2, t1], dim=-1) * sin.float()

    return rope(q), rope(k)""",
        BF16,
    ),
    (
        "ch04.prefill",
        """def prefill(model, cache, cached, ids):
    reused = 0
    for a, b in zip(cached, ids):
        if a != b:
            break
        reused += 1
    reused = min(reused, len(ids) - 1)
    cache.truncate(reused)
    x = torch.tensor([ids[reused:]])  # no device=: the CPU, wherever the model is
    with torch.no_grad():
        logits = model(x, cache=cache, last_only=True)[0, -1]
    return logits.float(), reused""",
        DEVICE,
    ),
    (
        "ch06.select_blocks",
        """def select_blocks(scores, t_all, ratio, top_blocks):
    B, T, n = scores.shape
    keep = torch.zeros(B, T, t_all, dtype=torch.bool)  # no device=
    for i in range(T):
        t = t_all - T + i
        complete = (t + 1) // ratio
        k = min(top_blocks, complete)
        if k:
            top = scores[:, i, :complete].topk(k, dim=-1).indices  # [B, k]
            for j in range(ratio):
                keep[:, i].scatter_(-1, top * ratio + j, True)
        keep[:, i, complete * ratio : t + 1] = True
    return keep""",
        DEVICE,
    ),
    (
        "ch03.split_mlp",
        """from qwen_mini.mlp import MLP


def split_mlp(mlp, num_experts):
    H, I = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    if I % num_experts:
        raise ValueError(f"{I} neurons do not split into {num_experts} equal experts")
    width = I // num_experts
    experts = []  # a plain list
    for e in range(num_experts):
        expert, rows = MLP(H, width), slice(e * width, (e + 1) * width)
        with torch.no_grad():
            expert.gate_proj.weight.copy_(mlp.gate_proj.weight[rows])
            expert.up_proj.weight.copy_(mlp.up_proj.weight[rows])
            expert.down_proj.weight.copy_(mlp.down_proj.weight[:, rows])
        experts.append(expert.to(mlp.gate_proj.weight.dtype))
    return experts""",
        "came back as a plain Python list",
    ),
    (
        "ch03.split_mlp",
        """from qwen_mini.mlp import MLP


def split_mlp(mlp, num_experts):
    H, I = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    if I % num_experts:
        raise ValueError(f"{I} neurons do not split into {num_experts} equal experts")
    width = I // num_experts
    experts = nn.ModuleList(MLP(H, width) for _ in range(num_experts))  # float32 whatever mlp is
    with torch.no_grad():
        for e, expert in enumerate(experts):
            rows = slice(e * width, (e + 1) * width)
            expert.gate_proj.weight.copy_(mlp.gate_proj.weight[rows])
            expert.up_proj.weight.copy_(mlp.up_proj.weight[rows])
            expert.down_proj.weight.copy_(mlp.down_proj.weight[:, rows])
    return experts""",
        BF16,
    ),
    (
        "ch03.SparseMoeBlock",
        """from qwen_mini.mlp import MLP
from qwen_mini.moe import FusedExperts


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, norm_topk_prob=True,
                 fused=False):
        super().__init__()
        H, I, E = hidden_size, intermediate_size, num_experts
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = FusedExperts(E, H, I) if fused else [MLP(H, I) for _ in range(E)]

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat), -1, dtype=torch.float32)
        w, idx = probs.topk(self.top_k, -1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros_like(flat)
        for e in idx.unique().tolist():
            token, slot = (idx == e).nonzero(as_tuple=True)
            out.index_add_(0, token, self.experts[e](flat[token]) * w[token, slot, None])
        return out.view(x.shape)""",
        "parameters are not all registered",
    ),
    (
        "ch03.routing_statistics",
        """def routing_statistics(router_logits, k):
    probs = torch.softmax(router_logits, -1, dtype=torch.float32)
    E = probs.shape[-1]
    counts = torch.zeros(E)  # no device=
    counts.index_add_(0, probs.topk(k, -1).indices.reshape(-1), torch.ones(probs.shape[0] * k))
    return counts, probs.sum(0), probs.shape[0]""",
        DEVICE,
    ),
    (
        "ch00.apply_rope",
        """def apply_rope(x, cos, sin):
    x, cos, sin = x.float(), cos.float(), sin.float()  # float32 whatever the model runs in
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin""",
        BF16,
    ),
    (
        "ch05.decay_mask",
        """def decay_mask(g_cum):
    C = g_cum.shape[-1]
    diff = g_cum[..., :, None] - g_cum[..., None, :]
    future = torch.ones(C, C, dtype=torch.bool).triu(1)  # no device=
    return diff.masked_fill(future, float("-inf")).exp()""",
        DEVICE,
    ),
    (
        "ch05.solve_unit_lower",
        """def solve_unit_lower(A, rhs):
    eye = torch.eye(A.shape[-1], dtype=A.dtype)  # no device=
    return torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)""",
        DEVICE,
    ),
    (
        "ch05.pad_to_chunks",
        """def pad_to_chunks(x, chunk_size, dim):
    pad = -x.shape[dim] % chunk_size
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, torch.zeros(shape, dtype=x.dtype)], dim=dim)  # no device=""",
        DEVICE,
    ),
    (
        "ch05.deltanet_gates",
        """def deltanet_gates(b, a, A_log, dt_bias):
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a + dt_bias).float()  # softplus in the input's dtype
    return beta, g""",
        "softplus(a + dt_bias) must be computed in float32",
    ),
    (
        "ch05.ZeroCentredRMSNorm",
        """class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * (1 + self.weight)  # 1 + w in bfloat16""",
        "1 + w (like the whole norm) must be computed in float32",
    ),
]

EXTRA += [
    (
        "ch01.Attention",
        """import qwen_mini.attention as _package  # not its names: those of other exercises


class Attention(_package.Attention):
    def attend(self, q, k, v, cache=None):
        if cache is not None:
            k, v = cache.update(k, v)
        T, n_rep = q.shape[2], self.n_heads // self.n_kv_heads
        k, v = _package.repeat_kv(k, n_rep).float(), _package.repeat_kv(v, n_rep).float()
        scores = q.float() @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        mask = _package.causal_mask(T, k.shape[2], q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v  # float32 out of a bfloat16 layer""",
        BF16,
    ),
    ("ch01.Attention", _mask_without_device("Attention"), DEVICE),
    (
        "ch01.KVCache",
        """from qwen_mini.attention import KVCache as _KVCache


class KVCache(_KVCache):
    def __init__(self, batch_size, num_kv_heads, head_dim, dtype, device="cpu"):
        self.shape = (batch_size, num_kv_heads, 0, head_dim)
        self.k = torch.empty(self.shape, dtype=dtype)  # no device=: not where the model is
        self.v = torch.empty(self.shape, dtype=dtype)
        self.length = 0""",
        DEVICE,
    ),
    (
        "ch01.KVCache",
        """from qwen_mini.attention import KVCache as _KVCache


class KVCache(_KVCache):
    def __init__(self, batch_size, num_kv_heads, head_dim, dtype, device="cpu"):
        self.shape = (batch_size, num_kv_heads, 0, head_dim)
        self.k = torch.empty(self.shape, device=device)  # float32 whatever the model runs in
        self.v = torch.empty(self.shape, device=device)
        self.length = 0""",
        BF16,
    ),
]

EXTRA += [
    (
        "ch01.load_weights",
        """def load_weights(model, header, get_tensor, prefix="model."):
    params, sources = model.state_dict(), {}
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        sources[name] = prefix + name.removeprefix("model.") if name.startswith("model.") else name
    state = {  # cast to the empty model's dtype: float32, whatever the checkpoint holds
        name: get_tensor(key).to(params[name].dtype) for name, key in sources.items()
    }
    model.load_state_dict(state, assign=True, strict=False)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        sources["lm_head.weight"] = sources["model.embed_tokens.weight"]
    return sources""",
        BF16,
    ),
    (
        "ch02.remove_qk_norm",
        """def remove_qk_norm(state_dict):
    return {  # float32 copies of a bfloat16 checkpoint
        k: w.float() for k, w in state_dict.items() if "q_norm" not in k and "k_norm" not in k
    }""",
        BF16,
    ),
    (
        "ch05.recurrent_step",
        """def recurrent_step(S, q, k, v, g, beta):
    S = S * g.exp()[..., None, None]
    eye = torch.eye(k.shape[-1])  # no device=
    b = beta[..., None, None]
    S = (eye - b * k[..., :, None] * k[..., None, :]) @ S + b * k[..., :, None] * v[..., None, :]
    return (q[..., None, :] @ S).squeeze(-2), S""",
        DEVICE,
    ),
    (
        "ch05.chunk_loop",
        """def chunk_loop(U0, W, scores, q_decayed, k_to_end, chunk_decay, S):
    out = torch.zeros(U0.shape, dtype=U0.dtype)  # no device=
    for n in range(U0.shape[2]):
        U = U0[:, :, n] - W[:, :, n] @ S
        out[:, :, n] = q_decayed[:, :, n] @ S + scores[:, :, n] @ U
        S = chunk_decay[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ U
    return out, S""",
        DEVICE,
    ),
    (
        "ch05.conv_qkv",
        """def conv_qkv(qkv, weight, conv_state, n_k, d_k, n_v, d_v):
    B, T, C = qkv.shape
    K = weight.shape[-1]
    full = torch.zeros(B, C, K - 1 + T, dtype=qkv.dtype)  # no device=
    full[:, :, : K - 1], full[:, :, K - 1 :] = conv_state, qkv.transpose(1, 2)
    mixed = F.silu(F.conv1d(full, weight, groups=C)).transpose(1, 2)
    q, k, v = mixed.split([n_k * d_k, n_k * d_k, n_v * d_v], dim=-1)

    def unit(x):
        x = x.float()
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    q, k = unit(q.reshape(B, T, n_k, d_k)), unit(k.reshape(B, T, n_k, d_k))
    return q, k, v.reshape(B, T, n_v, d_v), full[:, :, full.shape[-1] - (K - 1) :]""",
        DEVICE,
    ),
    (
        "ch05.GatedDeltaNet",
        """from qwen_mini import deltanet as _package


class GatedDeltaNet(_package.GatedDeltaNet):
    def __init__(self, cfg, layer_idx=0, arch=None):
        super().__init__(cfg, layer_idx, arch)
        del self.A_log, self.dt_bias
        self.A_log = torch.zeros(self.n_v)  # plain tensors: invisible to state_dict and .to()
        self.dt_bias = torch.ones(self.n_v)""",
        "parameters are not all registered",
    ),
    (
        "ch05.GatedDeltaNet",
        """from qwen_mini import deltanet as _package


class GatedDeltaNet(_package.GatedDeltaNet):
    def forward(self, x, cos=None, sin=None, cache=None):
        B, T, _ = x.shape
        qkv, z, b, a = self.project(x)
        if cache is not None:
            conv_state, state = cache.conv, cache.recurrent
        else:  # no device=: the CPU, wherever x is
            conv_state = torch.zeros(B, self.conv_dim, self.kernel_size - 1, dtype=x.dtype)
            state = None
        heads = (self.n_k, self.d_k, self.n_v, self.d_v)
        q, k, v, new_conv = _package.conv_qkv(qkv, self.conv1d.weight, conv_state, *heads)
        beta, g = self.gates(b, a)
        decoding = cache is not None and T == 1
        rule = (_package.recurrent_gated_delta_rule if decoding
                else _package.chunk_gated_delta_rule)  # fmt: skip
        out, new_state = rule(q, k, v, g, beta, initial_state=state)
        if cache is not None:
            cache.update(new_conv, new_state)
        out = self.norm(out.to(x.dtype), z.reshape(B, T, self.n_v, self.d_v))
        return self.out_proj(out.reshape(B, T, -1))""",
        DEVICE,
    ),
    ("ch05.GatedAttention", _mask_without_device("GatedAttention"), DEVICE),
    (
        "ch05.GatedAttention",
        """from qwen_mini import attention as _package


class GatedAttention(_package.GatedAttention):
    def __init__(self, cfg, layer_idx, arch):
        super().__init__(cfg, layer_idx, arch)
        self.q_norm, self.k_norm = _Norm(self.head_dim), _Norm(self.head_dim)


class _Norm(nn.Module):  # zero-centred, its weight a plain tensor
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, torch.zeros(dim)

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1 + self.weight.float())).to(x.dtype)""",
        "parameters are not all registered",
    ),
]

# Wrong answers whose message once named an idea they do not have: a mistake's result agreed
# with theirs on one case by chance. (exercise id, notebook source, what the message must say,
# what it must not say.)
MESSAGES = [
    (
        "ch01.KVCache",
        """class KVCache:
    def __init__(self, batch_size, num_kv_heads, head_dim, dtype, device="cpu"):
        self.shape = (batch_size, num_kv_heads, 0, head_dim)
        self.k = torch.empty(self.shape, dtype=dtype, device=device)
        self.v = torch.empty(self.shape, dtype=dtype, device=device)
        self.length = 0

    def update(self, k, v):
        start, end = self.length, self.length + k.shape[2]
        if end > self.k.shape[2]:
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[:2] + (max(end, 2 * old.shape[2]),) + old.shape[3:])
                new[:, :, :start] = old[:, :, :start]
                setattr(self, name, new)
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        return k, v  # only the new keys and values

    def commit(self, n_tokens):
        self.length += n_tokens

    def discard(self):
        pass

    def nbytes(self):
        b, h, _, d = self.shape
        return 2 * b * h * self.length * d * self.k.element_size()""",
        "the cached ones, then the new",
        "update returned copies",
    ),
    (
        "ch01.load_weights",
        """def load_weights(model, header, get_tensor, prefix="model."):
    sources = {}
    for name in model.state_dict():  # the tied head too, under a name no checkpoint has
        sources[name] = prefix + name.removeprefix("model.")
    state = {name: get_tensor(key) for name, key in sources.items()}
    model.load_state_dict(state, assign=True)
    return sources""",
        "your code raised KeyError: 'model.lm_head.weight'",
        "expected a dict",
    ),
    (
        "ch01.attention_weights",
        """def attention_weights(q, k, mask=None):
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(q.dtype)""",
        "the scores q @ kᵀ were computed in float32",
        "softmax in float32: ask for",
    ),
    (
        "ch02.distinct_weights",
        """def distinct_weights(logits, dtype):
    w = torch.softmax(logits.to(dtype).float(), dim=-1).to(dtype)
    return int(torch.count_nonzero(w))""",
        "the nonzero weights were counted",
        "not rounded",
    ),
    (
        "ch03.SharedExpertMoeBlock",
        """from qwen_mini import moe  # not `SparseMoeBlock`: the name of another exercise
from qwen_mini.mlp import MLP


class SharedExpertMoeBlock(moe.SparseMoeBlock):
    def __init__(self, hidden, intermediate, n_experts, top_k, shared, norm_topk_prob=True,
                 fused=False):
        super().__init__(hidden, intermediate, n_experts, top_k, norm_topk_prob, fused)
        self.shared_expert = MLP(hidden, shared)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x):
        return super().forward(x)  # the shared expert never runs""",
        "the shared expert is missing",
        "raw gate logit",
    ),
    (
        "ch04.budgeted_tokens",
        """def budgeted_tokens(step, prompt_ids, *, budget, forced_ids, think_id, end_think_id,
                    stop_ids, max_new_tokens, thinking=False):
    reply, feed, spent, inside, done = [], list(prompt_ids), 0, False, False  # thinking unread
    while len(reply) < max_new_tokens:
        if inside and budget is not None and not done and (
            spent >= budget or max_new_tokens - len(reply) == len(forced_ids)
        ):
            if max_new_tokens - len(reply) < len(forced_ids):
                return
            yield from forced_ids
            reply += forced_ids
            feed, inside, done = feed + forced_ids, False, True
            continue
        token = step(feed)
        feed = [token]
        reply.append(token)
        yield token
        if token in stop_ids:
            return
        if token == think_id:
            inside = True
        elif token == end_think_id:
            inside = False
        elif inside:
            spent += 1""",
        "thinking=True means the prompt already opened <think>",
        "a budget of 0 is a budget",
    ),
    (
        "ch05.deltanet_gates",
        """def deltanet_gates(b, a, A_log, dt_bias):
    x = a.float() + dt_bias.float()
    return torch.sigmoid(b), -A_log.float().exp() * F.silu(x)  # silu, not softplus""",
        "g: expected",
        "relu",
    ),
]

# Sizes beyond the chapters' examples that the prose says are valid (or invalid), written as a
# learner would get them wrong.
SIZES = [
    (
        "ch01.regroup_kv_heads",
        """def regroup_kv_heads(w, head_dim, n_kv_new):
    n_kv = w.shape[0] // head_dim
    heads = w.view(n_kv, head_dim, *w.shape[1:])
    if n_kv_new > n_kv:
        heads = torch.repeat_interleave(heads, n_kv_new // n_kv, dim=0)
    elif n_kv_new < n_kv:
        heads = heads.view(n_kv_new, -1, head_dim, *w.shape[1:]).float().mean(1).to(w.dtype)
    return heads.reshape(-1, *w.shape[1:])  # 4 heads into 3: whatever view says""",
        "there is no such regrouping",
    ),
    (
        "ch06.select_blocks",
        """def select_blocks(scores, t_all, ratio, top_blocks):
    B, T, n = scores.shape
    keep = torch.zeros(B, T, t_all, dtype=torch.bool)
    for i in range(T):
        t = t_all - T + i
        complete = (t + 1) // ratio
        masked = scores[:, i].clone()
        masked[:, complete:] = float("-inf")
        top = masked.topk(top_blocks, dim=-1).indices  # more blocks than a short prompt has
        for b in range(B):
            for j in top[b].tolist():
                if j < complete:
                    keep[b, i, j * ratio : (j + 1) * ratio] = True
        keep[:, i, complete * ratio : t + 1] = True
    return keep""",
        "keep min(top_blocks, n)",
    ),
    (
        "ch03.split_mlp",
        """def split_mlp(mlp, num_experts):
    from qwen_mini.mlp import MLP

    H, I = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    width = I // num_experts  # 10 neurons into 4 experts: 2 are left out
    experts = nn.ModuleList()
    for e in range(num_experts):
        rows = slice(e * width, (e + 1) * width)
        expert = MLP(H, width)
        with torch.no_grad():
            expert.gate_proj.weight.copy_(mlp.gate_proj.weight[rows])
            expert.up_proj.weight.copy_(mlp.up_proj.weight[rows])
            expert.down_proj.weight.copy_(mlp.down_proj.weight[:, rows])
        experts.append(expert)
    return experts""",
        "not divisible by the number of experts",
    ),
    (
        "ch05.causal_conv1d",
        """def causal_conv1d(x, weight, conv_state):
    K = weight.shape[-1]
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    y = F.conv1d(full, weight, groups=x.shape[1])
    return y, full[:, :, -(K - 1):]  # K = 1: -0, every input""",
        "a kernel of 1 keeps no state",
    ),
]

EXTRA += [m[:3] for m in MESSAGES] + SIZES
ABSENT = {source: absent for _, source, _, absent in MESSAGES}  # what each message must not say

CHAPTER_IDS = ["ch00", "ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07"]


def corpus() -> list[tuple[str, object, str]]:
    """Every chapter's catalogued mistakes (qwen_mini/course/checks/chNN.py) and EXTRA, as
    (exercise id, wrong answer, idea)."""
    out = [(m.exercise_id, m.fn, m.idea) for ch in CHAPTER_IDS for m in catalogue(ch)]
    return out + EXTRA


# --- notebooks -----------------------------------------------------------------------------------


def _locate(module, obj, depth: int = 3) -> str | None:
    """An expression for `obj` in `module`'s namespace: a name, or a path through lists, tuples
    and dicts (`CASES[12][1]`)."""

    def search(value, path, depth):
        if value is obj:
            return path
        if depth == 0:
            return None
        items = (
            enumerate(value)
            if type(value) in (list, tuple)
            else value.items()
            if type(value) is dict
            else ()
        )
        for key, x in items:
            if isinstance(key, (int, str)):
                found = search(x, f"{path}[{key!r}]", depth - 1)
                if found:
                    return found
        return None

    for name, value in vars(module).items():
        if not name.startswith("__"):
            found = search(value, name, depth)
            if found:
                return found
    return None


def _module_cell(modules: dict[str, str]) -> str:
    """A cell that runs the corpus modules' source, each as a module of its own."""
    return (
        "import sys as _sys\nimport types as _types\n\n_corpus = {}\n"
        f"for _name, _source in {modules!r}.items():\n"
        # a name of its own: a check module run again must not replace the package's
        '    _m = _types.ModuleType("_corpus_" + _name.replace(".", "_"))\n'
        "    _sys.modules[_m.__name__] = _m\n"
        '    exec(compile(_source, _name + ".py", "exec"), _m.__dict__)\n'
        "    _corpus[_name] = _m\n"
    )


SETUP = """import json
import math
import struct
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.course import check"""


def _cell(cell_id: str, source: str) -> dict:
    return {"cell_type": "code", "id": cell_id, "metadata": {}, "outputs": [],
            "execution_count": None, "source": source}  # fmt: skip


def notebooks(cases, names: dict[str, str]) -> list[tuple[dict, list[tuple[str, object, str]]]]:
    """The cases of one chapter in a few notebooks: notebook k holds the k-th wrong answer of
    each exercise. [(notebook, its cases)]."""
    by_exercise = defaultdict(list)
    for case in cases:
        by_exercise[case[0]].append(case)
    rounds = max(len(v) for v in by_exercise.values())
    out = []
    for k in range(rounds):
        batch = [v[k] for v in by_exercise.values() if len(v) > k]
        modules, cells = {}, [_cell("setup", SETUP)]
        for i, (exercise, wrong, _) in enumerate(batch):
            name = names[exercise]
            if isinstance(wrong, str):
                source = wrong
            else:
                module = sys.modules[wrong.__module__]
                where = _locate(module, wrong)
                mistakes = get(exercise).mistakes
                key = next((k for k, m in mistakes.items() if m.fn is wrong), None)
                if where is None and key is not None:  # made by a factory: through the catalogue
                    # of the module run in the notebook (the sandbox cannot import the checks)
                    modules[module.__name__] = inspect.getsource(module)
                    source = (
                        "from qwen_mini.course.checking import get as _get\n"
                        f"{name} = _get({exercise!r}).mistakes[{key!r}].fn"
                    )
                else:
                    assert where, f"{exercise}: {wrong!r} is not reachable from {module.__name__}"
                    modules[module.__name__] = inspect.getsource(module)
                    source = f"{name} = _corpus[{module.__name__!r}].{where}"
            cells.append(_cell(f"wrong-{i}", f'{source}\n\ncheck("{exercise}", {name})'))
        if modules:
            cells.insert(1, _cell("corpus", _module_cell(modules)))
        nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
        out.append((nb, batch))
    return out


def _grade(folder: Path, chapter: int, files: list[Path]) -> dict[str, dict]:
    out = folder / "grades.csv"
    # a generous time limit: the verdicts are under test here, not the speed of a busy machine
    argv = ["--chapter", str(chapter), "--jobs", "2", "--timeout", "120", "--out", str(out)]
    assert grade.main(argv + ["--reports", str(folder / "reports")] + [str(f) for f in files]) == 0
    with open(out, newline="") as f:
        return {Path(r["notebook"]).stem: r for r in csv.DictReader(f)}


# Mistakes the grader would fail with the right points but name by the stage that differs, not
# by the idea: none. (The grader names a mistake by running the catalogued mistakes itself, and
# makes their observations of how code runs there, with the random stream the learner's code
# draws from in the sandbox: see checking._result and sandbox.Connection.request.)
NAMED_BY_STAGE: set[tuple[str, str]] = set()

CORPUS = corpus()
CHAPTERS = sorted({int(c[0][2:4]) for c in CORPUS})


def test_the_corpus_reaches_every_chapter_and_fails_in_the_notebook():
    assert CHAPTERS == [0, 1, 2, 3, 4, 5, 6, 7] and len(CORPUS) >= 200
    for exercise, wrong, idea in EXTRA:  # the notebook's verdict, which the grader must give
        namespace = {}
        exec(SETUP.replace("from qwen_mini.course import check", "") + "\n" + wrong, namespace)
        obj = namespace[re.search(r"^(?:def|class) (\w+)", wrong, re.M).group(1)]
        result = run_checks(exercise, obj, hidden=True)
        assert result.status == "failed" and idea in result.message, (exercise, result.message)
        assert ABSENT.get(wrong, "\0") not in result.message, (exercise, result.message)


# the ideas of the variants (variants.py): each wrong answer of theirs makes that one mistake, which
# the public checks (the learner's, in the notebook) catch too
VARIANT_IDEAS = (BF16, DEVICE, "must be float32", "parameters are not all registered",
                 "came back as a plain Python list", "must yield each item as it makes it",
                 "the backward pass through your")  # fmt: skip


def test_the_variants_wrong_answers_fail_the_public_checks():
    found = 0
    for exercise, wrong, idea in EXTRA:
        if idea not in VARIANT_IDEAS:
            continue
        namespace = {}
        exec(SETUP.replace("from qwen_mini.course import check", "") + "\n" + wrong, namespace)
        obj = namespace[re.search(r"^(?:def|class) (\w+)", wrong, re.M).group(1)]
        result = run_checks(exercise, obj)
        assert result.status == "failed" and idea in result.message, (exercise, result.message)
        found += 1
    assert found >= 25


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_wrong_answer_scores_zero_through_the_grader(tmp_path, chapter):
    prefix = f"ch{chapter:02d}"
    ref = load_reference(ROOT / "solutions", chapter)
    cases = [c for c in CORPUS if c[0].startswith(prefix + ".")]
    batches = notebooks(cases, ref.names)
    files = []
    for k, (nb, _) in enumerate(batches):
        files.append(tmp_path / f"batch{k}.ipynb")
        files[-1].write_text(json.dumps(nb))
    rows = _grade(tmp_path, chapter, files)
    problems = []
    for k, (_, batch) in enumerate(batches):
        row = rows[f"batch{k}"]
        report = json.loads((tmp_path / "reports" / f"batch{k}.json").read_text())
        wrong = {c[0] for c in batch}
        for exercise, answer, idea in batch:
            status, message = row[f"{exercise} status"], report["exercises"][exercise]["message"]
            what = f"batch{k} {exercise} {getattr(answer, '__name__', 'source')}"
            if float(row[exercise]) != 0 or status not in ("failed", "reference"):
                problems.append(f"{what}: {row[exercise]} points, {status}: {message}")
            elif (
                status == "failed"
                and "hidden check" not in message
                and idea.lower() not in message.lower()
                and (exercise, getattr(answer, "__name__", "source")) not in NAMED_BY_STAGE
            ):
                problems.append(f"{what}: the message does not name {idea!r}: {message}")
            elif isinstance(answer, str) and ABSENT.get(answer, "\0") in message:
                problems.append(f"{what}: the message names {ABSENT[answer]!r}: {message}")
        for exercise in ref.ids:  # nothing else in the notebook: missing, and 0
            if exercise not in wrong and row[f"{exercise} status"] != "missing":
                problems.append(f"batch{k} {exercise}: {row[f'{exercise} status']}")
        assert float(row["total"]) == 0, row
    assert not problems, "\n".join(problems)
