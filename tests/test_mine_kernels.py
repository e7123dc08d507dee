"""A learner's way through the course, as in JupyterLab: each chapter's learner notebook, with
the answers filled in from solutions/, runs every cell in a kernel of its own (one chapter, one
kernel, as a learner who opens the notebooks one by one), in the learner's mode. Every passed
exercise is then the learner's piece in `qwen-mini-course progress`, in a later process, and
`generate --mine` built from those pieces gives the package's tokens on both families; a
bfloat16 model built from them stays bfloat16 and gives the package's bfloat16 logits.

Pieces chain across kernels here: chapter 1's Attention calls the apply_rope that chapter 1's
kernel loaded from the learner's chapter-0 piece, which calls their rotate_half.
"""

import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from learner import learner_env, run_in_kernel

from qwen_mini import load_model
from qwen_mini.course import checking, mine
from qwen_mini.course import notebooks as nbs
from qwen_mini.course.build import learner_notebook
from qwen_mini.course.cli import main

# one worker runs the whole file under `make test` (pytest-xdist): the module fixture runs the
# course once, several minutes
pytestmark = pytest.mark.xdist_group("test_mine_kernels")

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("ch*.ipynb"))


def answered(solution: Path) -> dict:
    """The learner copy of `solution` as the build writes it, with each answer region holding
    the solution's code (without the markers, as a learner would type it)."""
    nb = nbs.load(solution)
    copy = learner_notebook(nb, solution.name)
    cells = [c for c in nb["cells"] if "solution-only" not in nbs.tags(c)]
    assert len(cells) == len(copy["cells"])
    for i, (theirs, ours) in enumerate(zip(cells, copy["cells"], strict=True)):
        text = nbs.source(theirs)
        if ours["cell_type"] == "code" and nbs.has_markers(text):
            place = nbs.where(f"solutions/{solution.name}", i, theirs)
            ours["source"] = nbs.export_source(text, place)
    return copy


def run_notebook(path: Path, home: Path) -> dict:
    """Every cell of the notebook at `path`, in a fresh kernel started in its folder."""
    return run_in_kernel(nbformat.read(path, as_version=4), path.parent, home)


def outputs(nb: dict) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """(home, notebook folder, {chapter: its cells' printed output}) after the whole course."""
    tmp = tmp_path_factory.mktemp("learner")
    home, folder = tmp / "home", tmp / "course"
    folder.mkdir()
    for solution in SOLUTIONS:
        (folder / solution.name).write_text(nbs.dumps(answered(solution)), encoding="utf-8")
    printed = {}
    for solution in SOLUTIONS:  # in order: a chapter builds on the pieces kept before it
        printed[solution.stem] = outputs(run_notebook(folder / solution.name, home))
    return home, folder, printed


@pytest.fixture
def qwen_mini(capsys, monkeypatch):
    """The command line in this process: (stdout, stderr); a non-zero exit fails the test."""

    def run(*args, home: Path):
        for key, value in learner_env(home).items():
            monkeypatch.setenv(key, value)
        for key in ("QWEN_MINI_WEIGHTS", "QWEN_MINI_MINE", "QWEN_MINI_CHECKS"):
            monkeypatch.delenv(key, raising=False)
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        return out, err

    return run


def test_a_kernel_runs_in_this_processs_environment_with_the_learners_settings(tmp_path):
    """The kernel gets this process's environment (PATH, the locale, the one torch thread
    `make test` gives each test process) plus the learner's settings. Started with the settings
    alone, the chapters' kernels ran on two torch threads beside the other test process and
    spent two to five times their CPU time waiting for each other."""
    code = "import os, torch\nfor key in ('PATH', 'OMP_NUM_THREADS', 'QWEN_MINI_HOME'):\n"
    code += "    print(repr(os.environ.get(key)))\nprint(torch.get_num_threads())"
    path = tmp_path / "environment.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)]), path)
    printed = outputs(run_notebook(path, tmp_path / "home")).splitlines()
    expected = [os.environ.get("PATH"), os.environ.get("OMP_NUM_THREADS"), str(tmp_path / "home")]
    assert printed == [repr(x) for x in expected] + [str(torch.get_num_threads())]


def test_every_chapter_keeps_its_pieces_in_a_kernel_of_its_own(learner):
    _, _, printed = learner
    for chapter, text in printed.items():
        assert "not kept" not in text and "could not keep" not in text, (chapter, text[-3000:])
        # a piece loaded from an earlier chapter is the learner's, never the package's stand-in
        assert "→ using the package's" not in text, (chapter, text[-3000:])


def test_every_passed_piece_is_the_learners_in_a_later_process(learner, qwen_mini):
    home, folder, printed = learner
    progress = json.loads(qwen_mini("progress", "--json", "--dir", str(folder), home=home)[0])
    assert list(progress) == [e.id for e in mine.all_exercises()]
    passed = {
        x for text in printed.values() for x in re.findall(r"✓ (?:using your )?(ch\d\d\.\w+)", text)
    }
    assert passed, "no check passed in the notebooks"
    not_learners = {x: progress[x] for x in passed if progress[x] != "learner"}
    notes = mine.load(folder, only=sorted(not_learners)) if not_learners else {}
    assert not not_learners, {x: notes[x].note for x in not_learners}
    # chapter 0's pieces chain into chapter 1's attention, each kept in its own kernel
    pieces = mine.load(folder, only=["ch01.Attention"])
    assert pieces["ch01.Attention"].whose == "learner"
    assert pieces["ch00.apply_rope"].whose == "learner"
    assert pieces["ch00.rotate_half"].whose == "learner"
    assert pieces["ch00.apply_rope"].obj is not checking.reference("ch00.apply_rope")


@pytest.mark.parametrize("model", ["Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B"])
def test_generate_mine_gives_the_packages_tokens(learner, qwen_mini, model):
    home, folder, _ = learner
    args = ("generate", model, "Hello", "--max-new-tokens", "8", "--temperature", "0")
    theirs, _ = qwen_mini(*args, home=home)
    ours, table = qwen_mini(*args, "--mine", "--dir", str(folder), home=home)
    assert ours == theirs and ours.strip()
    assert "yours" in table and "does not load" not in table, table


@pytest.mark.parametrize("model, model_type", [
    ("Qwen/Qwen3-0.6B", "qwen3"), ("Qwen/Qwen3.5-0.8B", "qwen3_5"),
])  # fmt: skip
def test_a_bfloat16_model_of_the_learners_pieces_stays_bfloat16(learner, monkeypatch, model,
                                                                 model_type):  # fmt: skip
    """The learner's pieces run in the dtype of the weights they are given: every activation of
    a bfloat16 model built from them is bfloat16, and its logits are the package's, bit for bit
    (the solutions' pieces do what the package's do)."""
    home, folder, _ = learner
    monkeypatch.setenv("QWEN_MINI_HOME", str(home))
    monkeypatch.delenv("QWEN_MINI_MINE", raising=False)
    pieces = mine.load(folder, only=list(mine.BLOCKS))
    row, table = mine.architecture(model_type, pieces)
    assert any(whose == "learner" for _, whose, _ in table), table
    ours = load_model(model, dtype=torch.bfloat16, arch=row)
    theirs = load_model(model, dtype=torch.bfloat16)
    seen = set()
    for module in ours.modules():  # every block's output, as a later block receives it
        module.register_forward_hook(lambda m, i, o: seen.add(getattr(o, "dtype", None)))
    ids = torch.tensor([[9707, 11, 1879, 0, 576, 6722, 315, 9625, 374, 12095]])
    with torch.no_grad():
        got, expected = ours(ids), theirs(ids)
    assert seen - {None} == {torch.bfloat16}
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


if __name__ == "__main__":  # the filled notebooks, to open in JupyterLab: python ... FOLDER
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for solution in SOLUTIONS:
        (out / solution.name).write_text(nbs.dumps(answered(solution)), encoding="utf-8")
