"""Chapter 5's checks: their independent references agree with transformers' Qwen3.5 layer, and
the chapter's end-to-end model is built from the learner's blocks (`qwen_mini.course.mine`).

The mistakes of the catalogue fail their public checks in tests/test_wrong_answers.py and
through the grader in tests/test_grade_wrong_answers.py; here, what those tests take on trust.
"""

import re

import pytest
import torch
from test_mine import exercise_cells, notebook_folder, qwen_mini, run_cells  # noqa: F401
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from qwen_mini import deltanet
from qwen_mini.course import mine
from qwen_mini.course.checks import ch05

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _hf_deltanet(cfg, reference):
    """transformers' Qwen3.5 layer with the weights of the checks' reference layer."""
    hf_cfg = Qwen3_5TextConfig(
        hidden_size=cfg.hidden_size,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        rms_norm_eps=cfg.rms_norm_eps,
    )
    layer = hf.Qwen3_5GatedDeltaNet(hf_cfg, 0).eval()
    layer.load_state_dict(reference.state_dict())
    return layer


@pytest.mark.parametrize("n_v, T", [(2, 6), (4, 9)])
def test_the_token_by_token_reference_equals_transformers(n_v, T):
    cfg = ch05._qwen35_cfg(n_v=n_v, d_v=3)
    seed = 5
    _, reference = ch05._deltanet_pair(deltanet.GatedDeltaNet, cfg, seed)
    x = torch.randn(2, T, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _hf_deltanet(cfg, reference)(x)
    assert expected.abs().max() > 0.1  # not a near-zero output
    got = ch05._deltanet_formula(cfg, seed, x, (T,))["output, no cache"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_strong_decays_give_nan_gradients_for_exp_then_tril():
    """The mistake the overflow case is there for is silent in the forward pass, its gradient
    is NaN, and the observation the case makes sees it (and not the package's mask)."""
    from qwen_mini.course.observing import observe

    G = torch.tensor([0.0, -400.0, -1200.0], dtype=torch.float64, requires_grad=True)
    with observe("overflows") as seen:
        M = ch05.mask_exp_tril(G)
    assert torch.isfinite(M).all() and seen.value == ["exp"]
    M.sum().backward()
    assert G.grad.isnan().any()
    G.grad = None
    with observe("overflows") as seen:
        M = deltanet.decay_mask(G)
    assert seen.value == []
    M.sum().backward()
    assert torch.isfinite(G.grad).all()


def test_chapter_5_model_is_built_from_the_learners_blocks(tmp_path, qwen_mini):  # noqa: F811
    """A learner who did chapter 5: Qwen3.5 runs on their GatedDeltaNet, GatedAttention and
    zero-centred norm, with the package's tokens."""
    home, folder = tmp_path / "home", notebook_folder(tmp_path)
    (folder / "ch05_deltanet.ipynb").write_text("{}")
    run_cells(exercise_cells("ch05_deltanet"), folder, home)
    pieces = sorted(p.name for p in (home / "mine" / mine.pieces_folder(folder).name).iterdir())
    for piece in ("ch05.GatedDeltaNet.py", "ch05.GatedAttention.py", "ch05.conv_qkv.py"):
        assert piece in pieces, pieces
    args = ("generate", "Qwen/Qwen3.5-0.8B", "The capital of France is")
    args += ("--max-new-tokens", "8", "--temperature", "0")
    theirs, _ = qwen_mini(*args, home=home)
    ours, table = qwen_mini(*args, "--mine", "--dir", str(folder), home=home)
    assert ours == theirs and ours.strip()
    for block in (
        r"linear_attention \(ch05\.GatedDeltaNet\)",
        r"full_attention \(ch05\.GatedAttention\)",
        r"norm \(ch05\.ZeroCentredRMSNorm\)",
    ):
        assert re.search(rf"^  {block}\s+yours$", table, re.M), table
