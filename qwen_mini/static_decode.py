"""Decoding with a preallocated cache and a fixed-shape step, compiled with torch.compile.

The eager loop (qwen_mini.decoding) launches every small kernel of every layer from Python and
its cache grows, so each step has new shapes. Here the step always has the same shapes: one
token in, at a position held in a tensor; each attention layer's keys and values sit in a buffer
of the full length (`StaticKVCache`, written in place at that position, read whole with a mask
of the positions written so far); each Gated DeltaNet state is copied into its buffer in place.
torch.compile then traces one graph for every step (on CUDA with CUDA graphs: mode
"reduce-overhead", the whole step replayed as one launch). `compile="max-autotune"` also freezes
the weights into the graph and tunes a kernel for each projection (`CPU_SETTINGS` below).
Nothing inside a step waits for the device (the eager pass checks its input ids and finiteness
there); between steps the chosen token is read once, to yield it and to test for a stop id.

The prompt runs through the eager model and its cache is copied into the buffers. Rows whose
pass is not `model_forward` (Qwen3.8's residual streams) or whose attention keeps more than
keys and values (its sparse attention) are refused: they have no fixed-shape step here.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .attention import KVCache, repeat_kv
from .decoder import model_forward
from .deltanet import DeltaNetState
from .rope_scaling import rotary_cos_sin


class StaticKVCache:
    """One attention layer's keys and values in buffers [B, H_kv, max_len, D], written in place
    at the position tensor `pos` [1]; `update` returns the whole buffers."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        self.k, self.v, self.pos = k, v, pos

    def update(self, k: torch.Tensor, v: torch.Tensor):
        self.k.index_copy_(2, self.pos, k)  # [B, H_kv, 1, D] into slot pos
        self.v.index_copy_(2, self.pos, v)
        return self.k, self.v


class StaticDeltaNetState:
    """A Gated DeltaNet layer's conv and recurrent states in buffers, updated in place."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent = conv, recurrent

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv.copy_(conv)
        self.recurrent.copy_(recurrent)


def masked_attend(module, q, k, v, cache: StaticKVCache) -> torch.Tensor:
    """The attention of one new query [B, H, 1, D] over the whole static buffer: the slots up to
    the current position are attended, the unwritten ones masked. (The eager `attend` takes its
    mask from the cache's length, a Python number: a new shape each step.)"""
    k, v = cache.update(k, v)  # [B, H_kv, max_len, D]
    mask = (torch.arange(k.shape[2], device=k.device) <= cache.pos)[None]  # [1, max_len]
    n_rep = module.n_heads // module.n_kv_heads
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class StaticDecoder(nn.Module):
    """The model's decode step over preallocated state buffers (registered as buffers, so a
    CUDA graph may write them in place). `forward(token [1, 1], pos [1]) -> logits [V]`."""

    def __init__(self, model, max_len: int):
        super().__init__()
        check_static(model)
        self.model, self.max_len = model, max_len
        w = model.model.embed_tokens.weight
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long, device=w.device))
        eager = model.new_cache(1)  # only for the shapes of each layer's state
        self.states = []
        for i, state in enumerate(eager.layers):
            if isinstance(state, KVCache):
                _, h, _, d = state.shape
                k = w.new_zeros(1, h, max_len, d)
                self.register_buffer(f"k{i}", k)
                self.register_buffer(f"v{i}", torch.zeros_like(k))
                self.states.append(StaticKVCache(k, getattr(self, f"v{i}"), self.pos))
            else:
                self.register_buffer(f"conv{i}", torch.zeros_like(state.conv))
                self.register_buffer(f"rec{i}", torch.zeros_like(state.recurrent))
                self.states.append(
                    StaticDeltaNetState(getattr(self, f"conv{i}"), getattr(self, f"rec{i}"))
                )

    def load(self, cache) -> None:
        """Copy an eager cache (after the prompt) into the buffers."""
        n = cache.length
        for static, state in zip(self.states, cache.layers, strict=True):
            if isinstance(static, StaticKVCache):
                static.k[:, :, :n] = state.k[:, :, :n]
                static.v[:, :, :n] = state.v[:, :, :n]
            else:
                static.conv.copy_(state.conv)
                static.recurrent.copy_(state.recurrent)

    def forward(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """token [1, 1] at position pos [1] -> logits [V]; the buffers take its state."""
        model, backbone = self.model, self.model.model
        self.pos.copy_(pos)
        x = backbone.embed_tokens(token)  # [1, 1, hidden]
        cos, sin = rotary_cos_sin(model.config, self.pos, x.dtype)  # [1, rotary_dim]
        for layer, state in zip(backbone.layers, self.states, strict=True):
            x = layer(x, cos, sin, state)
        return model.lm_head(backbone.norm(x))[0, -1]  # [V]


def check_static(model) -> None:
    """Refuse, by name, a model with no fixed-shape step here."""
    states = model.new_cache(1).layers
    plain = all(isinstance(s, (KVCache, DeltaNetState)) for s in states)
    exact = all(type(s) in (KVCache, DeltaNetState) for s in states)
    if model.arch.forward is not model_forward or not (plain and exact):
        raise ValueError(
            f"compile=True: a {model.config.model_type} model has no fixed-shape decode step "
            f"(its pass or its caches keep more than keys, values and DeltaNet states); "
            f"decode without compile."
        )


@contextmanager
def static_attention(model):
    """While decoding with static buffers, each attention layer attends through
    `masked_attend` (set on the instances, put back after)."""
    mixers = [layer.mixer for layer in model.model.layers if hasattr(layer.mixer, "attend")]
    for m in mixers:
        m.attend = lambda q, k, v, cache, m=m: masked_attend(m, q, k, v, cache)
    try:
        yield
    finally:
        for m in mixers:
            del m.attend


# The inductor settings of each `compile=` value on the CPU. True keeps the eager pass's
# rounding: inductor fuses the small operations between projections, and would otherwise round
# their bfloat16 results once at the end instead of after each one, so a token could change where
# two logits tie within rounding. "max-autotune" freezes the weights into the graph, repacks them
# once and times C++ kernels for every projection: on two CPU cores it decodes about twice as fast
# (bench/README.md), but its sums run in another order (in bfloat16 a near-tie can go the other
# way) and the repacked weights are a second copy in memory.
CPU_SETTINGS = {
    True: {"emulate_precision_casts": True},
    "max-autotune": {
        "freezing": True,
        "max_autotune": True,
        "max_autotune_gemm_backends": "CPP,ATEN",
    },
}


def own_class(decoder_class: type) -> type:
    """A subclass of `decoder_class` with a forward of its own: a copy of its code. torch.compile
    keeps what it compiled per code object: one shared by every decoder of a process would take
    a variant per model and per mode, may run one mode's graph for the other, and after 8
    variants (torch._dynamo's recompile_limit) runs the step eagerly without a word. A decoder
    compiling its own copy keeps its compiled step to itself, and frees it with itself."""
    f = decoder_class.forward
    code = f.__code__.replace()  # equal, not the same object
    forward = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return type(decoder_class.__name__, (decoder_class,), {"forward": forward})


def weights_version(model) -> tuple:
    """Which weights the model holds now: a frozen graph keeps the values it was compiled with."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def compiled_step(model, max_len: int, mode=True) -> StaticDecoder:
    """The model's StaticDecoder for `max_len` positions, its forward compiled (kept on the
    model and reused while max_len fits and the weights are the same: compiling takes seconds
    to minutes). `mode`: generate's `compile=` value, True or "max-autotune"."""
    # one per mode: alternating modes must not recompile
    kept = model.__dict__.setdefault("_static_decoders", {})
    version = weights_version(model)
    decoder = kept.get(mode)
    if decoder is not None and decoder.version == version and decoder.max_len >= max_len:
        return decoder
    decoder = own_class(StaticDecoder)(model, max_len)
    decoder.version = version
    # the module itself, not its forward: inductor freezes only a compiled module's weights
    if next(model.parameters()).device.type == "cuda":  # CUDA graphs: a step is one launch
        cuda_mode = "reduce-overhead" if mode is True else "max-autotune"
        compiled = torch.compile(decoder, mode=cuda_mode, dynamic=False)
        settings = {"emulate_precision_casts": mode is True}
    else:
        compiled = torch.compile(decoder, dynamic=False)
        settings = CPU_SETTINGS[mode]

    def step(token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # set around each call, not given as torch.compile(options=...): inductor reads
        # `freezing` outside those options (torch 2.13), and a recompile must see them too
        with torch._inductor.config.patch(settings):
            return compiled(token, pos)

    decoder.step = step
    # kept in the model's __dict__, out of its modules: a submodule would join its state_dict
    kept[mode] = decoder
    return decoder


def static_decode(
    model, prompt_ids: list[int], max_new_tokens: int, choose: Callable, stop=(), mode=True
) -> Iterator[int]:
    """`decode` (qwen_mini.decoding) with the prompt eager and every later step compiled."""
    device = next(model.parameters()).device
    n = len(prompt_ids)
    decoder = compiled_step(model, n + max_new_tokens, mode)
    cache = model.new_cache(1)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache, last_only=True)[0, -1]
    decoder.load(cache)
    token_in = torch.zeros(1, 1, dtype=torch.long, device=device)
    pos = torch.tensor([n], device=device)
    with static_attention(model):
        for i in range(max_new_tokens):
            token = choose(logits)
            yield token
            if token in stop or i == max_new_tokens - 1:
                return
            token_in.fill_(token)
            logits = decoder.step(token_in, pos).clone()  # a copy: the graph reuses its output
            pos += 1
