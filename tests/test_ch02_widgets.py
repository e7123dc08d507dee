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

import numpy as np

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

_status = {_name: _view.status.value for _name, _view in
           [("step", step_view), ("scale", scale_view), ("head", head_view)]}
_latest = {"record": step_view.controls["step_index"].value,
           "layer": step_view.controls["layer"].value, "head": step_view.controls["head"].value}
# a QK-Norm head's largest logit can be negative: one curve made negative, as such a head's is
_data = training_step_view(n_records - 1, 0, 0)
_data["QK-Norm"]["curve"] = [-abs(v) - 0.5 for v in _data["QK-Norm"]["curve"]]
_fig = draw_training_step(_data, 0, 0)
_curves = _fig.axes[len(live)]  # the top row's last panel: the largest logit per step
_fig.canvas.draw()  # the axis limits as the figure shows them
_inside = []  # per line: every point inside the panel (axes coordinates 0..1)
for _l in _curves.get_lines():
    _xy = (_l.get_transform() - _curves.transAxes).transform(_l.get_xydata())
    _inside.append(bool((np.isfinite(_xy) & (_xy >= -1e-6) & (_xy <= 1 + 1e-6)).all()))
_negative = sum(min(_l.get_ydata()) < 0 for _l in _curves.get_lines())
plt.close(_fig)
_fig = draw_heads(head_explorer("tiny QK-Norm model (trained here)", 0),
                  "tiny QK-Norm model (trained here)", 0)
_ticks = [[float(t) for t in _a.get_xticks()] for _a in _fig.axes]
_n_heads = len(head_explorer("tiny QK-Norm model (trained here)", 0)["intact"]["max"])
plt.close(_fig)
_menu = head_view.controls["model"]
_bundles = {_name: sorted(_view._repr_mimebundle_()) for _name, _view in
            [("step", step_view), ("scale", scale_view), ("head", head_view)]}
_png_start = step_view._repr_mimebundle_()["image/png"][:8]
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
    "status": _status,
    "bundles": _bundles,
    "png_start": _png_start,
    "latest": _latest,
    "yscale": _curves.get_yscale(),
    "points_drawn": _inside,
    "negative_lines": int(_negative),
    "ticks": _ticks,
    "n_heads": _n_heads,
    "menu_width": _menu.layout.width,
    "menu_options": list(_menu.options),
    "notes": [c.value for c in step_view.children if isinstance(c, widgets.Label)],
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


def test_the_figure_says_the_latest_values(result):
    """Each redraw reads every control as it is when it starts, and the line under the controls
    says which values the figure is for: after the moves above, the latest ones."""
    latest = result["latest"]
    want = f"the figure shows record {latest['record']}, layer {latest['layer']}, "
    assert result["status"]["step"] == want + f"head {latest['head']}"
    for name in ("scale", "head"):
        assert result["status"][name].startswith("the figure shows "), result["status"]


def test_the_record_slider_is_explained(result):
    notes = [n for n in result["notes"] if n.startswith("record:")]
    assert len(notes) == 1 and "every 5 steps" in notes[0], result["notes"]


def test_every_largest_logit_curve_is_drawn(result):
    """A log axis would drop a curve's points at or below 0 (a QK-Norm head's largest logit can
    be negative; log clips them far below the panel): with one curve made negative, every point of
    every curve lies inside the panel."""
    assert result["yscale"] == "symlog"
    assert result["negative_lines"] >= 2  # the curve made negative and its marker
    assert result["points_drawn"] and all(result["points_drawn"]), result["points_drawn"]


def test_the_head_axis_has_a_tick_per_head(result):
    for ticks in result["ticks"]:
        assert ticks == list(range(result["n_heads"])), ticks


def test_the_model_menu_fits_its_longest_entry(result):
    width = result["menu_width"]
    assert width.endswith("ch"), width
    # the entry, the label "model" and the menu's arrow, in character widths
    assert float(width[:-2]) >= max(map(len, result["menu_options"])) + len("model") + 3


def test_a_view_carries_its_first_figure_for_static_pages(result):
    """The course site cannot run a view: its display carries the first figure as a PNG beside
    the widget (JupyterLab shows the widget)."""
    for name, mimes in result["bundles"].items():
        assert {"application/vnd.jupyter.widget-view+json", "image/png"} <= set(mimes), name
    assert result["png_start"] == "iVBORw0K"  # base64 of the PNG signature
