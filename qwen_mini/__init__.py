"""qwen_mini: a small, readable PyTorch implementation of the Qwen3 and Qwen2.5 models."""

from .config import Config
from .model import CausalLM

__all__ = ["CausalLM", "Config"]
