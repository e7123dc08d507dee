# Generated from solutions/ch00_foundations.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Exercise helpers of the foundations chapter: parameter counts from a config.json and the
zero-layer tied model. Not used to run a model.
"""

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mini.architectures import architecture, config_from_dict


def count_params(config: dict) -> dict:
    """Parameters of a dense Qwen2 / Qwen3 model, part by part, from its config.json as a dict.

    `total` counts the head even when it is tied to the embedding; `unique` counts it once.
    """
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n_q = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_q)
    d = config.get("head_dim") or h // n_q
    q_out, kv_out = n_q * d, n_kv * d

    row = architecture(config["model_type"])  # the table knows which blocks a model has
    qkv_bias, o_bias = row.attention_biases(config_from_dict(config))
    attention = h * q_out + 2 * h * kv_out + q_out * h  # q, k, v, o
    attention += (q_out + 2 * kv_out) * qkv_bias + h * o_bias  # their biases, where they exist
    attention += 2 * d * row.qk_norm  # QK-Norm: one RMSNorm weight per head_dim for q and k
    per_layer = attention + 3 * h * inter + 2 * h  # + SwiGLU + two RMSNorms

    counts = {
        "embed_tokens": vocab * h,
        "per_layer": per_layer,
        "layers": per_layer * config["num_hidden_layers"],
        "norm": h,
        "lm_head": vocab * h,
    }
    counts["total"] = counts["embed_tokens"] + counts["layers"] + h + counts["lm_head"]
    tied = config.get("tie_word_embeddings", False)
    counts["unique"] = counts["total"] - (counts["lm_head"] if tied else 0)
    return counts


class ZeroLayerLM(nn.Module):
    """A Qwen model without decoder layers: embedding -> final RMSNorm -> tied head."""

    def __init__(self, embed_tokens: nn.Embedding, norm: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.norm = norm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, vocab]
        x = self.norm(self.embed_tokens(input_ids))
        return F.linear(x, self.embed_tokens.weight)  # tied: the head is the embedding
