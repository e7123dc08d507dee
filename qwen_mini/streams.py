# Generated from solutions/ch06_family.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Gated residual streams (hyper-connections), as Qwen3.8-Flash-Next (qwen4_exp) uses them.

One residual stream carries `x + mixer(norm(x))` from layer to layer. Here `hc_count` streams run
side by side, all starting as the token's embedding. Before each sublayer (mixer, feed-forward) a
*read gate* mixes the streams, each normalised on its own, into the sublayer's one input:

    h_hat = norm(h_s) per stream s                       (zero-centred RMSNorm, one per stream)
    read  = sigmoid(W_up silu(W_down [h_hat_1 .. h_hat_n] / n))      [n * hidden], per channel
    x     = mean_s(read_s * h_hat_s)                                  the sublayer's input

and a *write gate* adds the sublayer's output y back to every stream with its own weight:

    h_s  <- h_s + 2 sigmoid(W_inj [h_hat_1 .. h_hat_n] / n)_s * y

The gates replace the input and post-attention norms of a plain layer. After the last layer one
more read (the `hyper_connection_mixer`, with no write) gives the head its input, in place of the
final norm. Shapes: streams h [B, T, n, hidden]; the gates' linear maps act on the n streams
flattened, [B, T, n * hidden], as the checkpoint stores them.
"""

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.config import Config
from qwen_mini.norms import ZeroCentredRMSNorm
from qwen_mini.rope_scaling import rotary_cos_sin


def read_gate(h_hat: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """The normalised streams h_hat [B, T, n, H] mixed into one sublayer input [B, T, H]:
    gate = sigmoid(w_up silu(w_down h_hat_flat / n)) per stream and channel, then the mean over
    the streams of gate * h_hat."""
    n = h_hat.shape[-2]
    low = F.silu(F.linear(h_hat.flatten(-2), w_down) / n)  # [B, T, r]: the streams, compressed
    gate = torch.sigmoid(F.linear(low, w_up)).view_as(h_hat)  # [B, T, n, H], each in 0..1
    return (gate * h_hat).mean(dim=-2)


def write_gate(
    h: torch.Tensor, h_hat: torch.Tensor, y: torch.Tensor, w_inject: torch.Tensor
) -> torch.Tensor:
    """The streams h [B, T, n, H] after adding y [B, T, H] to each with the weight
    2 sigmoid(w_inject h_hat_flat / n) of that stream (in 0..2)."""
    n = h.shape[-2]
    weight = 2 * torch.sigmoid(F.linear(h_hat.flatten(-2), w_inject) / n)  # [B, T, n]
    return h + weight[..., None] * y[..., None, :]  # [B, T, n, 1] * [B, T, 1, H]


class StreamNorm(ZeroCentredRMSNorm):
    """A zero-centred RMSNorm of each of `n_streams` vectors on its own, with one weight of
    n_streams * dim (the checkpoint's layout): x [..., n, dim] -> [..., n, dim]."""

    def __init__(self, n_streams: int, dim: int, eps: float = 1e-6):
        super().__init__(n_streams * dim, eps)
        self.n_streams = n_streams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float().view(self.n_streams, -1)  # [n, dim]
        return (self.normalize(x) * scale).to(x.dtype)  # normalize: over each stream's dim


class StreamReader(nn.Module):
    """The read gate: the streams h [B, T, n, H] mixed into one input [B, T, H]. On its own, the
    final mixer before the head (`model.hyper_connection_mixer`)."""

    def __init__(self, cfg: Config, arch=None):
        super().__init__()
        n, H = cfg.hc_count, cfg.hidden_size
        self.n_streams = n
        self.hc_norm = StreamNorm(n, H, cfg.rms_norm_eps)
        self.input_mix_weight_down = nn.Linear(n * H, cfg.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(cfg.hc_lowrank, n * H, bias=False)

    def read(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, T, n, H] -> (the sublayer's input [B, T, H], the normalised streams)."""
        h_hat = self.hc_norm(h)  # [B, T, n, H]
        w_down, w_up = self.input_mix_weight_down.weight, self.input_mix_weight_up.weight
        return read_gate(h_hat, w_down, w_up), h_hat

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, n, H] -> [B, T, H]
        return self.read(h)[0]


class GatedResidual(StreamReader):
    """Read gate and write gate around one sublayer (`attn_hyper_connection`,
    `mlp_hyper_connection`)."""

    def __init__(self, cfg: Config, arch=None):
        super().__init__(cfg, arch)
        n = self.n_streams
        self.block_inject_weight = nn.Linear(n * cfg.hidden_size, n, bias=False)  # per stream

    def write(self, h: torch.Tensor, h_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The streams h [B, T, n, H] after adding the sublayer's output y [B, T, H] to each,
        weighted per stream by 2 sigmoid(.) in (0, 2), from the normalised streams h_hat."""
        return write_gate(h, h_hat, y, self.block_inject_weight.weight)

    def forward(self, h: torch.Tensor, sublayer) -> torch.Tensor:
        """h [B, T, n, H] -> [B, T, n, H]: read, run `sublayer` ([B, T, H] -> [B, T, H]), write."""
        x, h_hat = self.read(h)
        return self.write(h, h_hat, sublayer(x))


class LayerStates:
    """The state of a layer that keeps two: its mixer's and its n-gram embedding's (`ple`).
    Commit, discard and truncate act on both, so the two never describe different tokens."""

    def __init__(self, mixer, ple):
        self.mixer, self.ple = mixer, ple

    @property
    def parts(self):
        return (self.mixer, self.ple)

    @property
    def length(self) -> int:
        return self.mixer.length

    @property
    def can_rewind(self) -> bool:
        return all(getattr(s, "can_rewind", True) for s in self.parts)

    def commit(self, n_tokens: int) -> None:
        for s in self.parts:
            s.commit(n_tokens)

    def discard(self) -> None:
        for s in self.parts:
            s.discard()

    def truncate(self, n: int) -> None:
        for s in self.parts:
            s.truncate(n)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.parts)


class HyperConnectedLayer(nn.Module):
    """A Qwen3.8-Flash-Next decoder layer: [n-gram embedding,] then the mixer and the
    feed-forward, each between a read and a write gate of the streams; no norms of its own.

    Registered under the checkpoint's names: the mixer under `mixer_name` (self_attn,
    linear_attn), `mlp`, `attn_hyper_connection`, `mlp_hyper_connection`, and `ple` where the
    layer has an n-gram embedding (None elsewhere).
    """

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, cfg: Config, ple=None):
        super().__init__()
        self.mixer_name = mixer_name
        self.ple = ple
        self.attn_hyper_connection = GatedResidual(cfg)
        self.add_module(mixer_name, mixer)
        self.mlp_hyper_connection = GatedResidual(cfg)
        self.mlp = mlp

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def new_state(self, batch_size: int, dtype: torch.dtype, device=None):
        state = self.mixer.new_state(batch_size, dtype, device)
        if self.ple is None:
            return state
        return LayerStates(state, self.ple.new_state(batch_size, dtype, device))

    def forward(self, h, cos, sin, cache=None, input_ids=None) -> torch.Tensor:
        """h [B, T, n, hidden] -> [B, T, n, hidden]; input_ids [B, T] feed the n-gram
        embedding; `cache` is this layer's state (LayerStates where there is an embedding)."""
        mixer_cache = cache
        if self.ple is not None:
            ple_cache = cache.ple if cache is not None else None
            mixer_cache = cache.mixer if cache is not None else None
            h = h + self.ple(h, input_ids, ple_cache)  # into every stream, before the mixer
        h = self.attn_hyper_connection(h, lambda x: self.mixer(x, cos, sin, mixer_cache))
        return self.mlp_hyper_connection(h, self.mlp)


def hyper_connected_layer(
    cfg: Config, layer_idx: int, arch, ple_layer: type[nn.Module]
) -> nn.Module:
    """Layer `layer_idx` of a qwen4_exp model: the row's mixer (by `layer_types`) and
    feed-forward, and an n-gram embedding (`ple_layer`, which the row names: it builds on
    StreamNorm, above) where `ple_layer_ids` lists the layer (1-indexed)."""
    layer_type = cfg.layer_types[layer_idx]
    ple = None
    if layer_idx + 1 in cfg.ple_layer_ids:  # its place in the list picks its hash and primes
        ple = ple_layer(cfg, cfg.ple_layer_ids.index(layer_idx + 1))
    return HyperConnectedLayer(
        arch.mixer_names[layer_type],
        arch.mixers[layer_type](cfg, layer_idx, arch),
        arch.mlp(cfg, layer_idx, arch),
        cfg,
        ple,
    )


def hyper_connected_forward(model, input_ids: torch.Tensor, cache=None, last_only: bool = False):
    """input_ids [B, T] -> logits [B, T, vocab] ([B, 1, vocab] with last_only): the embedding
    copied into every stream, the layers, the final mixer, the head."""
    cfg, backbone = model.config, model.model
    start = cache.length if cache is not None else 0
    x = backbone.embed_tokens(input_ids)  # [B, T, hidden]
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    cos, sin = rotary_cos_sin(cfg, positions, x.dtype)  # [T, rotary_dim]
    h = x[:, :, None, :].repeat(1, 1, cfg.hc_count, 1)  # [B, T, n, hidden]: n equal streams
    for i, layer in enumerate(backbone.layers):
        h = layer(h, cos, sin, cache.layers[i] if cache is not None else None, input_ids)
    if last_only:  # the mixer and the head on one position, not T
        h = h[:, -1:]
    return model.lm_head(backbone.hyper_connection_mixer(h))  # [B, T, vocab]


def streams_problems(t: dict) -> list[str]:
    """What the layers of a qwen4_exp model need of config.json's text fields `t` (with the
    row's defaults filled in): the streams, the n-gram embedding, the experts, the output gate."""
    from qwen_mini.validation import _is_int, _show, _size_problem

    problems = []
    layers, layer_types = t["num_hidden_layers"], t.get("layer_types")
    if layer_types is None:  # derived as the config derives it
        n = t.get("full_attention_interval", 4)
        layer_types = [
            "linear_attention" if (i + 1) % n else "full_attention" for i in range(layers)
        ]
    sizes = {"hc_count": 2, "hc_lowrank": 1, "num_experts": 1, "num_experts_per_tok": 1}
    sizes |= {"moe_intermediate_size": 1, "shared_expert_intermediate_size": 1}
    for name, smallest in sizes.items():
        if why := _size_problem(t.get(name), smallest):
            problems.append(f"{name} {why}")
    gate = t.get("output_gate_type") or t.get("hidden_act", "silu")
    if gate not in ("silu", "sigmoid"):
        problems.append(
            f'output_gate_type is {_show(gate)}; the DeltaNet output gate is "sigmoid" or "silu"'
        )
    if t.get("mamba_ssm_dtype", "float32") != "float32":
        problems.append(
            f"mamba_ssm_dtype is {_show(t['mamba_ssm_dtype'])}: qwen_mini keeps the DeltaNet "
            f'state in "float32" only'
        )
    ids = t.get("ple_layer_ids") or []
    if not (isinstance(ids, list) and all(_is_int(i) for i in ids)):
        return problems + ["ple_layer_ids must be a list of layer numbers (1-indexed)"]
    if ids:
        problems += _ple_problems(t, ids, layers, layer_types)
    return problems


def _ple_problems(t: dict, ids: list, layers: int, layer_types) -> list[str]:
    from qwen_mini.validation import _show, _size_problem

    problems = []
    names = {"ple_conv_kernel_size": 1, "ngram_size": 2, "heads_per_ngram": 1}
    names |= {"ngram_vocab_size_base": 2, "make_ngram_vocab_size_divisible_by": 1}
    names |= {"split_ngram_parts": 1}
    for name, smallest in names.items():
        if why := _size_problem(t.get(name), smallest):
            problems.append(f"{name} {why} (the n-gram embedding)")
    embed = t.get("ple_embed_dim") or t["hidden_size"]
    if why := _size_problem(embed, 1):
        problems.append(f"ple_embed_dim {why}")
    if not isinstance(t.get("seed"), int) or isinstance(t.get("seed"), bool):
        problems.append(f"seed must be a whole number, got {_show(t.get('seed'))}")
    if problems:
        return problems
    heads = (t["ngram_size"] - 1) * t["heads_per_ngram"]
    if embed % heads:
        problems.append(
            f"ple_embed_dim = {embed} must be a multiple of (ngram_size - 1) * heads_per_ngram "
            f"= {heads}: each hash head gets an equal share of the embedding"
        )
    outside = [i for i in ids if not 1 <= i <= layers]
    if outside:
        problems.append(f"ple_layer_ids {outside} are not layers 1 to {layers} (1-indexed)")
    elif layer_types is not None and len(layer_types) == layers:
        wrong = [i for i in ids if layer_types[i - 1] != "linear_attention"]
        if wrong:
            problems.append(
                f"ple_layer_ids {wrong} are not linear_attention layers: the n-gram embedding "
                f"sits only in those"
            )
    if t.get("eos_token_id") in (None, []):
        problems.append(
            "eos_token_id must be set: the n-gram embedding restarts its n-grams after it"
        )
    return problems


hyper_connected_layer.config_problems = streams_problems
