# Generated from solutions/ch06_family.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""Exercise helpers of chapter 6 (the rest of the Qwen family): the n-gram table's memory. Not
used to run a model.
"""

from qwen_mini.config import Config
from qwen_mini.ngram_embedding import head_table_sizes


def ngram_memory(cfg: Config, bytes_per_value: int) -> tuple[int, int]:
    """(bytes of all n-gram tables, bytes one token reads from them), at `bytes_per_value`."""
    table, read = 0, 0
    for i in range(len(cfg.ple_layer_ids)):
        sizes = head_table_sizes(cfg, i)
        divisor = cfg.make_ngram_vocab_size_divisible_by
        rows = -(-sum(sizes) // divisor) * divisor  # padded, as the checkpoint stores it
        width = cfg.ple_embed_dim // len(sizes)  # each head's share of the embedding
        table += rows * width
        read += len(sizes) * width  # one row per head
    return table * bytes_per_value, read * bytes_per_value
