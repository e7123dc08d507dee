"""qwen_mini: a small, readable PyTorch implementation of the Qwen3 and Qwen2.5 models."""

from .checkpoint import CheckpointError
from .config import ASSETS, Config
from .generation import generate, generate_tokens
from .hub import load_model
from .model import CausalLM
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ASSETS",
    "CausalLM",
    "CheckpointError",
    "Config",
    "Tokenizer",
    "generate",
    "generate_tokens",
    "load_model",
    "load_tokenizer",
]
