# Generated from solutions/ch00_foundations.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""The safetensors file format: 8 bytes of header length, a JSON header, then the raw tensors."""

import json
import os
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses longer headers


def read_safetensors_header(path: str | Path) -> dict:
    """The JSON header of a .safetensors file, as a dict.

    {tensor name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, ...}, plus
    "__metadata__" when the file has one. Reads the header only, never the tensor data; a
    length the file cannot hold is a ValueError that names the file.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))  # header length: unsigned 64-bit, little-endian
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(
                f"{path}: the header claims {n:,} bytes but the file holds {size:,}: the download "
                "stopped early or this is not a safetensors file. Download it again."
            )
        return json.loads(f.read(n).decode("utf-8"))  # the format says UTF-8, nothing else
