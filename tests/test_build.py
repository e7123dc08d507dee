"""The course builder on a copy of the fixture chapter (tests/fixtures/solutions)."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from qwen_mini.course import build
from qwen_mini.course import notebooks as nbs

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "solutions" / "ch99_fixture.ipynb"
RUFF = build.ruff_executable()


@pytest.fixture
def tree(tmp_path):
    """A repository root holding the fixture chapter and the project's ruff settings."""
    (tmp_path / "solutions").mkdir()
    # ruff sorts `qwen_mini.course` as first-party only if it finds that package
    (tmp_path / "qwen_mini" / "course").mkdir(parents=True)
    (tmp_path / "qwen_mini" / "course" / "__init__.py").write_text("")
    shutil.copy(FIXTURE, tmp_path / "solutions")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def built(tree, capsys):
    assert build.main(["--root", str(tree)]) == 0
    capsys.readouterr()
    return json.loads((tree / "course" / FIXTURE.name).read_text())


def cell(nb, cell_id):
    return next(c for c in nb["cells"] if c["id"] == cell_id)


def write_cells(tree, *sources, name="bad.ipynb"):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s, id=f"c{i}") for i, s in enumerate(sources)]
    nbformat.write(nb, tree / "solutions" / name)


# --- regions -------------------------------------------------------------------------------------


def test_solution_becomes_one_line_at_the_markers_indentation():
    text = (
        "def f(x):\n"
        "    if x:\n"
        "        ### BEGIN SOLUTION\n"
        "        return 1\n"
        "        ### END SOLUTION\n"
        "    ### BEGIN SOLUTION\n"
        "    y = 2\n"
        "    return y\n"
        "    ### END SOLUTION\n"
        "\n"
        'check("ch07.f", f)'
    )
    raise_line = 'raise NotImplementedError("ch07.f: replace this line with your code")'
    assert nbs.learner_source(text, "here") == (
        f'def f(x):\n    if x:\n        {raise_line}\n    {raise_line}\n\ncheck("ch07.f", f)'
    )
    assert nbs.export_source(text, "here") == (
        'def f(x):\n    if x:\n        return 1\n    y = 2\n    return y\n\ncheck("ch07.f", f)'
    )


def test_hidden_tests_are_dropped_from_both_copies():
    text = (
        "x = 1\n\n### BEGIN HIDDEN TESTS\nassert x == 1\n### END HIDDEN TESTS\n\ncheck('ch0.x', x)"
    )
    assert nbs.learner_source(text, "here") == "x = 1\n\ncheck('ch0.x', x)"
    assert nbs.export_source(text, "here") == "x = 1\n\n\ncheck('ch0.x', x)"


@pytest.mark.parametrize(
    "source, problem",
    [
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "line 2: .* cannot nest"),
        ("### BEGIN SOLUTION\n### BEGIN HIDDEN TESTS\n", "line 2: .* cannot nest"),
        ("x = 1\n    ### BEGIN SOLUTION\nx = 2", "opened on line 2 is never closed"),
        ("### END SOLUTION", "line 1: .* without a matching BEGIN"),
        ("### BEGIN SOLUTION\n### END HIDDEN TESTS", "the solution region is open"),
    ],
)
def test_bad_markers_name_the_notebook_and_cell(tree, capsys, source, problem):
    write_cells(tree, "x = 1", source)
    assert build.main(["--root", str(tree)]) == 1
    err = capsys.readouterr().err
    assert "solutions/bad.ipynb: cell 1 (id c1)" in err
    assert pytest.importorskip("re").search(problem, err)


# --- learner copies ------------------------------------------------------------------------------


def test_learner_copy(tree, capsys):
    solution = json.loads(FIXTURE.read_text())
    nb = built(tree, capsys)
    nbformat.validate(nbformat.reads(json.dumps(nb), as_version=4))
    assert "solution-demo" not in [c["id"] for c in nb["cells"]]
    assert [c["id"] for c in nb["cells"]] == [
        c["id"] for c in solution["cells"] if "solution-only" not in nbs.tags(c)
    ]
    for c in nb["cells"]:
        text = nbs.source(c)
        assert "### " not in text and "BEGIN" not in text
        assert "execution" not in c["metadata"]
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None
    assert "return x + 1" not in nbs.source(cell(nb, "add-one"))
    assert 'raise NotImplementedError("ch99.add_one:' in nbs.source(cell(nb, "add-one"))
    assert "assert mean_square" not in nbs.source(cell(nb, "mean-square"))  # hidden test
    assert "YOUR ANSWER HERE" in nbs.source(cell(nb, "why-md"))
    assert cell(nb, "add-one")["metadata"]["tags"] == ["export"]
    assert "widgets" not in nb["metadata"]
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert cell(nb, "intro") == cell(solution, "intro")  # untouched cells stay as they were


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed")
def test_learner_copy_passes_ruff(tree, capsys):
    built(tree, capsys)
    course = tree / "course" / FIXTURE.name
    for args in (["check"], ["format", "--check"]):
        done = subprocess.run([RUFF, *args, str(course)], cwd=tree, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


# --- exported modules ----------------------------------------------------------------------------


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed")
def test_exported_module(tree, capsys):
    built(tree, capsys)
    module = tree / "qwen_mini" / "ch99_fixture.py"
    text = module.read_text()
    assert text.startswith(
        "# Generated from solutions/ch99_fixture.ipynb by python -m qwen_mini.course.build —\n"
        "# edit the notebook, not this file.\n"
    )
    assert "return x + 1" in text and "return x.pow(2).mean(dim)" in text  # solutions kept
    assert "### " not in text and "check(" not in text and "assert mean_square" not in text
    assert "print(" not in text  # only export cells
    for args in (["check"], ["format", "--check"]):
        done = subprocess.run([RUFF, *args, str(module)], cwd=tree, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    namespace = {}
    exec(compile(text, str(module), "exec"), namespace)
    assert namespace["Scale"](3)(2) == 6


def test_export_needs_a_target(tree, capsys):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", id="a")])
    nb.cells[0].metadata["tags"] = ["export"]
    nbformat.write(nb, tree / "solutions" / "ch98_x.ipynb")
    assert build.main(["--root", str(tree)]) == 1
    assert "solutions/ch98_x.ipynb: cells are tagged `export` but" in capsys.readouterr().err


def test_exercise_calls_are_not_exported():
    text = (
        "from qwen_mini.course import check, use\n"
        "def f():\n    check('a.b', 1)  # inside a function: kept\n"
        'check("ch07.f", f)\n'
        'g = use("ch07.f",\n        f)\n'
        "x = 1\n"
    )
    assert build.without_exercise_calls(text, "here") == (
        "def f():\n    check('a.b', 1)  # inside a function: kept\nx = 1\n"
    )


# --- check mode ----------------------------------------------------------------------------------


def test_check_detects_drift(tree, capsys):
    built(tree, capsys)
    assert build.main(["--root", str(tree), "--check"]) == 0
    assert "up to date" in capsys.readouterr().out

    course = tree / "course" / FIXTURE.name
    edited = course.read_text().replace("ch99.add_one: replace", "ch99.add_one: REPLACE")
    course.write_text(edited)
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "course/ edited by hand")  # what CI checks: committed
    solution = tree / "solutions" / FIXTURE.name
    solution.write_text(solution.read_text().replace("return x + 1", "return 1 + x"))
    stale = tree / "course" / "ch97_gone.ipynb"  # the build's copy of a chapter since removed
    shutil.copy(course, stale)
    stale.write_text(nbs.dumps(build.learner_notebook(nbs.load(FIXTURE), FIXTURE.name)))
    files = [p for p in tree.rglob("*") if p.is_file() and ".git" not in p.parts]
    before = {p: p.read_text() for p in files}

    assert build.main(["--root", str(tree), "--check"]) == 1
    out = capsys.readouterr().out
    assert "out of date: course/ch99_fixture.ipynb" in out
    assert "out of date: qwen_mini/ch99_fixture.py" in out
    assert "no source in solutions/: course/ch97_gone.ipynb" in out
    assert "run: python -m qwen_mini.course.build" in out
    assert before == {p: p.read_text() for p in files}  # nothing written

    stale.unlink()
    assert build.main(["--root", str(tree), "--force"]) == 0  # the course copy was edited by hand
    assert "return 1 + x" in (tree / "qwen_mini" / "ch99_fixture.py").read_text()
    assert build.main(["--root", str(tree), "--check"]) == 0


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed")
def test_a_cell_tag_exports_to_a_second_module(tree, capsys):
    nb = nbformat.v4.new_notebook()
    nb.metadata["qwen_mini"] = {"export": "qwen_mini/first.py"}
    nb.cells = [
        nbformat.v4.new_code_cell("def f():\n    return 1", id="a"),
        nbformat.v4.new_code_cell("def g():\n    return 2", id="b"),
        nbformat.v4.new_code_cell("def h():\n    return 3", id="c"),
        nbformat.v4.new_code_cell("print('not exported')", id="d"),
    ]
    nb.cells[0].metadata["tags"] = ["export"]
    nb.cells[1].metadata["tags"] = ["export:qwen_mini/second.py"]
    nb.cells[2].metadata["tags"] = ["export"]
    nbformat.write(nb, tree / "solutions" / "ch98_two.ipynb")
    assert build.main(["--root", str(tree)]) == 0
    capsys.readouterr()
    first = (tree / "qwen_mini" / "first.py").read_text()
    second = (tree / "qwen_mini" / "second.py").read_text()
    assert "def f()" in first and "def h()" in first and "def g()" not in first
    assert "def g()" in second and "def f()" not in second and "print(" not in second
    assert second.startswith("# Generated from solutions/ch98_two.ipynb")
    assert build.main(["--root", str(tree), "--check"]) == 0

    nb.cells[1].metadata["tags"] = ["export:elsewhere/second.py"]
    nbformat.write(nb, tree / "solutions" / "ch98_two.ipynb")
    assert build.main(["--root", str(tree)]) == 1
    assert "export target 'elsewhere/second.py' is not qwen_mini/<x>.py" in capsys.readouterr().err


# --- a learner's work is never overwritten -------------------------------------------------------


def answered(nb):
    """`nb` as a learner leaves it: an answer written, the cell run (output, count), a cell added;
    saved as JupyterLab saves (indent 1, sorted keys)."""
    nb = json.loads(json.dumps(nb))
    add_one = cell(nb, "add-one")
    text = nbs.source(add_one).replace('raise NotImplementedError("ch99.add_one: replace this '
                                       'line with your code")', "return x + 1")  # fmt: skip
    assert text != nbs.source(add_one)
    add_one["source"] = nbs.source_lines(text)
    add_one["execution_count"] = 3
    add_one["outputs"] = [{"name": "stdout", "output_type": "stream", "text": ["passed\n"]}]
    nb["cells"].append(nbformat.v4.new_code_cell("print('my notes')", id="mine"))
    return nbs.dumps(nb)


def two_chapters(tree, capsys):
    """The fixture built as two chapters (ch99 and ch98), then both solutions changed, so that
    both learner copies are out of date."""
    shutil.copy(FIXTURE, tree / "solutions" / "ch98_other.ipynb")
    nb = json.loads(FIXTURE.read_text())
    nb["metadata"]["qwen_mini"]["export"] = "qwen_mini/ch98_other.py"
    (tree / "solutions" / "ch98_other.ipynb").write_text(nbs.dumps(nb))
    built(tree, capsys)
    for path in (tree / "solutions").glob("*.ipynb"):
        path.write_text(path.read_text().replace("Three tiny exercises", "Three small exercises"))
    return tree / "course" / "ch99_fixture.ipynb", tree / "course" / "ch98_other.ipynb"


def test_a_notebook_with_answers_survives_the_build(tree, capsys):
    mine, other = two_chapters(tree, capsys)
    mine.write_text(answered(json.loads(mine.read_text())))
    before = mine.read_bytes()

    assert build.main(["--root", str(tree)]) == 1
    out, err = capsys.readouterr()
    assert mine.read_bytes() == before  # byte for byte
    assert "Three small exercises" in other.read_text()  # the untouched one is regenerated
    assert "wrote course/ch98_other.ipynb" in out and "course/ch99_fixture.ipynb" not in out
    assert "not overwritten: course/ch99_fixture.ipynb" in err
    assert "qwen-mini-course reset ch99" in err and "--force" in err

    assert build.main(["--root", str(tree), "--check"]) == 1  # CI still sees it out of date
    out = capsys.readouterr().out
    assert "out of date: course/ch99_fixture.ipynb (made from an older copy, and holds changes " \
        "of its own" in out  # fmt: skip

    assert build.main(["--root", str(tree), "--force"]) == 0
    capsys.readouterr()
    assert "Three small exercises" in mine.read_text() and "my notes" not in mine.read_text()
    assert build.main(["--root", str(tree), "--check"]) == 0


@pytest.mark.parametrize(
    "change",
    [
        "outputs",  # the notebook was run, nothing written: the outputs are kept too
        "cell deleted",
        "markdown answer",
        "no digest",  # a notebook the build did not write
        "not a notebook",
    ],
)
def test_any_change_of_the_learners_is_kept(tree, capsys, change):
    mine, _ = two_chapters(tree, capsys)
    nb = json.loads(mine.read_text())
    if change == "outputs":
        cell(nb, "assemble")["outputs"] = [
            {"data": {"text/plain": ["tensor([2., 2.])"]}, "execution_count": 1,
             "metadata": {}, "output_type": "execute_result"}
        ]  # fmt: skip
    elif change == "cell deleted":
        nb["cells"] = [c for c in nb["cells"] if c["id"] != "assemble"]
    elif change == "markdown answer":
        cell(nb, "why-md")["source"] = "So that the scale does not grow with the width."
    elif change == "no digest":
        del nb["metadata"]["qwen_mini"][build.DIGEST_KEY]
    text = "{not json" if change == "not a notebook" else nbs.dumps(nb)
    mine.write_text(text)
    assert build.main(["--root", str(tree)]) == 1
    assert mine.read_text() == text
    assert "not overwritten: course/ch99_fixture.ipynb" in capsys.readouterr().err


def test_a_copy_only_opened_and_saved_is_regenerated(tree, capsys):
    """JupyterLab adds kernel details and cell view settings on saving: no work of the learner's."""
    mine, _ = two_chapters(tree, capsys)
    nb = json.loads(mine.read_text())
    nb["metadata"]["language_info"] = {"name": "python", "version": "3.11.2"}
    cell(nb, "add-one")["metadata"]["collapsed"] = True
    nb["cells"][0]["source"] = nbs.source(nb["cells"][0])  # a string, not a list: the same text
    mine.write_text(json.dumps(nb, indent=2))
    assert build.main(["--root", str(tree)]) == 0
    assert "Three small exercises" in mine.read_text()


def test_a_learners_own_notebook_in_course_is_left_alone(tree, capsys):
    built(tree, capsys)
    own = tree / "course" / "my_experiments.ipynb"
    own.write_text(nbs.dumps(nbformat.v4.new_notebook()))
    before = own.read_bytes()
    assert build.main(["--root", str(tree)]) == 0
    assert own.read_bytes() == before and "my_experiments" not in capsys.readouterr().out
    assert build.main(["--root", str(tree), "--check"]) == 0  # the learner's, never CI's
    assert "my_experiments" not in capsys.readouterr().out
    git(tree, "init", "-q")
    git(tree, "add", "course/my_experiments.ipynb")
    git(tree, "commit", "-qm", "a notebook without a source")
    assert build.main(["--root", str(tree), "--check"]) == 1  # committed: CI's tree has it
    assert "no source in solutions/: course/my_experiments.ipynb" in capsys.readouterr().out


def git(root: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.org")  # fmt: skip
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def learners_work(tree: Path) -> Path:
    """course/ as a learner leaves it: an answer, outputs, a cell of their own, a reset's backup
    and a notebook of their own; returns the answered notebook."""
    notebook = tree / "course" / FIXTURE.name
    notebook.write_text(answered(json.loads(notebook.read_text())))
    backups = tree / "course" / ".backups"
    backups.mkdir()
    (backups / "ch99_fixture-20260304-050607.ipynb").write_text(notebook.read_text())
    (tree / "course" / "Untitled.ipynb").write_text(nbs.dumps(nbformat.v4.new_notebook()))
    return notebook


def test_check_judges_the_committed_course_not_the_learners_work(tree, capsys):
    """In a clone a learner works in, the check passes; it fails when what is committed in
    course/ is out of date, whatever the working copies hold."""
    built(tree, capsys)
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "the course")
    notebook = learners_work(tree)
    assert build.main(["--root", str(tree), "--check"]) == 0, capsys.readouterr().out
    assert "up to date" in capsys.readouterr().out

    # the solution changes and is committed, course/ is not rebuilt: CI must see it
    solution = tree / "solutions" / FIXTURE.name
    solution.write_text(solution.read_text().replace("Three tiny exercises", "Three small ones"))
    git(tree, "commit", "-qm", "a solution changed, course/ not rebuilt", "--", "solutions")
    assert build.main(["--root", str(tree), "--check"]) == 1
    out = capsys.readouterr().out
    assert "out of date: course/ch99_fixture.ipynb (its committed copy is out of date" in out
    # a clean clone of that commit fails the same way
    git(tree, "stash", "-q", "--include-untracked")
    assert not build.holds_work(notebook)
    assert build.main(["--root", str(tree), "--check"]) == 1
    assert "out of date: course/ch99_fixture.ipynb\n" in capsys.readouterr().out


def test_check_in_a_downloaded_copy_judges_by_the_copy_the_work_started_from(tree, capsys):
    built(tree, capsys)  # no git: an archive
    learners_work(tree)
    assert build.main(["--root", str(tree), "--check"]) == 0, capsys.readouterr().out
    capsys.readouterr()


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git clone")
def test_check_passes_in_a_clone_of_this_repository_a_learner_works_in(tmp_path, capsys):
    """The committed tree, as a learner leaves it: every course/ notebook answered from
    solutions/ and run (outputs), a reset's backup, a notebook of their own."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], capture_output=True)
    assert archive.returncode == 0, archive.stderr
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "a clone")
    for path in sorted((tmp_path / "course").glob("ch*.ipynb")):
        nb = json.loads(path.read_text())
        for c in nb["cells"]:
            if c["cell_type"] == "code":
                c["execution_count"] = 1
                c["outputs"] = [{"name": "stdout", "output_type": "stream", "text": ["ran\n"]}]
        nb["metadata"]["language_info"] = {"name": "python"}
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    (tmp_path / "course" / ".backups").mkdir()
    shutil.copy(path, tmp_path / "course" / ".backups" / f"{path.stem}-20260304-050607.ipynb")
    shutil.copy(path, tmp_path / "course" / f"{path.stem}.backup-20260304-050607.ipynb")  # older
    assert build.main(["--root", str(tmp_path), "--check"]) == 0, capsys.readouterr().out


def test_digest_covers_the_learners_work_only():
    nb = json.loads(FIXTURE.read_text())
    digest = build.cells_digest(nb)
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    same = json.loads(json.dumps(nb))
    same["metadata"]["kernelspec"] = {"name": "other"}
    same["cells"][0]["metadata"]["scrolled"] = True
    assert build.cells_digest(same) == digest
    for field, value in [("execution_count", 7), ("outputs", [{"output_type": "stream"}]),
                         ("source", "x = 2"), ("attachments", {"a.png": {}})]:  # fmt: skip
        other = json.loads(json.dumps(nb))
        other["cells"][2][field] = value
        assert build.cells_digest(other) != digest, field


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed")
def test_two_notebooks_export_into_one_module(tree, capsys):
    """A later chapter adds a variant to an earlier chapter's module: the module names both
    notebooks, their cells in order, one docstring, the imports hoisted (unused ones dropped),
    and a block another module of the notebook defines is imported from there."""
    first = nbformat.v4.new_notebook()
    first.metadata["qwen_mini"] = {
        "export": "qwen_mini/parts.py",
        "docstrings": {"qwen_mini/parts.py": "Parts, from two chapters."},
    }
    first.cells = [
        nbformat.v4.new_code_cell("import math\nimport json", id="a"),
        nbformat.v4.new_code_cell("class Base:\n    scale = math.pi", id="b"),
    ]
    second = nbformat.v4.new_notebook()
    second.metadata["qwen_mini"] = {"export": "qwen_mini/user.py"}
    second.cells = [
        nbformat.v4.new_code_cell("from qwen_mini.parts import Base", id="c"),
        nbformat.v4.new_code_cell("class Variant(Base):\n    scale = 2.0", id="d"),
        nbformat.v4.new_code_cell("def make():\n    return Variant()", id="e"),
    ]
    for c in first.cells:
        c.metadata["tags"] = ["export"]
    second.cells[0].metadata["tags"] = ["export"]
    second.cells[1].metadata["tags"] = ["export:qwen_mini/parts.py"]
    second.cells[2].metadata["tags"] = ["export"]
    nbformat.write(first, tree / "solutions" / "ch97_a.ipynb")
    nbformat.write(second, tree / "solutions" / "ch98_b.ipynb")
    assert build.main(["--root", str(tree)]) == 0, capsys.readouterr()
    capsys.readouterr()
    parts = (tree / "qwen_mini" / "parts.py").read_text()
    assert parts.startswith(
        "# Generated from solutions/ch97_a.ipynb, solutions/ch98_b.ipynb\n"
        "# by python -m qwen_mini.course.build — edit the notebooks, not this file.\n\n"
        '"""Parts, from two chapters."""\n\nimport math\n\n\nclass Base:'
    )
    assert parts.index("class Base") < parts.index("class Variant(Base)")
    assert "json" not in parts and "from qwen_mini.parts" not in parts  # unused; itself
    user = (tree / "qwen_mini" / "user.py").read_text()
    assert "from qwen_mini.parts import Variant" in user and "class Variant" not in user
    assert build.main(["--root", str(tree), "--check"]) == 0


def test_learner_copies_are_written_as_the_build_makes_them(tree, capsys, tmp_path_factory):
    """What CI runs: the build's learner copies, never course/'s working copies."""
    built(tree, capsys)
    notebook = learners_work(tree)
    out = tmp_path_factory.mktemp("copies")
    assert build.main(["--root", str(tree), "--learner-copies", str(out)]) == 0
    assert "wrote 1 learner notebooks" in capsys.readouterr().out
    assert [p.name for p in out.iterdir()] == [FIXTURE.name]
    assert (out / FIXTURE.name).read_text() == fresh(tree)
    assert (out / FIXTURE.name).read_text() != notebook.read_text()


def fresh(tree):
    return nbs.dumps(
        build.learner_notebook(nbs.load(tree / "solutions" / FIXTURE.name), FIXTURE.name)
    )


def test_the_readme_counts_each_chapters_exercises():
    """The README's count of checked exercises per chapter is the registry's, which is the set
    of exercises each solution notebook checks."""
    import re

    from qwen_mini.course import checking

    readme = " ".join((REPO / "README.md").read_text().split())  # lines may be wrapped anywhere
    found = re.search(
        r"has (\d+) to (\d+) checked exercises \(chapters 0 to 7: ([\d, ]+)\)", readme
    )
    assert found, "README: the sentence with the exercises per chapter is gone"
    counts = [len(checking.exercises(f"ch0{n}")) for n in range(8)]
    assert [int(c) for c in found.group(3).split(", ")] == counts
    assert (int(found.group(1)), int(found.group(2))) == (min(counts), max(counts))
    for n, count in enumerate(counts):  # each solution notebook checks every one of them
        path = next(REPO.glob(f"solutions/ch0{n}_*.ipynb"))
        checked = set(re.findall(rf'check\(\\"(ch0{n}\.\w+)\\"', path.read_text()))
        assert len(checked) == count, (path.name, sorted(checked))
