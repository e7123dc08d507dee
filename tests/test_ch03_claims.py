"""Chapter 3's table of Qwen MoE designs says what transformers' configuration defaults are: each
row is read from the notebook and compared with the config class transformers 5.23 builds for
that model_type with no arguments; the released Qwen3-30B-A3B config.json is checked for the one
value the table quotes from it."""

import json
import re
from pathlib import Path

import pytest
from transformers import AutoConfig

from qwen_mini.config import ASSETS

NOTEBOOK = Path(__file__).resolve().parents[1] / "solutions" / "ch03_moe.ipynb"


def _table_rows() -> dict[str, list[str]]:
    """model_type -> the row's cells after the first, from the notebook's MoE table."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    text = next(
        "".join(c["source"]) for c in cells if "| model | experts |" in "".join(c["source"])
    )
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| [^|]*\(`(\w+)`\) \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [cell.strip() for cell in m.group(2).split("|")]
    return rows


def _number(cell: str) -> int | None:
    return None if cell == "—" else int(cell.replace(",", ""))


ROWS = _table_rows()


def test_the_table_names_four_model_types():
    assert set(ROWS) == {"qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe"}


@pytest.mark.parametrize("model_type", sorted(ROWS))
def test_each_row_is_transformers_default(model_type):
    cfg = AutoConfig.for_model(model_type)
    cfg = getattr(cfg, "text_config", cfg)  # qwen3_5_moe: the text model's config
    experts, per_token, width, shared, renorm = ROWS[model_type]
    assert _number(experts) == cfg.num_experts
    assert _number(per_token) == cfg.num_experts_per_tok
    assert _number(width) == cfg.moe_intermediate_size
    assert _number(shared) == getattr(cfg, "shared_expert_intermediate_size", None)
    if hasattr(cfg, "norm_topk_prob"):
        assert renorm.startswith(f"default `{cfg.norm_topk_prob}`"), renorm
    else:
        assert renorm.startswith("no such field"), renorm


def test_the_released_30b_config_renormalises():
    released = json.loads((ASSETS / "configs" / "qwen3-30b-a3b" / "config.json").read_text())
    assert released["norm_topk_prob"] is True
    assert AutoConfig.for_model("qwen3_moe").norm_topk_prob is False
    assert "the released `config.json` (above): `true`" in ROWS["qwen3_moe"][4]
