"""What the course site (`make site`) puts where a notebook displayed an interactive view (the
view's first figure where its display carries one, and a note that its sliders need JupyterLab)
and where a chapter shows a diagram (the file, byte for byte assets/diagrams/'s).
(The site itself is built and opened in Chromium by `make site` and `make test-site`.)"""

from pathlib import Path

import nbformat
import pytest

from qwen_mini.course.site import (
    DIAGRAMS,
    STILL_NOTE,
    WIDGET,
    WIDGET_NOTE,
    attachments_as_files,
    static_outputs,
)

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


# --- the diagrams: each chapter shows its own, on its page of the site ---------------------------

ROOT = Path(__file__).resolve().parents[1]
DIAGRAM_FILES = sorted((ROOT / "assets" / "diagrams").glob("ch*.svg"))


def test_every_chapter_has_a_diagram_file():
    chapters = {p.name.split("_")[0] for p in (ROOT / "solutions").glob("ch*.ipynb")}
    drawn = {p.name.split("_")[0] for p in DIAGRAM_FILES}
    assert chapters <= drawn, f"chapters without a diagram in assets/diagrams/: {chapters - drawn}"


@pytest.mark.parametrize(
    "chapter", sorted((ROOT / "course").glob("ch*.ipynb")), ids=lambda p: p.stem
)
def test_a_chapter_page_shows_its_diagrams_as_files(chapter, tmp_path):
    """The learner copy carries each diagram as a cell attachment (JupyterLab serves only
    course/); the site writes it as a file beside the page and links the file, byte for byte the
    one in assets/diagrams/."""
    nb = nbformat.read(chapter, as_version=4)
    mine = [p for p in DIAGRAM_FILES if p.name.split("_")[0] == chapter.name.split("_")[0]]
    assert mine, f"no diagram of {chapter.name} in assets/diagrams/"
    attachments_as_files(nb, tmp_path / DIAGRAMS)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "attachment:" not in text, "a link to an attachment is left on the page"
    for path in mine:
        assert f"]({DIAGRAMS}/{path.name})" in text, f"{chapter.name} does not show {path.name}"
        written = tmp_path / DIAGRAMS / path.name
        assert written.read_bytes() == path.read_bytes(), (
            f"{chapter.name} shows another {path.name} than assets/diagrams/ holds: run "
            "python scripts/draw_diagrams.py --embed, then python -m qwen_mini.course.build"
        )
    nbformat.validate(nb)


def test_the_committed_diagrams_are_what_the_script_draws():
    """assets/diagrams/ and the notebooks' copies equal scripts/draw_diagrams.py's output."""
    import subprocess
    import sys

    script = ROOT / "scripts" / "draw_diagrams.py"
    done = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# --- the notebook run that `make test` and `make site` share ------------------------------------


def test_the_notebook_run_fails_on_a_raising_cell_and_is_reused_only_while_unchanged(
    tmp_path, capsys
):
    """`make test` runs the learner copies with `run_all` (a cell that raises fails it, naming
    the notebook and the cell) and `make site` reuses its executed copies while the notebook is
    unchanged; a changed notebook is run again."""
    from qwen_mini.course.site import run_all

    course, executed = tmp_path / "course", tmp_path / "executed"
    course.mkdir()
    path = course / "ch00_x.ipynb"
    cells = [nbformat.v4.new_code_cell("print(6 * 7)")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)

    (copy,) = run_all(course, executed, jobs=1, timeout=60)
    assert nbformat.read(copy, as_version=4).cells[0].outputs[0]["text"] == "42\n"
    assert "ran ch00_x.ipynb" in capsys.readouterr().out
    run_all(course, executed, jobs=1, timeout=60)
    assert "ch00_x.ipynb: its run in" in capsys.readouterr().out  # reused, not run

    cells.append(nbformat.v4.new_code_cell("raise ValueError('the broken cell')"))
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    with pytest.raises(SystemExit) as failed:
        run_all(course, executed, jobs=1, timeout=60)
    assert "ch00_x.ipynb" in str(failed.value) and "the broken cell" in str(failed.value)
    assert not copy.with_suffix(".stamp").exists()  # the failed run is never reused
