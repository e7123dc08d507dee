"""Where a model name's files are on this machine, without loading anything.

A name such as "Qwen/Qwen3-0.6B" is looked for, in order, as:
  1. an explicit folder (any path that exists),
  2. `$QWEN_MINI_WEIGHTS/<repo-name>` or `$QWEN_MINI_WEIGHTS/<org>/<repo-name>`,
  3. the local Hugging Face cache (where transformers and huggingface_hub keep what they fetch).
The model's loader (`qwen_mini.hub`) and the tokenizer both find their files here.
"""

from __future__ import annotations

import os
from pathlib import Path

from .validation import as_path

SINGLE_FILE = "model.safetensors"  # a checkpoint's weights in one file,
INDEX_FILE = "model.safetensors.index.json"  # or in shards this index names

# the models this course is written for, with their model_type
KNOWN_MODELS = {
    "Qwen/Qwen3-0.6B": "qwen3",
    "Qwen/Qwen2.5-0.5B": "qwen2",
    "Qwen/Qwen3.5-0.8B": "qwen3_5",
}

WEIGHTS_ENV, DOWNLOAD_ENV = "QWEN_MINI_WEIGHTS", "QWEN_MINI_DOWNLOAD"


def known_name(name: str) -> str | None:
    """The canonical known name for `name`, case-insensitive, with or without "Qwen/"."""
    for known in KNOWN_MODELS:
        if name.lower() in (known.lower(), known.split("/")[1].lower()):
            return known
    return None


def hf_cache_dir() -> Path:
    """The Hugging Face cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (
        (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()
    )


def _in_env(name: str, searched: list[str]) -> Path | None:
    root = os.environ.get(WEIGHTS_ENV)
    if not root:
        searched.append(f"${WEIGHTS_ENV} (not set)")
        return None
    root = Path(root).expanduser()
    candidates = [root / name.split("/")[-1]] + ([root / name] if "/" in name else [])
    for folder in candidates:
        if folder.is_dir():
            return folder
    searched.append(f"${WEIGHTS_ENV}: " + ", ".join(str(c) for c in candidates))
    return None


def hf_cache_repo(name: str) -> Path:
    """Where the Hugging Face cache keeps the repository `name` ("Qwen/Qwen3-0.6B")."""
    return hf_cache_dir() / ("models--" + name.replace("/", "--"))


def hf_cache_snapshot(name: str) -> Path | None:
    """The snapshot `refs/main` points at, in the cache layout models--<org>--<name>/snapshots,
    whatever it holds (weights, or only the tokenizer files); None if there is none."""
    repo = hf_cache_repo(name)
    ref = repo / "refs" / "main"
    return repo / "snapshots" / ref.read_text().strip() if ref.is_file() else None


def _in_hf_cache(name: str, searched: list[str]) -> Path | None:
    searched.append(f"Hugging Face cache: {hf_cache_repo(name)}")
    snapshot = hf_cache_snapshot(name)
    return snapshot if snapshot is not None and has_weights(snapshot) else None


def looks_like_repo(name: str) -> bool:
    """True for a hub name such as "Qwen/Qwen3-0.6B"; False for paths like "./x" or "/data/x"."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def find(name_or_path: str | Path, searched: list[str]) -> tuple[Path, str] | None:
    """(folder, source) on this machine, or None; each place looked at goes into `searched`."""
    path = as_path(name_or_path, "the model")
    if path.is_dir():
        return path, "path"
    name = known_name(str(name_or_path)) or str(name_or_path)
    if not (looks_like_repo(name) or "/" not in name):
        return None  # a path that does not exist: nowhere else to look
    if (found := _in_env(name, searched)) is not None:
        return found, "env"
    if looks_like_repo(name) and (found := _in_hf_cache(name, searched)) is not None:
        return found, "hf-cache"
    return None


def find_local(name_or_path: str | Path) -> Path | None:
    """A folder on this machine holding the model, or None. Looks at, in order: an explicit
    folder, $QWEN_MINI_WEIGHTS/<repo-name> (or <org>/<repo-name>), the Hugging Face cache."""
    found = find(name_or_path, [])
    return None if found is None else found[0]
