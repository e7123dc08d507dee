"""Grade a chapter's exercises in submitted notebooks.

    qwen-mini-course grade --chapter 1 --out grades.csv submissions/*.ipynb

Each submission runs in a sandboxed process of its own, as Jupyter would run it: every code cell
in order (magics and shell commands skipped with a note), each with a time limit, the notebook
within a budget. Each exercise is graded on the object its `check(...)` call names (or the name
it defines) by the public and hidden checks, which run in the grader on plain data the sandbox
sends back. The CSV has one row per named input: points and a status per exercise, the total and
the maximum; a JSON report per notebook says why. Rows are written as the run goes. The hidden
checks draw their inputs with the course secret (see --secret-file): a notebook graded again
gets the same grade.

Exit status: 0 when every named input was found and read; 3 when some could not be (their rows
say `unreadable`); 1 when the grader cannot run at all; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import select
import stat
import sys
import tempfile
from pathlib import Path

from .. import checking
from ..mine import home
from ..notebooks import NotebookError
from . import jail as jails
from .plan import ROOT, GraderError, display_name, load_reference, read_submission
from .report import Folder, Grades, csv_text, number, report_name, write_report
from .sandbox import Jail
from .session import Options, grade_notebook

UNREADABLE = 3
SECRET_FILE = "grading-secret"  # in the qwen-mini home (QWEN_MINI_HOME, or ~/.qwen-mini)


def submissions(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """Files as given; folders expand to the names ending in .ipynb inside them (checkpoints
    skipped; a folder or a link of such a name too, to be reported unreadable). A symbolic
    link is never followed, named or found. Also returns the named folders that hold none."""
    found, empty = [], []
    for path in paths:
        if not path.is_dir() or path.is_symlink():
            found.append(path)
            continue
        inside = []
        for folder, folders, files in os.walk(path):  # does not enter linked folders
            folders[:] = [d for d in folders if d != ".ipynb_checkpoints"]
            inside += [Path(folder, n) for n in folders + files if n.endswith(".ipynb")]
        found += sorted(inside)
        if not inside:
            empty.append(path)
    return found, empty


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qwen-mini-course grade",
        description="\n\n".join(__doc__.split("\n\n")[:4]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--chapter", type=int, required=True, help="chapter number, e.g. 1")
    p.add_argument("--out", type=Path, required=True, help="CSV file to write")
    p.add_argument(
        "--reports",
        type=Path,
        help="folder for one JSON report per notebook (default: OUT-reports)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=Options.timeout,
        help=f"seconds per cell and per exercise's checks ({Options.timeout:g})",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=Options.budget,
        help=f"seconds per notebook, all included ({Options.budget:g})",
    )
    p.add_argument(
        "--memory-mb",
        type=int,
        default=Options.memory_mb,
        help=f"memory a submission may use beyond the grader's own ({Options.memory_mb})",
    )
    p.add_argument(
        "--solutions",
        type=Path,
        default=ROOT / "solutions",
        help="folder of reference notebooks (the repository's solutions/)",
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="notebooks graded at once, one core each (1)"
    )
    p.add_argument(
        "--secret-file",
        type=Path,
        help="the course secret the hidden checks draw their inputs with (default: "
        "~/.qwen-mini/grading-secret, or grading-secret in QWEN_MINI_HOME; made on first use)",
    )
    p.add_argument(
        "--new-secret",
        action="store_true",
        help="replace the course secret with a new one before grading (hidden inputs change)",
    )
    p.add_argument("files", nargs="+", type=Path, help="submitted notebooks or folders of them")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        options = build_parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error: argparse has printed the message
        return int(e.code or 0)
    try:
        return _grade_all(options)
    except (GraderError, NotebookError) as e:
        print(f"qwen-mini-course grade: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. --out under a regular file, a full disk, no permission
        where = f"{display_name(Path(str(e.filename)))}: " if e.filename else ""
        print(f"qwen-mini-course grade: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _say(text: str) -> None:
    print(text.encode("utf-8", "backslashreplace").decode("utf-8", "replace"), flush=True)


def _grade_all(options) -> int:
    jails.require()  # no submission runs outside a jail: refuse before anything is graded
    # the hidden inputs: the same for every notebook of this run and of every run with this secret
    checking.new_secret(course_secret(options.secret_file, options.new_secret))
    ref = load_reference(options.solutions, options.chapter)
    files, empty = submissions(options.files)
    reports = options.reports or options.out.with_name(options.out.stem + "-reports")
    settings = Options(timeout=options.timeout, budget=options.budget, memory_mb=options.memory_mb)
    # both folders are opened before any submission runs: nothing it creates can take their place
    csv_folder, report_folder = Folder(options.out.parent), Folder(reports, own=True)
    done: dict[int, Grades] = {}
    used: set[str] = set()
    unreadable = bool(empty)
    for folder in empty:
        _say(f"{display_name(folder)}: no notebooks found in this folder")
    csv_folder.write(options.out.name, csv_text(ref.ids, []))
    said = 0
    for index, grades, error in _graded(files, ref, settings, max(1, options.jobs)):
        unreadable |= bool(error)
        done[index] = grades
        rows = [done[i] for i in sorted(done)]  # in the order given; a killed run keeps these
        csv_folder.write(options.out.name, csv_text(ref.ids, rows))
        while said in done:  # reports and progress lines in the order of the inputs
            graded = done[said]
            write_report(report_folder, report_name(graded.notebook, used), graded, options.chapter)
            _say(_progress(graded))
            said += 1
    _say(f"wrote {display_name(options.out)} and reports in {display_name(reports)}")
    return UNREADABLE if unreadable else 0


def course_secret(path: Path | None, new: bool = False) -> int:
    """The course secret, read from `path` (default: grading-secret in the qwen-mini home),
    made there on first use or, with `new`, made again. It stays the grader's: a file of its
    user that only it can read (mode 0600), read here only, never in a sandbox, which runs as
    another user and sees neither the file nor its folder."""
    path = path or home() / SECRET_FILE
    if new or not os.path.lexists(path):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        os.replace(tmp, path)
    name = display_name(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        why = "is a symbolic link: name the file itself" if path.is_symlink() else e.strerror
        raise GraderError(f"the course secret {name}: {why}") from None
    with open(fd, encoding="ascii", errors="replace") as f:
        st, text = os.fstat(fd), f.read(200).strip()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise GraderError(
                f"the course secret {name} must be a file of yours that only you can read "
                f"(chmod 600 {name}); if others may have read it, replace it with --new-secret"
            )
    if not re.fullmatch(r"[0-9a-f]{64}", text):
        raise GraderError(
            f"{name} is not a course secret (64 hex digits): name another with --secret-file, "
            "or replace it with --new-secret"
        )
    return int(text, 16)


def _progress(grades: Grades) -> str:
    note = f" — {grades.error}" if grades.error else ""
    warn = f" ({len(grades.warnings)} warnings)" if grades.warnings else ""
    return f"{grades.notebook}: {number(grades.total)}/{number(grades.max_total)}{warn}{note}"


def _grade_share(files, indices, ref, settings):
    """Grade files[i] for i in `indices`, each in jails of its own; yield
    (index, grades, read error)."""
    with tempfile.TemporaryDirectory(prefix="qwen-mini-grader-") as tmp:
        cell = Jail(ref.chapter, Path(tmp))
        if cell.exercises != ref.ids:
            raise GraderError(f"the sandbox sees exercises {cell.exercises}, the grader {ref.ids}")
        for i in indices:
            sub = read_submission(files[i], ref.chapter)
            yield i, grade_notebook(sub, ref, cell, settings), sub.error


def _graded(files, ref, settings, jobs: int):
    """(index, grades, read error) as notebooks are graded: here, or with `jobs` > 1 in that
    many forked grading processes, each with its own sandbox, sending results back as JSON."""
    if jobs == 1 or len(files) < 2:
        yield from _grade_share(files, range(len(files)), ref, settings)
        return
    import torch

    drivers = {}
    for k in range(min(jobs, len(files))):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a grading process: its share of the files, one JSON line per notebook
            os.close(r)
            code = 0
            try:
                torch.set_num_threads(1)
                with os.fdopen(w, "w", encoding="utf-8") as out:
                    for i, grades, error in _grade_share(
                        files, range(k, len(files), jobs), ref, settings
                    ):
                        out.write(json.dumps({"i": i, "g": vars(grades), "e": error}) + "\n")
                        out.flush()
            except BaseException as e:
                code = 1
                with contextlib.suppress(OSError):
                    os.write(w, (json.dumps({"fatal": f"{type(e).__name__}: {e}"}) + "\n").encode())
            finally:
                os._exit(code)
        os.close(w)
        drivers[r] = (pid, set(range(k, len(files), jobs)), b"")
    while drivers:
        for fd in select.select(list(drivers), [], [])[0]:
            pid, left, pending = drivers[fd]
            data = os.read(fd, 1 << 20)
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                item = json.loads(line)
                if "fatal" in item:
                    raise GraderError(f"a grading process failed: {item['fatal']}")
                left.discard(item["i"])
                grades = Grades(item["g"]["notebook"], item["g"]["points"])
                vars(grades).update(item["g"])
                yield item["i"], grades, item["e"]
            drivers[fd] = (pid, left, pending)
            if not data:
                os.close(fd)
                del drivers[fd]
                os.waitpid(pid, 0)
                for i in sorted(left):  # the grading process died: these were not graded
                    grades = Grades(display_name(files[i]), {e.id: e.points for e in ref.exercises})
                    for x in ref.ids:
                        grades.set(x, "crashed", "the grading process for this notebook died")
                    yield i, grades, ""
