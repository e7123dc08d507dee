"""qwen_mini: a small, readable PyTorch implementation of the Qwen3, Qwen3.5, Qwen2.5 and Qwen3-MoE
models."""

from importlib import import_module

# each public name -> the module that defines it. They are imported on first use, so that the
# `qwen-mini` command starts (and answers --help, or a Ctrl-C) before torch has loaded.
_EXPORTS = {
    "ARCHITECTURES": "architectures",
    "ASSETS": "config",
    "Architecture": "architectures",
    "CausalLM": "model",
    "CheckpointError": "checkpoint",
    "Config": "config",
    "Tokenizer": "tokenizer",
    "config_from_file": "architectures",
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
