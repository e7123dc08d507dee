"""Chapters 2 and 3's blocks in the learner's model (qwen_mini/course/mine.py `BLOCKS`,
`architecture`): a learner's QKVBiasAttention is Qwen2's attention, their SparseMoeBlock and
SharedExpertMoeBlock the sparse layers' blocks of the rows built from the package's, and the
table says so; rows built from other blocks keep theirs."""

import pytest
import torch

from qwen_mini import moe
from qwen_mini.attention import QKVBiasAttention
from qwen_mini.config import Config
from qwen_mini.course import checking, mine
from qwen_mini.model import CausalLM


class LearnersAttention(QKVBiasAttention):
    pass


class LearnersSparse(moe.SparseMoeBlock):
    pass


class LearnersShared(moe.SharedExpertMoeBlock):
    pass


YOURS = {
    "ch02.QKVBiasAttention": LearnersAttention,
    "ch03.SparseMoeBlock": LearnersSparse,
    "ch03.SharedExpertMoeBlock": LearnersShared,
}


def pieces() -> dict:
    out = {
        x: mine.Piece(x, "package", checking.reference(x), "not passed yet") for x in mine.BLOCKS
    }
    out.update({x: mine.Piece(x, "learner", obj) for x, obj in YOURS.items()})
    return out


def whose(table, exercise_id):
    return next((who, note) for what, who, note in table if f"({exercise_id})" in what)


TINY = dict(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=32,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
    shared_expert_intermediate_size=12,
)  # fmt: skip


@pytest.mark.parametrize("model_type, block, exercise", [
    ("qwen2", LearnersAttention, "ch02.QKVBiasAttention"),
    ("qwen3_moe", LearnersSparse, "ch03.SparseMoeBlock"),
    ("qwen2_moe", LearnersShared, "ch03.SharedExpertMoeBlock"),  # experts one by one
    ("qwen3_next", LearnersShared, "ch03.SharedExpertMoeBlock"),  # experts fused
])  # fmt: skip
def test_the_learners_block_builds_the_rows_made_of_the_packages(model_type, block, exercise):
    cfg = Config(model_type=model_type, **TINY)
    row, table = mine.architecture(model_type, pieces())
    assert whose(table, exercise) == ("learner", "")
    model = CausalLM(cfg, arch=row)
    package = CausalLM(cfg)
    found = [m for m in model.modules() if type(m) is block]
    assert len(found) == cfg.num_hidden_layers  # one per layer: every layer sparse here
    assert not [m for m in package.modules() if type(m) is block]
    model.load_state_dict(package.state_dict())  # the same checkpoint keys
    ids = torch.randint(32, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), package(ids), atol=1e-5, rtol=1e-5)


def test_rows_of_other_blocks_keep_theirs_and_say_why():
    _, table = mine.architecture("qwen3", pieces())
    assert whose(table, "ch02.QKVBiasAttention") == (
        "package",
        "qwen3 has a full_attention of its own",
    )
    assert whose(table, "ch03.SparseMoeBlock") == ("package", "qwen3 has no mixture of experts")
    _, table = mine.architecture("qwen3_moe", pieces())
    assert whose(table, "ch03.SharedExpertMoeBlock")[0] == "package"  # not its block
    row, table = mine.architecture("qwen2", pieces())
    assert whose(table, "ch01.Attention") == ("package", "qwen2 has a full_attention of its own")
    assert row.mixers["full_attention"] is LearnersAttention
