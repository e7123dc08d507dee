# Generated from solutions/ch00_foundations.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""The safetensors file format: 8 bytes of header length, a JSON header, then the raw tensors."""

import json
import struct
from pathlib import Path


def read_safetensors_header(path: str | Path) -> dict:
    """The JSON header of a .safetensors file, as a dict.

    {tensor name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, ...}, plus
    "__metadata__" when the file has one. Reads the header only, never the tensor data.
    """
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))  # header length: unsigned 64-bit, little-endian
        return json.loads(f.read(n))
