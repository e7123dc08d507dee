# Generated from solutions/ch05_deltanet.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Exercise helpers of chapter 5 (Gated DeltaNet): the decay a layer gives each token. Not used to
run a model.
"""

import torch


def log_decay(layer, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, hidden] -> g [B, T, H_v]: the log-decay a Gated DeltaNet `layer` gives each token
    of its input, from the layer's gates alone (b and a, with A_log and dt_bias)."""
    return layer.gates(*layer.project(x)[2:])[1]
