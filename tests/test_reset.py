"""`qwen-mini-course reset`: a chapter's notebook started over from solutions/, the old copy
kept."""

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from qwen_mini.course import build, mine
from qwen_mini.course import notebooks as nbs
from qwen_mini.course.cli import main
from qwen_mini.course.workspace import WorkspaceError, find_chapter, find_clone, reset

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "solutions" / "ch99_fixture.ipynb"
NOW = datetime(2026, 3, 4, 5, 6, 7)


@pytest.fixture
def clone(tmp_path):
    """A clone holding the fixture chapter (solutions/) and its learner copy with an answer."""
    (tmp_path / "solutions").mkdir()
    (tmp_path / "course").mkdir()
    shutil.copy(FIXTURE, tmp_path / "solutions")
    shutil.copy(REPO / "solutions" / "ch03_moe.ipynb", tmp_path / "solutions")
    fresh = build.learner_notebook(nbs.load(FIXTURE), FIXTURE.name)
    fresh["cells"][0]["source"] = "# my own title"  # the learner's change
    (tmp_path / "course" / FIXTURE.name).write_text(nbs.dumps(fresh))
    return tmp_path


def fresh_text():
    """What the build writes for the fixture chapter: the expected fresh copy."""
    return nbs.dumps(build.learner_notebook(nbs.load(FIXTURE), FIXTURE.name))


@pytest.mark.parametrize(
    "name", ["ch99", "99", "ch99_fixture", "ch99_fixture.ipynb", "course/ch99_fixture.ipynb"]
)
def test_every_way_of_naming_a_chapter(clone, name):
    assert find_chapter(clone, name) == clone / "solutions" / FIXTURE.name
    assert find_chapter(clone, "3") == clone / "solutions" / "ch03_moe.ipynb"


@pytest.mark.parametrize("name", ["ch42", "4", "moe", ""])
def test_an_unknown_chapter_lists_the_chapters(clone, name):
    with pytest.raises(WorkspaceError, match=r"no chapter .* the chapters are: ch03 \(ch03_moe"):
        find_chapter(clone, name)


def test_reset_keeps_the_old_copy_and_never_overwrites_a_backup(clone):
    notebook = clone / "course" / FIXTURE.name
    mine = notebook.read_bytes()
    target, backup = reset(clone, "ch99", now=NOW)
    assert target == notebook and target.read_text() == fresh_text()
    assert backup == clone / "course" / ".backups" / "ch99_fixture-20260304-050607.ipynb"
    assert backup.read_bytes() == mine  # the learner's copy, byte for byte

    notebook.write_text(notebook.read_text().replace("Chapter 99", "My chapter"))
    second = notebook.read_bytes()
    _, again = reset(clone, "99", now=NOW)  # the same second: a new name, the first kept
    assert again == clone / "course" / ".backups" / "ch99_fixture-20260304-050607-2.ipynb"
    assert again.read_bytes() == second and backup.read_bytes() == mine
    assert not build.holds_work(notebook)


def test_a_fresh_or_missing_copy_needs_no_backup(clone):
    notebook = clone / "course" / FIXTURE.name
    notebook.unlink()
    assert reset(clone, "ch99") == (notebook, None)
    assert reset(clone, "ch99") == (notebook, None)  # already fresh: nothing of the learner's
    assert notebook.read_text() == fresh_text()
    assert sorted(p.name for p in (clone / "course").iterdir()) == [FIXTURE.name]


def test_a_broken_solution_changes_nothing(clone):
    notebook = clone / "course" / FIXTURE.name
    before = notebook.read_bytes()
    (clone / "solutions" / FIXTURE.name).write_text("{not json")
    with pytest.raises(WorkspaceError, match="ch99_fixture.ipynb: not a readable notebook"):
        reset(clone, "ch99")
    assert notebook.read_bytes() == before
    assert sorted(p.name for p in (clone / "course").iterdir()) == [FIXTURE.name]


def test_the_clone_is_found_from_course_and_named_when_missing(clone, tmp_path_factory):
    assert find_clone(clone / "course") == clone and find_clone(clone) == clone
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    with pytest.raises(WorkspaceError, match=f"no course/ and solutions/ folders in {elsewhere}"):
        find_clone(elsewhere)


def test_the_command(clone, capsys, monkeypatch, tmp_path_factory):
    assert main(["reset", "ch99", "--dir", str(clone)]) == 0
    out = capsys.readouterr().out
    backup = next((clone / "course" / ".backups").glob("ch99_fixture-*.ipynb"))
    assert f"your old copy is kept as {backup}" in out
    assert f"backups are in {backup.parent}/, a hidden folder" in out
    assert sorted(p.name for p in (clone / "course").iterdir()) == [".backups", FIXTURE.name]
    assert json.loads(backup.read_text())["cells"][0]["source"] == "# my own title"

    monkeypatch.chdir(clone / "course")  # where a JupyterLab terminal starts
    assert main(["reset", "ch99_fixture.ipynb"]) == 0
    assert "had no changes of yours" in capsys.readouterr().out

    assert main(["reset", "ch42", "--dir", str(clone)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qwen-mini-course: error: no chapter 'ch42'") and "Traceback" not in err
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    assert main(["reset", "ch99", "--dir", str(elsewhere)]) == 1
    assert "--dir CLONE" in capsys.readouterr().err


def test_the_repository_itself_resets(tmp_path):
    """In a copy of this clone every chapter resets to exactly its committed learner copy."""
    shutil.copytree(REPO / "solutions", tmp_path / "solutions")
    (tmp_path / "course").mkdir()
    for path in sorted((tmp_path / "solutions").glob("ch*.ipynb")):
        course = REPO / "course" / path.name  # as committed: a learner's answers are theirs
        committed = build.committed(REPO, course) or course.read_text()
        (tmp_path / "course" / path.name).write_text(committed)
        target, backup = reset(tmp_path, path.name)
        assert target.read_text() == committed and backup is None


def test_reset_offers_to_set_the_chapters_pieces_aside(clone, capsys, monkeypatch, tmp_path):
    """The chapter's kept pieces stay in use unless --pieces sets them aside (moved, never
    deleted); the other chapters' pieces are left alone."""
    monkeypatch.setenv("QWEN_MINI_HOME", str(tmp_path / "home"))
    folder = mine.pieces_folder(clone / "course")
    folder.mkdir(parents=True)
    names = ["ch99.add_one.py", "ch99.assemble.stopped.py", "ch03.route.py"]
    for name in names:
        (folder / name).write_text("# a piece\n")
    assert main(["reset", "ch99", "--dir", str(clone)]) == 0
    out = capsys.readouterr().out
    assert f"your 2 kept pieces of ch99 (in {folder}/) are still used by later chapters" in out
    assert "qwen-mini-course reset ch99 --pieces" in out
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)

    assert main(["reset", "ch99", "--pieces", "--dir", str(clone)]) == 0
    out = capsys.readouterr().out
    aside = next(folder.glob("set-aside-ch99-*"))
    assert f"your kept pieces of ch99 are set aside in {aside}/" in out
    assert sorted(p.name for p in aside.iterdir()) == sorted(names[:2])
    assert sorted(p.name for p in folder.iterdir()) == ["ch03.route.py", aside.name]
    assert main(["reset", "ch99", "--pieces", "--dir", str(clone)]) == 0
    assert "(no kept pieces of ch99 to set aside)" in capsys.readouterr().out
