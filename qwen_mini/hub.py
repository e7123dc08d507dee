"""From a model name such as "Qwen/Qwen3-0.6B" to a loaded model.

A name resolves, in order, to:
  1.-3. its files on this machine: a folder, $QWEN_MINI_WEIGHTS, the Hugging Face cache (see
     `qwen_mini.locate`),
  4. a download from the Hugging Face hub, only when asked (download=True or
     QWEN_MINI_DOWNLOAD=1) and only on a machine that is online,
  5. the stand-in: a tiny model of the same architecture (see standin.py), with a notice.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .architectures import Architecture, config_from_file
from .checkpoint import checked_device, checked_dtype, load_checkpoint
from .locate import (
    DOWNLOAD_ENV,
    KNOWN_MODELS,
    WEIGHTS_ENV,
    find,
    has_weights,
    hf_cache_dir,
    known_name,
    looks_like_repo,
)
from .model import CausalLM
from .standin import STANDINS, TRAINED, load_standin, standin_kind
from .validation import as_path

# what a download fetches: configs, safetensors weights and tokenizer files, never pickles
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]


class DownloadError(RuntimeError):
    """A download that was asked for and could not happen."""


@dataclass
class Resolved:
    """Where a name resolved: a folder and how it was found, or None and source 'stand-in'."""

    path: Path | None
    source: str  # 'path' | 'env' | 'hf-cache' | 'download' | 'stand-in'
    searched: list[str] = field(default_factory=list)  # the places looked at, for messages


def _download(name: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise DownloadError(
            "downloading needs the huggingface_hub package: pip install 'qwen-mini[download]' "
            "(or pip install huggingface_hub)."
        ) from None
    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated model, disk full...
        raise DownloadError(
            f"could not download {name} from the Hugging Face hub ({type(e).__name__}: {e}). "
            f"Is this machine online? Otherwise download the folder elsewhere and point "
            f"${WEIGHTS_ENV} at the folder that holds it."
        ) from None


def _download_wanted(download: bool) -> bool:
    return download or os.environ.get(DOWNLOAD_ENV, "").strip().lower() in ("1", "true", "yes")


def resolve(name_or_path: str | Path, download: bool = False) -> Resolved:
    """Where `name_or_path` resolves: a local folder, a download (only if asked: download=True
    or QWEN_MINI_DOWNLOAD=1), or the stand-in of a known name. Anything else is a ValueError."""
    searched = []
    if (found := find(name_or_path, searched)) is not None:
        return Resolved(found[0], found[1], searched)
    name = known_name(str(name_or_path)) or str(name_or_path)
    if looks_like_repo(name) and _download_wanted(download):
        return Resolved(_download(name), "download", searched)
    if name in KNOWN_MODELS:  # each known model has a stand-in
        return Resolved(None, "stand-in", searched)
    raise ValueError(
        f"{str(name_or_path)!r} is not a folder and not a known model name. Known names: "
        f"{', '.join(KNOWN_MODELS)}; or pass the path of a checkpoint folder (config.json + "
        f"model.safetensors). Looked in: {'; '.join(searched) or 'nowhere else'}."
    )


def standin_notice(name: str) -> str:
    """The one line that says a name runs on its stand-in."""
    return f"qwen_mini: no weights found for {name}; using its stand-in ({standin_kind(name)})."


def standin_help(name: str) -> str:
    """Where `name` was looked for and how to get its real weights (the command line says it)."""
    name, searched = known_name(name) or name, []
    find(name, searched)
    short = name.split("/")[-1]
    return "\n".join(
        [
            "  Looked in: " + "; ".join(searched) + ".",
            "  The stand-in has the real architecture and tokenizer at a tiny size"
            + (
                "; it was trained on a little English (simple sentences, no knowledge)."
                if name in TRAINED
                else "; its weights are random."
            ),
            "  To use the real weights, do one of:",
            f"    - put the checkpoint folder at ${WEIGHTS_ENV}/{short} and set {WEIGHTS_ENV};",
            f"    - have it in the Hugging Face cache ({hf_cache_dir()}), where transformers and",
            "      huggingface_hub put what they download;",
            f"    - on a machine that is online, once: `qwen-mini download {name}`",
            f"      (or load_model({name!r}, download=True), or set {DOWNLOAD_ENV}=1).",
        ]
    )


def notice(text: str) -> None:
    """Say something the user should know but need not act on, as one line. A notebook shows
    stderr as an error, so there it is plain output; elsewhere it goes to stderr, so that a
    command's stdout holds only what the command produces."""
    in_notebook = type(sys.stdout).__module__.startswith("ipykernel")
    print(text, file=sys.stdout if in_notebook else sys.stderr)


def load_model(
    name_or_path: str | Path,
    dtype: torch.dtype | str | None = None,
    *,
    download: bool = False,
    arch: Architecture | None = None,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """Load a model by name ("Qwen/Qwen3-0.6B") or folder; the stand-in if no weights are found.

    arch: the architecture row to build the model from (default: the row of its model_type);
    pass one with your own blocks (`ARCHITECTURES["qwen3"].with_blocks(...)`) to run the real
    weights, or the stand-in's, through them.
    device: where the weights are put and the model runs ("cpu", "cuda", "cuda:1", "mps"); a
    device this machine does not have is a ValueError before anything is read.
    The model's `source` says where it came from and `is_standin` whether it is the stand-in.
    """
    device, dtype = checked_device(device), checked_dtype(dtype)  # before any download
    as_path(name_or_path, "load_model: name_or_path")
    found = resolve(name_or_path, download=download)
    if found.path is not None:
        return load_checkpoint(found.path, dtype, arch, device)
    name = known_name(str(name_or_path))
    notice(standin_notice(name))
    return load_standin(name, dtype, arch, device)


def model_type_of(name_or_path: str | Path) -> str:
    """The model_type `load_model(name_or_path)` builds: its config.json's, or its stand-in's.
    Never downloads."""
    found = resolve(name_or_path)
    if found.path is not None:
        return config_from_file(found.path / "config.json").model_type
    return STANDINS[known_name(str(name_or_path))]["config"]["model_type"]


def describe(name_or_path: str | Path) -> str:
    """One line saying where a name resolves (for `qwen-mini doctor`); never downloads."""
    searched = []
    found = find(name_or_path, searched)
    where = "; ".join(searched) or "nowhere else"
    if found is not None:
        path, source = found
        complete = "" if has_weights(path) else " (no config.json + safetensors weights there)"
        return f"{name_or_path}: {path} [{source}]{complete}"
    name = known_name(str(name_or_path))
    if name is None:
        return f"{name_or_path}: not found and not a known model name (looked in: {where})"
    then = "a download (QWEN_MINI_DOWNLOAD=1)" if _download_wanted(False) else "the stand-in"
    return f"{name_or_path}: no local weights, {then} will be used (looked in: {where})"
