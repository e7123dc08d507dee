"""Which blocks each `model_type` is built from: the one table that tells the models apart.

Every Qwen decoder layer is the same two residual branches, `x + mixer(norm(x))` then
`x + mlp(norm(x))`; the models differ only in the blocks that fill them and in a few flags. Read
the rows as diffs: Qwen2 -> Qwen3 drops the q/k/v bias and adds QK-Norm. Adding an architecture
is a row here plus the blocks it names; no `forward` anywhere asks which model it is running, and
nothing outside this file tests a model's name or `model_type`.

A block is built as `block(cfg, layer_idx, arch)`: the config gives the numbers, the row the
flags. To build a model from other blocks, replace them in a row and pass it to the model:

    row = dataclasses.replace(ARCHITECTURES["qwen3"], mixers={"full_attention": MyAttention})
    model = CausalLM(cfg, arch=row)        # or load_model(name, arch=row) for real weights
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from torch import nn

from .attention import Attention, GatedAttention, QKVBiasAttention
from .config import Config
from .decoder import DecoderLayer, model_forward
from .deltanet import GatedDeltaNet
from .deltanet_gate import output_gated_deltanet
from .families import QWEN3, QWEN3_5, Family
from .fused_deltanet import FusedGatedDeltaNet
from .mlp import MLP
from .moe import SharedExpertMoeBlock, qwen3_moe_mlp
from .ngram_embedding import PLELayer
from .norms import RMSNorm, ZeroCentredRMSNorm
from .sparse_attention import IndexedAttention
from .streams import StreamReader, hyper_connected_forward, hyper_connected_layer
from .validation import check_config_json, json_type, read_json

Block = Callable[[Config, int, "Architecture"], nn.Module]  # built as block(cfg, layer_idx, arch)


def dense_mlp(cfg: Config, layer_idx: int, arch: Architecture) -> nn.Module:
    """The SwiGLU feed-forward, the same in every layer."""
    return MLP(cfg.hidden_size, cfg.intermediate_size)


def shared_expert_moe_mlp(
    cfg: Config,
    layer_idx: int,
    arch: Architecture,
    fused: bool = False,
    block: type[nn.Module] = SharedExpertMoeBlock,
) -> nn.Module:
    """Routed experts plus one gated shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE) in the
    sparse layers (num_experts, decoder_sparse_step, mlp_only_layers), the dense SwiGLU in the
    others. The experts are held one by one, or `fused` in two 3-D tensors; the loader reads
    either layout into either. `block`: the class of the sparse layers' block."""
    if not cfg.is_sparse_layer(layer_idx):
        return dense_mlp(cfg, layer_idx, arch)
    return block(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.shared_expert_intermediate_size,
        cfg.norm_topk_prob,
        fused,
    )


# 512 experts in each of 48 to 60 layers: held fused, two parameters a layer rather than 1,536
# modules, a meta model of a real config builds in a second rather than minutes. A checkpoint
# that stores them one by one (the Qwen3-Next release, what transformers writes) is stacked into
# them as it loads: a copy, where the fused Qwen3.5-MoE files are memory-mapped as they are
fused_shared_expert_moe_mlp = partial(shared_expert_moe_mlp, fused=True)


def token_embedding(cfg: Config, arch: Architecture) -> nn.Module:
    """One learned vector per token id: what the checkpoint calls embed_tokens."""
    return nn.Embedding(cfg.vocab_size, cfg.hidden_size)


def pre_norm_layer(cfg: Config, layer_idx: int, arch: Architecture) -> nn.Module:
    """Layer `layer_idx` as `arch.layer` holds it: its mixer, feed-forward and two norms are the
    row's blocks; the config's `layer_types` picks the mixer."""
    layer_type = cfg.layer_types[layer_idx]
    return arch.layer(
        arch.mixer_names[layer_type],  # the checkpoint's name for it: self_attn, linear_attn
        arch.mixers[layer_type](cfg, layer_idx, arch),
        arch.mlp(cfg, layer_idx, arch),
        arch.norm(cfg.hidden_size, cfg.rms_norm_eps),  # input_layernorm
        arch.norm(cfg.hidden_size, cfg.rms_norm_eps),  # post_attention_layernorm
    )


def final_norm(cfg: Config, arch: Architecture) -> nn.Module:
    """The norm between the last layer and the head (the checkpoint's model.norm)."""
    return arch.norm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass(frozen=True)
class Architecture:
    """One row: the blocks of a model type and every fact that differs between model types."""

    mixers: Mapping[str, Block]  # layer type (config.json's layer_types) -> the mixer block
    mlp: Block  # the feed-forward of layer i
    norm: Callable[[int, float], nn.Module] = RMSNorm  # decoder norms and q/k norms: (dim, eps)
    layer: type[nn.Module] = DecoderLayer  # the residual block holding mixer, mlp and norms
    decoder_layer: Block = pre_norm_layer  # builds layer i (by default an `arch.layer`)
    # what the last layer's output passes through before the head, and its checkpoint name
    final: Callable[[Config, Architecture], nn.Module] = final_norm
    final_name: str = "norm"
    embedding: Callable[[Config, Architecture], nn.Module] = token_embedding  # (cfg, arch)
    forward: Callable = model_forward  # the pass: embedding -> layers -> final norm -> head
    family: Family = QWEN3  # tokenizer, chat template and sampling presets
    # True: a bias on q/k/v always, none on o_proj (Qwen2); "qkv_bias": the same, switched by
    # config.json's qkv_bias (Qwen2-MoE); False: attention_bias decides
    qkv_bias: bool | str = False
    qk_norm: bool = False  # a norm on each query and key head before RoPE
    checkpoint_prefix: str = "model."  # where the text model's tensors sit in the checkpoint
    ignored_prefixes: tuple[str, ...] = ()  # tensors a text model does not load (vision, ...)
    # the checkpoint's name for each layer type's mixer
    mixer_names: Mapping[str, str] = field(
        default_factory=lambda: {"full_attention": "self_attn", "linear_attention": "linear_attn"}
    )
    # which layers transformers windows when config.json sets use_sliding_window (refused:
    # qwen_mini has no sliding-window attention): "from_max_window_layers", "all",
    # "alternate_below_max_window_layers" or "none"
    sliding_window_layers: str = "from_max_window_layers"
    # config.json fields this model type defaults differently from Config's defaults
    config_defaults: Mapping[str, object] = field(default_factory=dict)
    # config.json fields this model type does not read: the one value it builds with; a file
    # that says otherwise is refused (transformers would ignore the field)
    fixed_fields: Mapping[str, object] = field(default_factory=dict)
    # config fields that must be set (> 0) whatever the layer types (experts in every layer)
    required_fields: tuple[str, ...] = ()

    def attention_biases(self, cfg: Config) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj) of the attention layers."""
        if self.qkv_bias == "qkv_bias":
            return cfg.qkv_bias, False
        if self.qkv_bias:
            return True, False  # Qwen2's, whatever attention_bias says
        return cfg.attention_bias, cfg.attention_bias

    def with_blocks(self, **blocks) -> Architecture:
        """This row with some blocks replaced: `mixers={"full_attention": MyAttention}`,
        `mlp=...`, `norm=...`; mixers not named keep the row's."""
        if "mixers" in blocks:
            blocks["mixers"] = {**self.mixers, **blocks["mixers"]}
        known = {"mixers", "mlp", "norm", "layer", "decoder_layer", "final", "embedding", "forward"}
        unknown = sorted(set(blocks) - known)
        if unknown:
            raise TypeError(f"with_blocks: {unknown} are not blocks of an architecture row")
        return replace(self, **blocks)


QWEN3_5_ROW = dict(
    mixers={"full_attention": GatedAttention, "linear_attention": GatedDeltaNet},
    mlp=dense_mlp,
    norm=ZeroCentredRMSNorm,
    family=QWEN3_5,
    qk_norm=True,
    # as transformers' Qwen3_5TextConfig: RoPE on a quarter of each head, layer_types (when the
    # file has none) 3 linear : 1 full
    config_defaults={"partial_rotary_factor": 0.25, "full_attention_interval": 4},
    sliding_window_layers="none",  # transformers' Qwen3.5 has no sliding window
)
# Qwen3.5-MoE: the shared-expert mixture of experts in every layer (so no intermediate_size),
# its router always renormalised; the sizes transformers' Qwen3_5MoeTextConfig defaults to
QWEN3_5_MOE_ROW = dict(
    QWEN3_5_ROW,
    mlp=fused_shared_expert_moe_mlp,
    config_defaults={
        **QWEN3_5_ROW["config_defaults"],
        "intermediate_size": 0,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
    fixed_fields={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    required_fields=("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
)

# Qwen3.8-Flash-Next: Qwen3.5-MoE with Qwen Sparse Attention in the attention layers (the release
# writes them "full_attention", transformers "indexed_attention": both are read), a sigmoid
# DeltaNet output gate, gated residual streams in place of the decoder norms and an n-gram
# embedding on the layers ple_layer_ids lists (qwen_mini/streams.py, ngram_embedding.py).
QWEN4_EXP_ROW = dict(
    mixers={
        "full_attention": IndexedAttention,
        "indexed_attention": IndexedAttention,
        "linear_attention": output_gated_deltanet,
    },
    mixer_names={
        "full_attention": "self_attn",
        "indexed_attention": "self_attn",
        "linear_attention": "linear_attn",
    },
    mlp=fused_shared_expert_moe_mlp,  # every layer; held fused, as the release stores them
    norm=ZeroCentredRMSNorm,
    decoder_layer=partial(hyper_connected_layer, ple_layer=PLELayer),
    final=StreamReader,  # the read gate alone: the streams mixed into the head's input
    final_name="hyper_connection_mixer",
    forward=hyper_connected_forward,
    family=QWEN3_5,
    qk_norm=True,
    sliding_window_layers="none",
    config_defaults={  # as transformers' Qwen4ExpTextConfig
        "intermediate_size": 0,  # no dense feed-forward anywhere
        "full_attention_interval": 4,  # layer_types, when the file has none: 3 linear : 1
        "head_dim": 256,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "hc_count": 4,
        "hc_lowrank": 320,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": 20_000_000,
        "make_ngram_vocab_size_divisible_by": 128,
        "seed": 1234,
        "split_ngram_parts": 512,
    },
    # transformers' Qwen4-Exp reads neither (experts in every layer); its router reads
    # norm_topk_prob, unlike Qwen3.5-MoE's
    fixed_fields={"decoder_sparse_step": 1, "mlp_only_layers": []},
    required_fields=("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
)

# transformers' RoPE of Qwen2, Qwen3 and their MoE variants turns every dimension of a head: it
# reads no partial_rotary_factor (a file that gives one is refused rather than ignored)
FULL_ROPE = {"partial_rotary_factor": 1.0}

ARCHITECTURES: dict[str, Architecture] = {
    # Qwen2 / Qwen2.5: its attention has a bias on q/k/v, none on o_proj, and no QK-Norm
    "qwen2": Architecture(
        mixers={"full_attention": QKVBiasAttention},
        mlp=dense_mlp,
        qkv_bias=True,
        fixed_fields=FULL_ROPE,
    ),
    "qwen3": Architecture(
        mixers={"full_attention": Attention}, mlp=dense_mlp, qk_norm=True, fixed_fields=FULL_ROPE
    ),
    # Qwen3 with a mixture of experts in the feed-forward of the layers config.json names
    "qwen3_moe": Architecture(
        mixers={"full_attention": Attention},
        mlp=qwen3_moe_mlp,
        qk_norm=True,
        sliding_window_layers="all",  # transformers windows every layer of a Qwen3-MoE
        fixed_fields=FULL_ROPE,
    ),
    # Qwen3.5: 3 Gated DeltaNet layers to 1 gated attention layer, zero-centred norms. qwen3_5 is
    # the multimodal checkpoint (Qwen3_5ForConditionalGeneration), whose text model sits under
    # model.language_model.; qwen3_5_text is the text-only Qwen3_5ForCausalLM.
    "qwen3_5": Architecture(
        **QWEN3_5_ROW,
        checkpoint_prefix="model.language_model.",
        ignored_prefixes=("model.visual.", "mtp."),  # the vision tower, multi-token prediction
    ),
    "qwen3_5_text": Architecture(**QWEN3_5_ROW, ignored_prefixes=("mtp.",)),
    # Qwen1.5-MoE / Qwen2-MoE: Qwen2 attention (q/k/v bias by its qkv_bias field), routed
    # experts plus a gated shared expert, the router not renormalised unless norm_topk_prob
    "qwen2_moe": Architecture(
        mixers={"full_attention": Attention},
        mlp=shared_expert_moe_mlp,
        qkv_bias="qkv_bias",
        sliding_window_layers="alternate_below_max_window_layers",
        # transformers' Qwen2MoeConfig defaults (Qwen1.5-MoE-A2.7B's sizes)
        config_defaults=dict(
            norm_topk_prob=False,
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
        ),
        fixed_fields=FULL_ROPE,
    ),
    # Qwen3.5-MoE, multimodal (under model.language_model.) and text-only, as qwen3_5 above
    "qwen3_5_moe": Architecture(
        **QWEN3_5_MOE_ROW,
        checkpoint_prefix="model.language_model.",
        ignored_prefixes=("model.visual.", "mtp."),
    ),
    "qwen3_5_moe_text": Architecture(**QWEN3_5_MOE_ROW, ignored_prefixes=("mtp.",)),
    # Qwen3-Next: the Qwen3.5 hybrid (gated attention, zero-centred norms, plain 1-D partial
    # RoPE) before Qwen3.5: Gated DeltaNet with fused input projections, the shared-expert MoE
    # in the sparse layers, Qwen3's tokenizer
    "qwen3_next": Architecture(
        **dict(
            QWEN3_5_ROW,
            mixers={"full_attention": GatedAttention, "linear_attention": FusedGatedDeltaNet},
            mlp=fused_shared_expert_moe_mlp,
            family=QWEN3,
            # transformers' Qwen3NextConfig defaults (Qwen3-Next-80B-A3B's sizes)
            config_defaults={
                **QWEN3_5_ROW["config_defaults"],
                "norm_topk_prob": True,
                "num_experts": 512,
                "num_experts_per_tok": 10,
                "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512,
                "linear_num_key_heads": 16,
                "linear_num_value_heads": 32,
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_conv_kernel_dim": 4,
            },
        ),
        ignored_prefixes=("mtp.",),
    ),
    "qwen4_exp": Architecture(
        **QWEN4_EXP_ROW,
        checkpoint_prefix="model.language_model.",
        ignored_prefixes=("model.visual.", "mtp."),
    ),
    "qwen4_exp_text": Architecture(**QWEN4_EXP_ROW, ignored_prefixes=("mtp.",)),
}


def architecture(model_type: object, source: str = "config.json") -> Architecture:
    """The row of `model_type`; a clear error naming `source` for one the table lacks."""
    if model_type is None:
        raise ValueError(
            f'{source}: model_type is missing; it names the architecture (such as "qwen3"). '
            f"Use the config.json that came with the weights."
        )
    if not isinstance(model_type, str):  # a list or an object cannot even be looked up
        raise ValueError(
            f"{source}: model_type must be a string naming the architecture, such as "
            f'"qwen3", got {json_type(model_type)} {model_type!r}; use the config.json that '
            f"came with the weights."
        )
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported by qwen_mini; "
            f"supported model types: {', '.join(ARCHITECTURES)}."
        )
    return ARCHITECTURES[model_type]


def check_config(cfg: Config, arch: Architecture, source: str = "config.json") -> None:
    """The one place a config is checked against the row that builds it (the model and the
    loader both call it): every layer type must be one of the row's mixers, one per layer."""
    unknown = sorted(set(cfg.layer_types) - set(arch.mixers))
    if unknown or len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ValueError(
            f"{source}: layer_types must name one mixer per layer ({cfg.num_hidden_layers} "
            f"layers) out of {', '.join(arch.mixers)} for a {cfg.model_type} model; it has "
            f"{len(cfg.layer_types)} entries" + (f" and {unknown}." if unknown else ".")
        )
    unset = [name for name in arch.required_fields if not getattr(cfg, name)]
    if unset:
        raise ValueError(
            f"{source}: a {cfg.model_type} model has a mixture of experts in every layer; it "
            f"needs {', '.join(unset)}, which {'is' if len(unset) == 1 else 'are'} missing or 0."
        )
    for layer_type in dict.fromkeys(cfg.layer_types):  # each block type once
        needed = getattr(arch.mixers[layer_type], "config_fields", ())
        unset = [name for name in needed if not getattr(cfg, name)]
        if unset:
            raise ValueError(
                f"{source}: {layer_type} layers ({arch.mixers[layer_type].__name__}) need "
                f"{', '.join(unset)}, which {'is' if len(unset) == 1 else 'are'} missing or 0."
            )


def config_from_dict(
    d: dict, source: str = "config.json", arch: Architecture | None = None
) -> Config:
    """The config of a config.json `d`: the per-type defaults of its row (or of `arch`, a row
    with other blocks), checked against that row."""
    check_config_json(d, source, ARCHITECTURES)  # every bad value at once, before any is read
    arch = arch if arch is not None else architecture(d.get("model_type"), source)
    cfg = Config.from_dict(d, source, {**arch.config_defaults, **arch.fixed_fields})
    check_config(cfg, arch, source)
    return cfg


def config_from_file(path: str | Path, arch: Architecture | None = None) -> Config:
    path = Path(path)
    return config_from_dict(read_json(path), str(path), arch)
