# Generated from solutions/ch01_attention.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Exercise helpers of the attention chapter: the KV cache's growth per token and the
conversion of a checkpoint's KV heads (MHA / GQA / MQA). Not used to run a model.
"""

import torch


def kv_bytes_per_token(cfg, dtype_bytes: int = 2) -> int:
    """Bytes the KV cache grows by when one more token is cached."""
    # every layer stores a key and a value vector of head_dim numbers for each KV head
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def regroup_kv_heads(w: torch.Tensor, head_dim: int, n_kv_new: int) -> torch.Tensor:
    """[n_kv * head_dim, ...] -> [n_kv_new * head_dim, ...]: repeat heads, or average them."""
    n_kv = w.shape[0] // head_dim
    if n_kv_new < 1 or max(n_kv, n_kv_new) % min(n_kv, n_kv_new):
        raise ValueError(
            f"cannot regroup {n_kv} KV heads into {n_kv_new}: one count must divide the other"
        )
    heads = w.reshape(n_kv, head_dim, *w.shape[1:])
    if n_kv_new >= n_kv:  # each head copied next to itself: query head h still finds h // n_rep
        heads = heads.repeat_interleave(n_kv_new // n_kv, dim=0)
    else:  # neighbours share queries in GQA, so neighbours are merged; average in float32
        group = heads.reshape(n_kv_new, n_kv // n_kv_new, head_dim, *w.shape[1:])
        heads = group.float().mean(dim=1).to(w.dtype)
    return heads.reshape(n_kv_new * head_dim, *w.shape[1:])
