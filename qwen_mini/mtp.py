# Generated from solutions/ch07_fast_decoding.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Multi-token prediction (MTP): the small head Qwen3-Next, Qwen3.5 and Qwen3.8 ship under `mtp.`
to guess the token after next, the draft of speculative decoding (qwen_mini.speculative).

One step, for position i (whose next token t_{i+1} is already known):

    e = pre_fc_norm_embedding(embed_tokens(t_{i+1}))     # the shared embedding
    h = pre_fc_norm_hidden(h_i)                          # the main model's last hidden state
    x = fc(cat([e, h]))                                  # [2H] -> [H], embedding first
    x = layers(x) at position i + 1                      # a full-attention decoder layer
    g = norm(x)   ->  lm_head(g) predicts t_{i+2}        # the shared head

h_i is the main model's hidden state *after* its final norm (what its head reads): vLLM's
Qwen3-Next and Qwen3.5 models return the normed state and hand that to the MTP drafter, and the
MTP's own output, which drafts the step after, is normed by `mtp.norm` too, so both inputs of a
chained step are alike. The layout comes from vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py (no
transformers model reads `mtp.*`).
"""

import torch
from torch import nn

from qwen_mini.cache import Cache
from qwen_mini.config import Config
from qwen_mini.rope_scaling import rotary_cos_sin


def mtp_layer(cfg: Config, i: int, arch) -> nn.Module:
    """MTP layer i: a full-attention decoder layer of the model's own kind (its attention, its
    feed-forward, its norms). It counts as layer num_hidden_layers + i, as vLLM numbers it: a
    MoE config then decides its feed-forward as for a layer past the last. Qwen3.8's main layers
    mix residual streams; what its MTP layer does is not known from a checkpoint here, so it is
    the plain pre-norm layer, with Qwen3.8's attention and experts."""
    idx = cfg.num_hidden_layers + i
    return arch.layer(
        arch.mixer_names["full_attention"],
        arch.mixers["full_attention"](cfg, idx, arch),
        arch.mlp(cfg, idx, arch),
        arch.norm(cfg.hidden_size, cfg.rms_norm_eps),  # input_layernorm
        arch.norm(cfg.hidden_size, cfg.rms_norm_eps),  # post_attention_layernorm
    )


class MTP(nn.Module):
    """What the checkpoint calls `mtp.`: two input norms, the projection `fc`, the decoder
    layers and the output norm. The embedding and the head are the main model's."""

    def __init__(self, cfg: Config, arch):
        super().__init__()
        H = cfg.hidden_size
        # the row's norm, as every other norm of the model: the MTP head was trained inside the
        # model with the model's norm, so Qwen3.5/Next's are zero-centred (x_hat * (1 + w))
        self.pre_fc_norm_embedding = arch.norm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = arch.norm(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(
            mtp_layer(cfg, i, arch) for i in range(cfg.mtp_num_hidden_layers)
        )
        self.norm = arch.norm(H, cfg.rms_norm_eps)
        self.config = cfg

    def new_cache(self, batch_size: int = 1) -> Cache:
        """The KV cache of the MTP layers (their own: they attend over MTP inputs)."""
        w = self.fc.weight
        return Cache(
            [layer.mixer.new_state(batch_size, w.dtype, w.device) for layer in self.layers],
            batch_size,
        )

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cache: Cache | None = None
    ) -> torch.Tensor:
        """embeds [B, T, H] (embeddings of t_{i+1}), hidden [B, T, H] (the main model's normed
        h_i) -> g [B, T, H], normed: the head's input for t_{i+2}. With a cache, these T steps
        follow the cached ones (committed once every layer has run)."""
        start = cache.length if cache is not None else 0
        e = self.pre_fc_norm_embedding(embeds)
        h = self.pre_fc_norm_hidden(hidden)
        x = self.fc(torch.cat([e, h], dim=-1))  # [B, T, 2H] -> [B, T, H]: embedding first
        # position i + 1: the position of the token whose embedding enters
        positions = torch.arange(start + 1, start + 1 + x.shape[1], device=x.device)
        cos, sin = rotary_cos_sin(self.config, positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.commit(x.shape[1])
        return self.norm(x)
