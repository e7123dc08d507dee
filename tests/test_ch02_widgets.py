"""Chapter 2's interactive views, in a real kernel: the solutions notebook is executed, then each
widget control is set to another value and the figure its view shows must change (nbval alone
never fires a widget callback). The callbacks' returned data are checked against properties that
hold whatever the trained weights: without QK-Norm, scaling q and k by s scales the logits by s²;
with it, the logits do not move; removing QK-Norm from a model changes its logits."""

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "solutions" / "ch02_qk_norm.ipynb"

PROBE = r"""
import json as _json

def _png(view):
    return view.output.outputs[-1]["data"]["image/png"]

_changed = {}
for _name, _view in [("step", step_view), ("scale", scale_view), ("head", head_view)]:
    for _c_name, _c in _view.controls.items():
        _before = _png(_view)
        if isinstance(_c, widgets.Dropdown):
            _c.value = _c.options[-1] if _c.value != _c.options[-1] else _c.options[0]
        else:
            _c.value = _c.min if _c.value != _c.min else _c.max
        _changed[f"{_name}.{_c_name}"] = (_before != _png(_view), len(_view.output.outputs))

_d1, _d8 = norm_scale_view(1.0), norm_scale_view(8.0)
_steps = training_step_view(0, 0, 0), training_step_view(n_records - 1, 0, 0)
_heads = head_explorer("tiny QK-Norm model (trained here)", 0)
print("RESULT" + _json.dumps({
    "changed": _changed,
    "qk_norm_max": [_d1[(True, "float32")]["max_logit"], _d8[(True, "float32")]["max_logit"]],
    "plain_max": [_d1[(False, "float32")]["max_logit"], _d8[(False, "float32")]["max_logit"]],
    "rows_sum": float(_steps[1]["QK-Norm"]["weights"].sum(-1).sub(1).abs().max()),
    "steps": [_steps[0]["QK-Norm"]["step"], _steps[1]["QK-Norm"]["step"]],
    "intact_max": _heads["intact"]["max"].tolist(),
    "removed_max": _heads["removed"]["max"].tolist(),
}))
"""


@pytest.fixture(scope="module")
def result():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    env = {"QWEN_MINI_CHECKS": "solutions", "HF_HUB_OFFLINE": "1"}
    old = {k: os.environ.get(k) for k in [*env, "QWEN_MINI_WEIGHTS"]}
    os.environ.update(env)
    os.environ.pop("QWEN_MINI_WEIGHTS", None)  # the stand-ins, whatever this machine holds
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    return json.loads(text.split("RESULT", 1)[1])


def test_every_control_redraws_its_figure_in_place(result):
    assert set(result["changed"]) == {
        "step.step_index",
        "step.layer",
        "step.head",
        "scale.scale",
        "scale.head",
        "head.model",
        "head.layer",
    }
    for name, (changed, n_outputs) in result["changed"].items():
        assert changed, f"{name}: the figure did not change"
        assert n_outputs == 1, f"{name}: {n_outputs} figures instead of one redrawn in place"


def test_norm_scale_view_data(result):
    on1, on8 = result["qk_norm_max"]
    plain1, plain8 = result["plain_max"]
    assert abs(on8 - on1) <= 1e-3 * abs(on1)  # QK-Norm: the scale of q and k is divided out
    assert abs(plain8 / plain1 - 64) <= 64 * 1e-3  # q·k scales by 8 * 8


def test_training_step_and_head_views_data(result):
    assert result["rows_sum"] < 1e-5  # attention rows are distributions
    assert result["steps"][0] == 0 and result["steps"][1] > 0
    assert result["intact_max"] != result["removed_max"]
