"""Which blocks each `model_type` is built from: the one table that tells the models apart.

Every Qwen decoder layer is the same two residual branches, `x + mixer(norm(x))` then
`x + mlp(norm(x))`; the models differ only in the blocks that fill them. Read the rows as diffs:
Qwen2 → Qwen3 drops the q/k/v bias and adds QK-Norm. Adding an architecture is a row here plus the
blocks its chapter exports; no `forward` anywhere asks which model it is running.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .attention import Attention, GatedAttention
from .config import Config
from .deltanet import GatedDeltaNet
from .mlp import MLP
from .moe import qwen3_moe_mlp
from .norms import RMSNorm, ZeroCentredRMSNorm

# the checkpoint's name for a layer's mixer, by the layer type config.json gives it
MIXER_ATTRIBUTE = {"full_attention": "self_attn", "linear_attention": "linear_attn"}


def dense_mlp(cfg: Config, layer_idx: int) -> nn.Module:
    """The SwiGLU feed-forward of chapter 0, the same in every layer."""
    return MLP(cfg.hidden_size, cfg.intermediate_size)


@dataclass(frozen=True)
class Architecture:
    mixers: dict[str, type[nn.Module]]  # layer type -> mixer class, built as (cfg, layer_idx)
    mlp: Callable[[Config, int], nn.Module]  # the feed-forward of layer i
    norm: type[nn.Module] = RMSNorm  # the decoder's RMSNorm (input, post-attention, final)
    qkv_bias: bool = False  # a bias on q/k/v always (Qwen2); else only if attention_bias
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE
    checkpoint_prefix: str = "model."  # where the text model's tensors sit in the checkpoint
    ignored_prefixes: tuple[str, ...] = ()  # tensors a text model does not load (vision, ...)


ARCHITECTURES: dict[str, Architecture] = {
    "qwen2": Architecture(mixers={"full_attention": Attention}, mlp=dense_mlp, qkv_bias=True),
    "qwen3": Architecture(mixers={"full_attention": Attention}, mlp=dense_mlp, qk_norm=True),
    # Qwen3 with a mixture of experts in the feed-forward of the layers config.json names
    "qwen3_moe": Architecture(
        mixers={"full_attention": Attention}, mlp=qwen3_moe_mlp, qk_norm=True
    ),
    # Qwen3.5 (chapter 5): 3 Gated DeltaNet layers to 1 gated attention layer, zero-centred
    # norms. qwen3_5 is the multimodal checkpoint (Qwen3_5ForConditionalGeneration), whose text
    # model sits under model.language_model.; qwen3_5_text is the text-only Qwen3_5ForCausalLM.
    "qwen3_5": Architecture(
        mixers={"full_attention": GatedAttention, "linear_attention": GatedDeltaNet},
        mlp=dense_mlp,
        norm=ZeroCentredRMSNorm,
        qk_norm=True,
        checkpoint_prefix="model.language_model.",
        ignored_prefixes=("model.visual.", "mtp."),  # the vision tower, multi-token prediction
    ),
    "qwen3_5_text": Architecture(
        mixers={"full_attention": GatedAttention, "linear_attention": GatedDeltaNet},
        mlp=dense_mlp,
        norm=ZeroCentredRMSNorm,
        qk_norm=True,
        ignored_prefixes=("mtp.",),
    ),
}
