"""Regenerate the learner notebooks (`course/`) and the exported modules from `solutions/`.

    python -m qwen_mini.course.build           # write what is out of date
    python -m qwen_mini.course.build --check   # change nothing; exit 1 listing what is out of date
    python -m qwen_mini.course.build --force   # also overwrite learner notebooks that were changed

A solution notebook is the single source of truth. Its learner copy keeps every cell except
those tagged `solution-only`; each `### BEGIN SOLUTION` … `### END SOLUTION` region becomes one
`raise NotImplementedError(...)` line and `### BEGIN HIDDEN TESTS` regions disappear; outputs,
execution counts and widget state are cleared and the kernelspec is normalised. Cells tagged
`export` are written, solutions included, into the module named by the notebook metadata
`{"qwen_mini": {"export": "qwen_mini/<module>.py"}}`; a cell tagged `export:qwen_mini/<other>.py`
goes to that module instead (one chapter can export to several modules, and several chapters to
one module, in the order of their names). Each module is then sorted and formatted by ruff.

A learner's work is never overwritten: each learner copy records a digest of its cells in its
metadata, and a `course/` notebook whose cells no longer match it (answers, outputs, added cells)
or that has none (a notebook the build did not write) is left as it is; the build says so and
exits 1 (`qwen-mini-course reset chNN` starts a chapter over, keeping a backup; `--force`
overwrites).
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from . import notebooks as nbs
from .notebooks import NotebookError

ROOT = Path(__file__).resolve().parents[2]
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
GENERATED = "# Generated from solutions/"
CHECKING = "qwen_mini.course.checking"
# per-cell metadata that records a past execution rather than anything about the cell
EXECUTION_METADATA = ("execution", "ExecuteTime")


# --- learner copies ------------------------------------------------------------------------------


def learner_notebook(nb: dict, name: str) -> dict:
    """The learner copy of solution notebook `nb` (file name `name`)."""
    out = copy.deepcopy(nb)
    ids = [nbs.check_ids(nbs.source(c)) for c in nb["cells"]]
    cells = []
    for i, cell in enumerate(out["cells"]):
        if "solution-only" in nbs.tags(cell):
            continue
        text = nbs.source(cell)
        if nbs.has_markers(text):
            # a region with no check in its own cell is usually the one checked just below it
            later = [x for found in ids[i + 1 :] for x in found]
            place = nbs.where(f"solutions/{name}", i, cell)
            code = cell.get("cell_type") == "code"
            text = nbs.learner_source(text, place, code=code, fallback_id=(later or [""])[0])
        cell["source"] = nbs.source_lines(text)
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
        for key in EXECUTION_METADATA:
            cell.get("metadata", {}).pop(key, None)
        cells.append(cell)
    out["cells"] = cells
    meta = out.setdefault("metadata", {})
    meta.pop("widgets", None)
    meta["kernelspec"] = dict(KERNELSPEC)
    meta.setdefault("qwen_mini", {})[DIGEST_KEY] = cells_digest(out)
    return out


# --- telling a fresh learner copy from a learner's work ------------------------------------------

DIGEST_KEY = "learner_copy_digest"  # in the notebook metadata's "qwen_mini" entry
# what a learner's work changes in a cell; metadata (collapsed, scrolled, timings) holds none
WORK_FIELDS = ("cell_type", "source", "outputs", "execution_count", "attachments")


def cells_digest(nb: dict) -> str:
    """A digest of what a learner can change in `nb`: each cell's type, source, outputs,
    execution count and attachments, in order (a source's list and string forms are equal)."""
    cells = [
        {k: nbs.source(c) if k == "source" else c.get(k) for k in WORK_FIELDS} for c in nb["cells"]
    ]
    text = json.dumps(cells, sort_keys=True, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def holds_work(path: Path, fresh: dict | None = None) -> bool:
    """False for a learner copy that holds none of a learner's work: its cells are those the
    build wrote (the digest it records) or those of `fresh` (the copy the build writes now).
    True for anything else: answers, outputs, cells added or removed, a notebook without a
    digest (one the build did not write), a file that is not a notebook."""
    try:
        nb = nbs.load(path)
    except NotebookError:
        return True
    meta = nb.get("metadata")
    stored = meta.get("qwen_mini", {}) if isinstance(meta, dict) else {}
    recorded = stored.get(DIGEST_KEY) if isinstance(stored, dict) else None
    digest = cells_digest(nb)
    return digest != recorded and (fresh is None or digest != cells_digest(fresh))


def chapter_label(name: str) -> str:
    """How commands name a chapter: "ch03" for ch03_moe.ipynb."""
    return name.split("_")[0].removesuffix(".ipynb")


# --- exported modules ----------------------------------------------------------------------------


EXPORT_TAG = "export:"  # a cell tag naming the module the cell goes to, e.g. export:qwen_mini/x.py


def _valid_target(target: str) -> bool:
    parts = Path(target).parts
    ok_path = len(parts) >= 2 and parts[0] == "qwen_mini" and ".." not in parts
    return ok_path and target.endswith(".py")


def cell_target(cell: dict, default: str | None, place: str) -> str | None:
    """The module a cell is exported to: its `export:<module>` tag, `default` for a plain
    `export` tag, None for a cell that is not exported."""
    named = [t[len(EXPORT_TAG) :] for t in nbs.tags(cell) if t.startswith(EXPORT_TAG)]
    if len(named) > 1:
        raise NotebookError(f"{place}: a cell can be exported to one module, not {named}")
    if named:
        if not _valid_target(named[0]):
            raise NotebookError(f"{place}: export target {named[0]!r} is not qwen_mini/<x>.py")
        return named[0]
    return default if "export" in nbs.tags(cell) else None


def export_target(nb: dict, name: str) -> str | None:
    """The module a notebook exports to ("qwen_mini/foundations.py"), checked; None if none."""
    target = nb.get("metadata", {}).get("qwen_mini", {}).get("export")
    tagged = any("export" in nbs.tags(c) for c in nb["cells"])
    if target is None:
        if tagged:
            raise NotebookError(
                f"solutions/{name}: cells are tagged `export` but the notebook metadata has no "
                '{"qwen_mini": {"export": "qwen_mini/<module>.py"}}'
            )
        return None
    if not _valid_target(target):
        raise NotebookError(f"solutions/{name}: export target {target!r} is not qwen_mini/<x>.py")
    if not tagged:
        raise NotebookError(f"solutions/{name}: exports to {target} but no cell is tagged export")
    return target


def export_targets(nb: dict, name: str) -> list[str]:
    """Every module the notebook exports to, in order of first appearance."""
    default, found = export_target(nb, name), []
    for i, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code":
            continue
        target = cell_target(cell, default, nbs.where(f"solutions/{name}", i, cell))
        if target is not None and target not in found:
            found.append(target)
    return found


def header(names: list[str]) -> str:
    if len(names) == 1:  # two lines: the sentence does not fit in the 100-column limit on one
        return (
            f"# Generated from solutions/{names[0]} by python -m qwen_mini.course.build —\n"
            "# edit the notebook, not this file.\n"
        )
    lines = ["# Generated from"]
    for i, name in enumerate(names):  # wrapped within the 100-column limit
        word = f" solutions/{name}" + ("," if i < len(names) - 1 else "")
        if len(lines[-1]) + len(word) > 100:
            lines.append("#")
        lines[-1] += word
    return (
        "\n".join(lines)
        + "\n# by python -m qwen_mini.course.build — edit the notebooks, not this file.\n"
    )


def _module_name(target: str) -> str:
    return target.removesuffix(".py").replace("/", ".")


def split_imports(text: str) -> tuple[str | None, list[str], str]:
    """(leading docstring or None, top-level import statements, the rest) of a cell's code."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    doc, imports, taken = None, [], set()
    for i, node in enumerate(tree.body):
        is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if i == 0 and is_doc and isinstance(node.value.value, str):
            doc = "".join(lines[node.lineno - 1 : node.end_lineno]).strip()
        elif isinstance(node, ast.Import | ast.ImportFrom):
            imports.append("".join(lines[node.lineno - 1 : node.end_lineno]).strip())
        else:
            continue
        taken.update(range(node.lineno - 1, node.end_lineno))
    rest = "".join(line for n, line in enumerate(lines) if n not in taken).strip("\n")
    return doc, imports, rest


def _defined_names(code: str) -> set[str]:
    names = set()
    for node in ast.parse(code).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _foreign(statement: str, target: str, defined: set[str]) -> bool:
    """Whether an import belongs in module `target`: not an import of the module itself, nor of
    a name the module defines (a notebook imports what an earlier chapter exported there)."""
    node = ast.parse(statement).body[0]
    if isinstance(node, ast.ImportFrom) and node.module == _module_name(target):
        return False
    names = {(a.asname or a.name).split(".")[0] for a in node.names}
    return not names & defined


def module_parts(notebooks: list[tuple[str, dict]], target: str) -> tuple[list, list, list]:
    """(docstrings, imports, code) of the cells that the (name, notebook) pairs export to
    `target`, in order.

    Every top-level import of a notebook's export cells is offered to each module the notebook
    exports to (the notebook's setup cell imports for all of them); ruff later drops the ones a
    module does not use. A module's docstring is the leading string of its first cell, or the
    notebook metadata's `{"qwen_mini": {"docstrings": {target: text}}}`.
    """
    docs, imports, parts = [], [], []
    for name, nb in notebooks:
        default = export_target(nb, name)
        given = nb.get("metadata", {}).get("qwen_mini", {}).get("docstrings", {}).get(target)
        if given:
            docs.append(f'"""{given.strip()}\n"""' if "\n" in given.strip() else f'"""{given}"""')
        for i, cell in enumerate(nb["cells"]):
            place = nbs.where(f"solutions/{name}", i, cell)
            if cell.get("cell_type") != "code":
                continue
            to = cell_target(cell, default, place)
            if to is None:
                continue
            text = without_exercise_calls(nbs.export_source(nbs.source(cell), place), place)
            doc, found, rest = split_imports(text)
            imports += found
            if to == target:
                docs += [doc] if doc else []
                parts += [rest] if rest.strip() else []
    if len(docs) > 1:
        raise NotebookError(f"{target}: more than one module docstring in its notebooks")
    return docs, imports, parts


def _used_names(code: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}


def _imported_names(statements: list[str]) -> set[str]:
    nodes = [ast.parse(s).body[0] for s in statements]
    return {(a.asname or a.name).split(".")[0] for node in nodes for a in node.names}


def module_sources(exporters: dict[str, list[tuple[str, dict]]]) -> dict[str, str]:
    """{target: source before ruff}. A name a module uses but does not define or import, which
    another exported module defines, is imported from there: a chapter that exports a block to
    one module and its user to another needs no import of its own notebook's code."""
    pieces = {t: module_parts(nbs_, t) for t, nbs_ in exporters.items()}
    defined = {t: _defined_names("\n\n".join(p[2])) for t, p in pieces.items()}
    out = {}
    for target, (docs, imports, parts) in pieces.items():
        code = "\n\n".join(parts)
        imports = [s for s in dict.fromkeys(imports) if _foreign(s, target, defined[target])]
        missing = _used_names(code) - defined[target] - _imported_names(imports)
        for other, names in defined.items():
            # a model's module never imports from the course room
            room = other.startswith("qwen_mini/course/") and not target.startswith(
                "qwen_mini/course/"
            )
            wanted = sorted(missing & names) if other != target and not room else []
            if wanted:
                imports.append(f"from {_module_name(other)} import {', '.join(wanted)}")
        top = "\n".join(docs + [""] + imports) if docs else "\n".join(imports)
        names = [name for name, _ in exporters[target]]
        # two blank lines between cells is always valid formatting at the top level
        out[target] = header(names) + "\n" + top + "\n\n\n" + "\n\n\n".join(parts) + "\n"
    return out


def _is_exercise_call(node: ast.AST) -> bool:
    if isinstance(node, ast.Expr | ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Call):
        func = node.value.func
        return isinstance(func, ast.Name) and func.id in ("check", "use")
    if isinstance(node, ast.ImportFrom) and node.module in ("qwen_mini.course", CHECKING):
        return all(alias.name in ("check", "use") for alias in node.names)
    return False


def without_exercise_calls(text: str, place: str) -> str:
    """Drop top-level `check(...)`, `x = use(...)` and their import: no exercises in the package."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise NotebookError(f"{place}: an export cell must be plain Python ({e})") from None
    lines = text.splitlines(keepends=True)
    drop = set()
    for node in tree.body:
        if _is_exercise_call(node):
            drop.update(range(node.lineno - 1, node.end_lineno))
    return "".join(line for n, line in enumerate(lines) if n not in drop).rstrip() + "\n"


def ruff_executable() -> str | None:
    beside = Path(sys.executable).with_name("ruff")
    return str(beside) if beside.exists() else shutil.which("ruff")


def _ruff(args: list[str], text: str, path: Path) -> subprocess.CompletedProcess:
    cmd = [ruff_executable(), *args, "--stdin-filename", str(path), "-"]
    return subprocess.run(cmd, input=text, capture_output=True, text=True, cwd=path.parent)


def ruff_format(text: str, path: Path) -> str:
    """Sort imports, drop unused ones and format, as `ruff check --select I,F401 --fix` and
    `ruff format` would."""
    if ruff_executable() is None:
        print("note: ruff not found; exported modules are written unformatted", file=sys.stderr)
        return text
    for args in (["check", "--select", "I,F401", "--fix", "--quiet"], ["format", "--quiet"]):
        done = _ruff(args, text, path)
        if done.returncode != 0 or not done.stdout:
            raise NotebookError(f"{path}: ruff {args[0]} failed:\n{done.stdout}{done.stderr}")
        text = done.stdout
    return text


def ruff_problems(text: str, path: Path) -> str:
    if ruff_executable() is None:
        return ""
    done = _ruff(["check", "--quiet", "--output-format", "concise"], text, path)
    return "" if done.returncode == 0 else (done.stdout + done.stderr).strip()


# --- the whole tree ------------------------------------------------------------------------------


def expected_files(root: Path) -> dict[Path, str]:
    """{path: text} of every generated file, computed from root/solutions. A module may take
    cells from several notebooks: theirs in the order of the notebooks' names."""
    files, exporters = {}, {}
    for path in sorted((root / "solutions").glob("*.ipynb")):
        nb = nbs.load(path)
        files[root / "course" / path.name] = nbs.dumps(learner_notebook(nb, path.name))
        for target in export_targets(nb, path.name):
            exporters.setdefault(target, []).append((path.name, nb))
    for target, text in module_sources(exporters).items():
        files[root / target] = ruff_format(text, root / target)
    return files


def kept_work(root: Path, expected: dict[Path, str], paths: list[Path]) -> list[Path]:
    """The course/ notebooks among `paths` that hold a learner's work: the build must not
    overwrite them."""
    course = root / "course"
    return [
        p
        for p in paths
        if p.parent == course and p.exists() and holds_work(p, json.loads(expected[p]))
    ]


def stale_files(root: Path, expected: dict[Path, str]) -> list[Path]:
    """Generated files whose solution notebook is gone: course notebooks and marked modules."""
    found = list((root / "course").glob("*.ipynb"))
    for module in (root / "qwen_mini").rglob("*.py"):
        with open(module, encoding="utf-8", errors="replace") as f:
            if f.read(len(GENERATED)) == GENERATED:
                found.append(module)
    return sorted(p for p in found if p not in expected)


def out_of_date(expected: dict[Path, str]) -> list[Path]:
    def current(path: Path) -> str | None:
        return path.read_text(encoding="utf-8") if path.exists() else None

    return [path for path, text in expected.items() if current(path) != text]


# --- what CI checks about course/: the committed copies, not a learner's working copies --------


def committed(root: Path, path: Path) -> str | None:
    """The text of `path` as committed (git's HEAD), or None where there is no such copy: not a
    git clone (a downloaded archive), git missing, or a file never committed."""
    rel = "./" + path.relative_to(root).as_posix()  # ./: relative to root, wherever git's top is
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "show", f"HEAD:{rel}"], capture_output=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode("utf-8", errors="replace") if done.returncode == 0 else None


def _recorded_digest(text: str) -> str | None:
    try:
        meta = json.loads(text).get("metadata", {})
    except (ValueError, AttributeError):
        return None
    stored = meta.get("qwen_mini", {}) if isinstance(meta, dict) else {}
    return stored.get(DIGEST_KEY) if isinstance(stored, dict) else None


def course_problem(root: Path, path: Path, text: str) -> str | None:
    """Why course/ notebook `path` is out of date for the build's check (None: it is not).

    The check is about the committed copies (what every clone starts from), so that a learner's
    answers, outputs and notebooks of their own never fail it: a working copy that holds a
    learner's work is judged by its committed copy where git has one, else by the digest of the
    fresh copy it was made from (a downloaded archive)."""
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return None
    if not path.exists() or not holds_work(path):
        return ""  # the build's own copy, stale: plainly out of date
    base, own = committed(root, path), "holds changes of its own: the build leaves it alone"
    if base is not None:
        if base == text:
            return None  # the learner's work on the committed, up-to-date copy
        if base == path.read_text(encoding="utf-8"):
            return own  # committed as it is
        return f"its committed copy is out of date; the working copy {own}"
    if _recorded_digest(path.read_text(encoding="utf-8")) == cells_digest(json.loads(text)):
        return None  # not committed anywhere: work on the fresh copy the build writes now
    return f"made from an older copy, and {own}"


def stale_problems(root: Path, stale: list[Path]) -> list[Path]:
    """The stale files the check reports: committed ones and those the build wrote. A learner's
    own notebooks in course/ (experiments, old backups) are theirs, never CI's."""
    course = root / "course"
    return [
        p
        for p in stale
        if p.parent != course or not holds_work(p) or committed(root, p) is not None
    ]


def learner_copy(root: Path, name: str) -> dict:
    """The learner copy of solutions/<name> as the build makes it: what course/<name> holds as
    committed (the check sees to it), never a learner's working copy. For tests and tools that
    need a chapter's fresh learner notebook in a clone someone learns in."""
    return learner_notebook(nbs.load(root / "solutions" / name), name)


def write_learner_copies(root: Path, expected: dict[Path, str], out: Path) -> list[Path]:
    """The learner copies as the build makes them (those the check compares with course/'s
    committed copies) written to `out`: what CI runs, never a learner's working copies."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path, text in expected.items():
        if path.parent == root / "course":
            (out / path.name).write_text(text, encoding="utf-8")
            written.append(out / path.name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qwen_mini.course.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    parser.add_argument(
        "--force",
        action="store_true",
        help="overwrite course/ notebooks that hold changes of their own (a learner's answers)",
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    parser.add_argument(
        "--learner-copies",
        type=Path,
        metavar="DIR",
        help="write the learner notebooks as the build makes them to DIR (CI runs those, not "
        "course/'s working copies); change nothing else",
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        expected = expected_files(root)
    except NotebookError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.learner_copies:
        written = write_learner_copies(root, expected, args.learner_copies)
        print(f"wrote {len(written)} learner notebooks to {args.learner_copies}")
        return 0
    changed, stale = out_of_date(expected), stale_files(root, expected)
    kept = [] if args.force else kept_work(root, expected, changed)

    def rel(path: Path) -> str:
        return path.relative_to(root).as_posix()

    if args.check:
        # course/: the committed copies are checked; a learner's working copies are theirs
        problems = {}
        for path in changed:
            why = (
                course_problem(root, path, expected[path]) if path.parent == root / "course" else ""
            )
            if why is not None:
                problems[path] = why
        stale = stale_problems(root, stale)
        for path, why in problems.items():
            print(f"out of date: {rel(path)}" + (f" ({why})" if why else ""))
        for path in stale:
            print(f"no source in solutions/: {rel(path)} (delete it, or restore its notebook)")
        if problems or stale:
            print("run: python -m qwen_mini.course.build")
            return 1
        print(f"up to date: {len(expected)} generated files")
        return 0
    for path in changed:
        if path in kept:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(expected[path], encoding="utf-8")
        print(f"wrote {rel(path)}")
    for path in stale:
        if not holds_work(path):  # one the build wrote; anything else is a learner's own file
            print(f"warning: {rel(path)} has no source in solutions/; delete it if not needed")
    for path in kept:
        print(
            f"not overwritten: {rel(path)} has changes of its own (answers, outputs or cells "
            f"written since it was generated), so it was left as it is. To start it over from "
            f"the fresh copy, keeping yours as a backup: qwen-mini-course reset "
            f"{chapter_label(path.name)}"
            f"; to overwrite it: python -m qwen_mini.course.build --force",
            file=sys.stderr,
        )
    problems = [
        f"{rel(p)}:\n{found}"
        for p, text in expected.items()
        if p.suffix == ".py" and (found := ruff_problems(text, p))
    ]
    for problem in problems:
        print(f"ruff check fails on a generated module — fix the notebook:\n{problem}")
    if not changed:
        print(f"up to date: {len(expected)} generated files")
    return 1 if problems or kept else 0


if __name__ == "__main__":
    sys.exit(main())
