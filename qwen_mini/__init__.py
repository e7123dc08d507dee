"""qwen_mini: a small, readable PyTorch implementation of the Qwen3 and Qwen2.5 models."""

from .architectures import ARCHITECTURES, Architecture, config_from_file
from .checkpoint import CheckpointError
from .config import ASSETS, Config
from .generation import generate, generate_tokens
from .hub import load_model
from .model import CausalLM
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ARCHITECTURES",
    "ASSETS",
    "Architecture",
    "CausalLM",
    "CheckpointError",
    "Config",
    "Tokenizer",
    "config_from_file",
    "generate",
    "generate_tokens",
    "load_model",
    "load_tokenizer",
]
