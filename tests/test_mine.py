"""The learner's own qwen_mini (qwen_mini/course/mine.py): exercises that pass in a notebook are
kept as the learner's pieces, `qwen-mini-course progress` says whose each exercise is, and
`generate` / `chat --mine` run a model built from those pieces.

A learner is played by IPython itself (the shell a Jupyter kernel runs, in a child process):
it runs the setup and exercise cells of the solution notebooks of chapters 0 and 1 in a folder
of notebooks, so every piece comes from cell source, as in JupyterLab. One test runs a real
kernel (nbclient) to cover the kernel's own way of holding cell source.
"""

import io
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from learner import learner_env, run_in_kernel

from qwen_mini.course import checking, mine
from qwen_mini.course.cli import main

pytestmark = pytest.mark.xdist_group("test_mine")  # the learner fixture runs once

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ("ch00_foundations", "ch01_attention")
# every exercise whose cell chapters 0 and 1 check is the learner's
LEARNERS = [e.id for e in mine.all_exercises() if e.id.split(".")[0] in ("ch00", "ch01")]

SHELL = """
import json, sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
for cell in json.loads(sys.stdin.read()):
    result = shell.run_cell(cell)
    if not result.success:
        sys.exit(f"cell failed: {cell[:300]}")
"""


def run_cells(cells: list[str], folder: Path, home: Path, **env) -> str:
    """Run `cells` as a learner's kernel would, in notebook folder `folder`; its output."""
    done = subprocess.run(
        [sys.executable, "-c", SHELL], input=json.dumps(cells), cwd=folder,
        env=learner_env(home, **env), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def exercise_cells(name: str, also: str | None = None) -> list[str]:
    """The setup and exercise cells of solutions/<name>.ipynb, solutions filled in, and those
    whose source holds `also`, in the notebook's order."""
    nb = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text())
    keep = [c for c in nb["cells"] if c["cell_type"] == "code"]
    keep = [c for c in keep if {"setup", "export"} & set(c["metadata"].get("tags", []))
            or any(t.startswith("export:") for t in c["metadata"].get("tags", []))
            or (also and also in "".join(c["source"]))]  # fmt: skip
    return ["".join(c["source"]) for c in keep]


def notebook_folder(tmp: Path, name: str = "course") -> Path:
    folder = tmp / name
    folder.mkdir()
    for chapter in CHAPTERS:  # the learner's notebooks are what marks the folder
        (folder / f"{chapter}.ipynb").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """A learner who has done chapters 0 and 1: (home, notebook folder, the shell's output)."""
    tmp = tmp_path_factory.mktemp("learner")
    home, folder = tmp / "home", notebook_folder(tmp)
    output = run_cells([c for ch in CHAPTERS for c in exercise_cells(ch)], folder, home)
    return home, folder, output


def kept(home: Path, folder: Path) -> Path:
    """Where the pieces of the notebooks in `folder` are kept, under QWEN_MINI_HOME=home."""
    return home / "mine" / mine.pieces_folder(folder).name


@pytest.fixture
def qwen_mini(capsys, monkeypatch):
    """Run the command line in this process: qwen_mini(*args, home=..., stdin=...) gives
    (stdout, stderr); a non-zero exit fails the test."""

    def run(*args, home: Path, stdin: str = ""):
        for key, value in learner_env(home).items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("QWEN_MINI_WEIGHTS", raising=False)
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        return out, err

    return run


def test_every_passing_exercise_is_kept_and_loads_as_the_learners(learner, qwen_mini):
    home, folder, output = learner
    assert "not kept" not in output and "could not keep" not in output, output
    assert sorted(p.stem for p in kept(home, folder).glob("ch*.py")) == sorted(LEARNERS)
    progress = json.loads(qwen_mini("progress", "--json", "--dir", str(folder), home=home)[0])
    assert list(progress) == [e.id for e in mine.all_exercises()]
    assert {x for x, whose in progress.items() if whose == "learner"} == set(LEARNERS)
    assert set(progress.values()) == {"learner", "package"}


def test_a_piece_names_what_it_takes_from_other_exercises(learner, monkeypatch):
    home, folder, _ = learner
    text = (kept(home, folder) / "ch01.Attention.py").read_text()
    uses = json.loads(re.search(r"^__uses__ = (.*)$", text, re.M).group(1))
    # bound when loaded (yours where it passes), never copied into the piece
    assert uses["repeat_kv"] == "ch01.repeat_kv" and uses["apply_rope"] == "ch00.apply_rope"
    assert "def repeat_kv" not in text and "class Attention(nn.Module)" in text
    monkeypatch.setenv("QWEN_MINI_HOME", str(home))
    pieces = mine.load(folder, only=["ch01.Attention"])
    attention = pieces["ch01.Attention"].obj
    assert pieces["ch01.Attention"].whose == "learner"
    assert attention is not checking.reference("ch01.Attention")
    assert attention.__init__.__globals__["repeat_kv"] is pieces["ch01.repeat_kv"].obj
    assert pieces["ch01.repeat_kv"].whose == "learner"


def test_progress_says_whose_each_exercise_is_and_why(learner, qwen_mini):
    home, folder, _ = learner
    out = qwen_mini("progress", "--dir", str(folder.parent), home=home)[0]  # a clone's root
    assert f"your pieces for the notebooks in {folder}" in out
    assert re.search(r"ch01: 14 of 14 exercises are yours", out), out
    assert re.search(r"ch03\.route\s+package's\s+not passed yet", out), out


@pytest.mark.parametrize("model, yours, own", [
    ("Qwen/Qwen3-0.6B", ["norm", "mlp", "full_attention", "layer", "forward"], []),
    # Qwen3.5's norm is zero-centred and its attention gated: the learner's chapter-0/1 ones
    # are not those blocks
    ("Qwen/Qwen3.5-0.8B", ["mlp", "layer", "forward"], ["norm", "full_attention"]),
])  # fmt: skip
def test_generate_mine_runs_the_learners_blocks(learner, qwen_mini, model, yours, own):
    home, folder, _ = learner
    args = ("generate", model, "The capital of France is", "--max-new-tokens", "12")
    args += ("--temperature", "0")
    theirs, _ = qwen_mini(*args, home=home)
    ours, table = qwen_mini(*args, "--mine", "--dir", str(folder), home=home)
    assert ours == theirs and ours.strip()
    for block in yours:
        assert re.search(rf"^  {block} \(ch0[01]\.\w+\)\s+yours$", table, re.M), table
    for block in own:
        assert re.search(rf"^  {block} .*package's\s+qwen3_5 has a {block} of its own", table, re.M)


def test_chat_mine_gives_the_packages_reply(learner, qwen_mini):
    home, folder, _ = learner
    args = ("chat", "Qwen/Qwen3-0.6B", "--no-think", "--temperature", "0")
    args += ("--max-new-tokens", "10")

    def reply(out):  # the transcript without the timing line
        return re.sub(r"\(\d+ tokens.*\)", "", out)

    theirs, _ = qwen_mini(*args, home=home, stdin="Hello!\n")
    ours, table = qwen_mini(*args, "--mine", "--dir", str(folder), home=home, stdin="Hello!\n")
    assert reply(ours) == reply(theirs) and "[answer]" in reply(ours)
    assert re.search(r"^  full_attention \(ch01\.Attention\)\s+yours$", table, re.M)


WRONG_MASK = """
def causal_mask(t_new, t_total, device=None):
    q = torch.arange(t_total - t_new, t_total, device=device)[:, None]
    return torch.arange(t_total, device=device)[None, :] < q  # the diagonal left out
check("ch01.causal_mask", causal_mask)
"""


def test_a_piece_that_stops_passing_is_set_aside_and_never_used(learner, qwen_mini, tmp_path):
    home, folder, _ = learner
    pieces = kept(home, folder)
    saved = {p.name: p.read_bytes() for p in pieces.iterdir()}
    try:
        setup = exercise_cells("ch01_attention")[0]
        out = run_cells([setup, WRONG_MASK], folder, home)
        assert "your kept ch01.causal_mask is set aside" in out
        assert not (pieces / "ch01.causal_mask.py").exists()
        assert (pieces / "ch01.causal_mask.stopped.py").exists()
        progress = qwen_mini("progress", "--dir", str(folder), home=home)[0]
        assert re.search(r"ch01\.causal_mask\s+package's\s+yours stopped passing", progress)
        # the attention that uses it is still the learner's, now over the package's mask
        assert re.search(r"ch01\.Attention\s+yours$", progress, re.M)

        # an edit of the kept file into a wrong state is caught when it is loaded
        path = pieces / "ch01.repeat_kv.py"
        path.write_text(path.read_text().replace("### BEGIN SOLUTION", "return k  #"))
        progress = qwen_mini("progress", "--dir", str(folder), home=home)[0]
        assert re.search(r"ch01\.repeat_kv\s+package's\s+yours no longer passes: ", progress)
    finally:  # the other tests' learner is whole again
        for p in pieces.iterdir():
            p.unlink()
        for name, data in saved.items():
            (pieces / name).write_bytes(data)


ROTATE_WITH_CONSTANTS = """
import torch
HALVES = 2
SIGN = torch.tensor(-1.0)
def rotate_half(x):
    x1, x2 = x.chunk(HALVES, dim=-1)
    return torch.cat((SIGN * x2, x1), dim=-1)
check("ch00.rotate_half", rotate_half)
"""


def test_what_a_piece_cannot_carry_is_said_and_nothing_is_kept(tmp_path):
    home, folder = tmp_path / "home", notebook_folder(tmp_path)
    imports = "from qwen_mini.course import check, use\n"
    out = run_cells([imports, ROTATE_WITH_CONSTANTS], folder, home)
    assert "passed" in out
    assert "not kept as your ch00.rotate_half for later chapters: it uses `SIGN`, a Tensor made " \
           "in another cell" in out  # fmt: skip
    assert not kept(home, folder).joinpath("ch00.rotate_half.py").exists()
    # a number is carried into the piece
    out = run_cells([imports, ROTATE_WITH_CONSTANTS.replace("SIGN * x2", "-x2")], folder, home)
    text = kept(home, folder).joinpath("ch00.rotate_half.py").read_text()
    assert "HALVES = 2" in text and "not kept" not in out


@pytest.mark.parametrize("mode", ["solutions", "course"])
def test_ci_runs_keep_nothing(tmp_path, mode):
    home, folder = tmp_path / "home", notebook_folder(tmp_path)
    cell = ROTATE_WITH_CONSTANTS.replace("SIGN *", "-")  # passes, and could be kept
    # in the course mode a pass raises (a learner copy must not pass): go on after it
    cell = cell.replace("check(", "try:\n    check(") + "except Exception as e:\n    print(e)\n"
    out = run_cells(
        ["from qwen_mini.course import check\n", cell], folder, home, QWEN_MINI_CHECKS=mode
    )
    assert re.search(r"passed (\d+)/\1 public checks", out), (
        out
    )  # every check, whatever their number
    assert not (home / "mine").exists()


def test_two_notebook_folders_never_share_pieces(learner, qwen_mini, tmp_path):
    home, folder, _ = learner
    other = notebook_folder(tmp_path, "course")  # same name, another place: another learner
    assert mine.pieces_folder(other) != mine.pieces_folder(folder)
    progress = json.loads(qwen_mini("progress", "--json", "--dir", str(other), home=home)[0])
    assert set(progress.values()) == {"package"}
    assert oct(kept(home, folder).stat().st_mode & 0o777) == "0o700"


def test_a_real_kernel_keeps_the_piece(tmp_path, qwen_mini):
    home, folder = tmp_path / "home", notebook_folder(tmp_path)
    source = textwrap.dedent("""
        import torch
        from qwen_mini.course import check

        def causal_mask(t_new, t_total, device=None):
            q = torch.arange(t_total - t_new, t_total, device=device)[:, None]
            return torch.arange(t_total, device=device)[None, :] <= q

        check("ch01.causal_mask", causal_mask)
    """)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    run_in_kernel(nb, folder, home, timeout=300)
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert "passed" in text and "not kept" not in text, text
    progress = json.loads(qwen_mini("progress", "--json", "--dir", str(folder), home=home)[0])
    assert progress["ch01.causal_mask"] == "learner"


def test_pieces_chain_across_processes(tmp_path, qwen_mini):
    """Chapter 1's Attention, kept in a kernel that loaded the learner's chapter-0 apply_rope
    (which calls their rotate_half), loads on its own in a later process."""
    home, folder = tmp_path / "home", notebook_folder(tmp_path)
    run_cells(exercise_cells("ch00_foundations"), folder, home)
    # chapter 1's cells in their order, with the one that loads chapter 0's pieces
    out = run_cells(exercise_cells("ch01_attention", also='mine("ch00.'), folder, home)
    assert "✓ using your ch00.apply_rope (kept from your notebook" in out, out
    text = (kept(home, folder) / "ch01.Attention.py").read_text()
    assert re.search(r"^__uses__ = .*\"apply_rope\": \"ch00.apply_rope\"", text, re.M), text
    progress = qwen_mini("progress", "--dir", str(folder), home=home)[0]
    assert re.search(r"ch01\.Attention\s+yours$", progress, re.M), progress

    # a piece kept before this was fixed copied apply_rope without its rotate_half: it says that
    # it does not load, never that it fails a check
    path = kept(home, folder) / "ch01.Attention.py"
    copied = "def apply_rope(x, cos, sin):\n    return rotate_half(x)\n\n\nclass Attention"
    text = text.replace('"apply_rope": "ch00.apply_rope", ', "")
    path.write_text(text.replace("class Attention", copied))
    progress = qwen_mini("progress", "--dir", str(folder), home=home)[0]
    assert re.search(
        r"ch01\.Attention\s+package's\s+yours does not load: NameError: rotate_half not defined",
        progress,
    ), progress
