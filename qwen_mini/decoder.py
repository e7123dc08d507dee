# Generated from solutions/ch01_attention.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""The decoder layer, the model's forward pass, loading the weights by checkpoint name, and the
generation loop. `qwen_mini.model` builds the model from these; `qwen_mini.checkpoint` and
`qwen_mini.generation` add the checks around them.
"""

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from qwen_mini.rope_scaling import rotary_cos_sin


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)).

    The parts come built; the layer registers each under the checkpoint's name for it: the mixer
    under `mixer_name` ("self_attn" or "linear_attn"), and `input_layernorm`, `mlp`,
    `post_attention_layernorm`.
    """

    def __init__(
        self,
        mixer_name: str,
        mixer: nn.Module,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module,
    ):
        super().__init__()
        self.mixer_name = mixer_name
        self.input_layernorm = input_layernorm
        self.add_module(mixer_name, mixer)  # a name known at run time: the checkpoint's name
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x: torch.Tensor, cos, sin, cache=None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; `cache` is this layer's state (or None)."""
        x = x + self.mixer(self.input_layernorm(x), cos, sin, cache)  # tokens exchange information
        return x + self.mlp(self.post_attention_layernorm(x))  # each token on its own


def model_forward(model, input_ids: torch.Tensor, cache=None, last_only: bool = False):
    """input_ids [B, T] -> logits [B, T, vocab] ([B, 1, vocab] with last_only)."""
    cfg, backbone = model.config, model.model
    start = cache.length if cache is not None else 0  # the new tokens follow the cached ones
    x = backbone.embed_tokens(input_ids)  # [B, T, hidden]
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    cos, sin = rotary_cos_sin(cfg, positions, x.dtype)  # [T, rotary_dim]
    for i, layer in enumerate(backbone.layers):
        x = layer(x, cos, sin, cache.layers[i] if cache is not None else None)
    x = backbone.norm(x)
    if last_only:  # before the head: the biggest matrix multiplies one row, not T
        x = x[:, -1:]
    return model.lm_head(x)  # [B, T, vocab]


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


def greedy(logits: torch.Tensor) -> int:
    """The most likely next token (logits [vocab])."""
    return int(logits.argmax())


def decode(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    choose: Callable[[torch.Tensor], int] = greedy,
    stop=(),
) -> Iterator[int]:
    """Yield up to max_new_tokens ids continuing prompt_ids, through the KV cache."""
    device = next(model.parameters()).device
    cache = model.new_cache(batch_size=1)
    ids = torch.tensor([prompt_ids], device=device)  # [1, T]: the whole prompt, once
    for _ in range(max_new_tokens):
        logits = model(ids, cache=cache, last_only=True)[0, -1]  # [vocab]
        token = choose(logits)
        yield token
        if token in stop:
            return
        ids = torch.tensor([[token]], device=device)  # [1, 1]: the cache holds the rest
