"""What the course site (`make site`) puts where a notebook displayed an interactive view: the
view's first figure where its display carries one, and a note that its sliders need JupyterLab.
(The site itself is built and opened in Chromium by `make site` and `make test-site`.)"""

import nbformat

from qwen_mini.course.site import STILL_NOTE, WIDGET, WIDGET_NOTE, static_outputs

PNG = "iVBORw0KGgoAAAANSUhEUg=="  # the start of a PNG, base64: the data is only passed on


def _display(data: dict):
    return nbformat.v4.new_output("display_data", data=data)


def test_a_view_with_a_first_figure_shows_it_and_says_the_sliders_need_a_kernel():
    text = nbformat.v4.new_output("stream", name="stdout", text="before\n")
    view = _display({WIDGET: {"model_id": "x"}, "text/plain": "VBox(...)", "image/png": PNG})
    out = static_outputs([text, view])
    assert out[0] == text  # other outputs stay as they are
    assert [o["data"] for o in out[1:]] == [
        {"image/png": PNG, "text/plain": "<the view's first figure>"},
        {"text/markdown": STILL_NOTE},
    ]
    assert all(WIDGET not in o.get("data", {}) for o in out)  # no widget left for the page
    nbformat.validate(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(outputs=out)]))


def test_a_view_without_a_figure_is_the_note_alone():
    out = static_outputs([_display({WIDGET: {"model_id": "x"}, "text/plain": "VBox(...)"})])
    assert [o["data"] for o in out] == [{"text/markdown": WIDGET_NOTE}]
