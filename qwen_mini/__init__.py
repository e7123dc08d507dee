"""qwen_mini: a small, readable PyTorch implementation of the Qwen3 and Qwen2.5 models."""

from importlib import import_module

# each public name -> the module that defines it. They are imported on first use, so that the
# `qwen-mini` command starts (and answers --help, or a Ctrl-C) before torch has loaded.
_EXPORTS = {
    "ASSETS": "config",
    "CausalLM": "model",
    "CheckpointError": "checkpoint",
    "Config": "config",
    "Tokenizer": "tokenizer",
    "generate": "generation",
    "generate_tokens": "generation",
    "load_model": "hub",
    "load_tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
