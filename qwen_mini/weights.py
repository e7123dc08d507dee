# Generated from solutions/ch01_attention.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Filling a model's parameters from a checkpoint by the checkpoint's names.
`qwen_mini.checkpoint` adds the checks around it: headers, shapes, dtypes, memory.
"""

from collections.abc import Callable, Mapping

import torch
from torch import nn


def checkpoint_key(name: str, prefix: str = "model.") -> str:
    """The checkpoint's name for a parameter: what the model calls "model." sits under `prefix`
    in the checkpoint (e.g. "model.language_model." in a multimodal one)."""
    return prefix + name.removeprefix("model.") if name.startswith("model.") else name


def load_weights(
    model: nn.Module,
    header: Mapping,
    get_tensor: Callable[[str], torch.Tensor],
    prefix: str = "model.",
) -> dict[str, str]:
    """Fill every parameter of `model` from a checkpoint; return {parameter: checkpoint key}.

    header: the checkpoint's tensors by name (a safetensors header, or any mapping with those
        keys); get_tensor(key) reads one of them.
    prefix: where the checkpoint keeps what the model calls "model." (the text model).
    """
    tied = model.config.tie_word_embeddings
    sources = {}
    for name in model.state_dict():  # a tied model lists the head and the embedding both
        key = checkpoint_key(name, prefix)
        if tied and name == "lm_head.weight":  # the head is the embedding; a copy is not read
            key = checkpoint_key("model.embed_tokens.weight", prefix)
        if key not in header:
            raise KeyError(f"the checkpoint has no tensor {key!r} for the parameter {name!r}")
        sources[name] = key
    tensors = {key: get_tensor(key) for key in dict.fromkeys(sources.values())}  # each once
    model.load_state_dict({n: tensors[k] for n, k in sources.items()}, strict=True, assign=True)
    if tied:  # assign made two Parameters of the one tensor: make them one Parameter again
        model.lm_head.weight = model.model.embed_tokens.weight
    return sources
