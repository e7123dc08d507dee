"""Reading solution notebooks: cells, tags, solution / hidden-test regions and `check(...)` calls.

Shared by the course builder (`qwen_mini.course.build`) and the grader
(`qwen_mini.course.grading`). Notebooks are handled as plain JSON dicts so that what we write back
is byte-for-byte predictable.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
BEGIN_HIDDEN = "### BEGIN HIDDEN TESTS"
END_HIDDEN = "### END HIDDEN TESTS"
_MARKERS = {
    BEGIN_SOLUTION: ("begin", "solution"),
    END_SOLUTION: ("end", "solution"),
    BEGIN_HIDDEN: ("begin", "hidden tests"),
    END_HIDDEN: ("end", "hidden tests"),
}

# `check("ch01.repeat_kv", ...)`: the id is always a string literal, so a regex finds it even in
# cells that are not valid Python (magics, half-written learner code).
_CHECK_ID = re.compile(r"""(?<![\w.])check\(\s*["']([A-Za-z0-9_]+\.[A-Za-z0-9_.]+)["']""")


class NotebookError(ValueError):
    """A notebook cannot be read or one of its cells is malformed; the message says where."""


def load(path: str | Path) -> dict:
    """The notebook at `path` as a dict; NotebookError if it is not a notebook."""
    path = Path(path)
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotebookError(f"{path}: not a readable notebook ({e})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise NotebookError(f"{path}: not a Jupyter notebook (no list of cells)")
    return nb


def dumps(nb: dict) -> str:
    """Serialise like Jupyter does (indent 1, sorted keys), so saving in JupyterLab is a no-op."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def source_lines(text: str) -> list[str]:
    """The on-disk form of a cell source: a list of lines, each but the last ending in \\n."""
    return text.splitlines(keepends=True)


def tags(cell: dict) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def where(notebook: str | Path, index: int, cell: dict) -> str:
    """How messages name a cell: the notebook, the cell's index and its id."""
    return f"{notebook}: cell {index} (id {cell.get('id', '?')})"


def check_ids(text: str) -> list[str]:
    """Exercise ids of the `check("…", …)` calls in a cell, in order."""
    return _CHECK_ID.findall(text)


def check_calls(text: str) -> dict[str, str]:
    """{exercise id: source of the object passed to check} for the cell's check calls."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    calls = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "check"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            calls[node.args[0].value] = ast.get_source_segment(text, node.args[1])
    return calls


def _regions(text: str, place: str):
    """Yield (kind, indent, lines) chunks: kind is None (plain), "solution" or "hidden tests".

    Raises NotebookError for a nested, unbalanced or unterminated marker, naming `place`.
    """
    open_kind, open_line, indent, chunk = None, 0, "", []
    for n, line in enumerate(text.splitlines(keepends=True), start=1):
        marker = _MARKERS.get(line.strip())
        if marker is None:
            chunk.append(line)
            continue
        action, kind = marker
        if action == "begin":
            if open_kind is not None:
                raise NotebookError(
                    f"{place}: line {n}: {line.strip()!r} inside the {open_kind} region opened "
                    f"on line {open_line}; regions cannot nest"
                )
            yield None, "", chunk
            open_kind, open_line, chunk = kind, n, []
            indent = line[: len(line) - len(line.lstrip())]
        else:
            if open_kind != kind:
                opened = f"the {open_kind} region is open" if open_kind else "no region is open"
                raise NotebookError(
                    f"{place}: line {n}: {line.strip()!r} without a matching BEGIN ({opened})"
                )
            yield kind, indent, chunk
            open_kind, chunk = None, []
    if open_kind is not None:
        raise NotebookError(
            f"{place}: the {open_kind} region opened on line {open_line} is never closed"
        )
    yield None, "", chunk


def has_markers(text: str) -> bool:
    return any(line.strip() in _MARKERS for line in text.splitlines())


def export_source(text: str, place: str) -> str:
    """The package's version of a cell: solutions kept, marker lines and hidden tests dropped."""
    out = []
    for kind, _indent, lines in _regions(text, place):
        if kind != "hidden tests":
            out.extend(lines)
    return _tidy(out)


def without_hidden_tests(text: str, place: str) -> str:
    """`text` with its hidden-test regions dropped and its solution regions kept, markers
    included (nbgrader's source version of a cell that is not an autograder test)."""
    out: list[str] = []
    for kind, indent, lines in _regions(text, place):
        if kind == "solution":
            out += [f"{indent}{BEGIN_SOLUTION}\n", *lines, f"{indent}{END_SOLUTION}\n"]
        elif kind is None:
            out.extend(lines)
    return _tidy(out)


def learner_source(text: str, place: str, *, code: bool = True, fallback_id: str = "") -> str:
    """The learner's version of a cell: each solution region becomes one placeholder line at the
    BEGIN marker's indentation; hidden tests are dropped.

    The placeholder names the exercise of the first `check(...)` after the region in the same
    cell (else the last one before it, else `fallback_id`) so the learner knows what to write.
    """
    out: list[str] = []
    chunks = list(_regions(text, place))
    for i, (kind, indent, lines) in enumerate(chunks):
        if kind is None:
            out.extend(lines)
        elif kind == "solution":
            after = check_ids(
                "".join(line for c in chunks[i + 1 :] if c[0] is None for line in c[2])
            )
            before = check_ids("".join(out))
            exercise = (after[:1] or before[-1:] or [fallback_id])[0]
            out.append(indent + _placeholder(exercise, code) + "\n")
        elif out and not out[-1].strip():
            # a dropped hidden-test block leaves one blank line, not two, between its neighbours
            _skip_blank_lines(chunks, i + 1)
    return _tidy(out)


def _placeholder(exercise: str, code: bool) -> str:
    if not code:
        return "YOUR ANSWER HERE"
    what = f"{exercise}: " if exercise else ""
    return f'raise NotImplementedError("{what}replace this line with your code")'


def _skip_blank_lines(chunks: list, i: int) -> None:
    if i < len(chunks) and chunks[i][0] is None:
        lines = chunks[i][2]
        while lines and not lines[0].strip():
            lines.pop(0)


def _tidy(lines: list[str]) -> str:
    """Join lines, without blank lines at either end and without a final newline (as Jupyter)."""
    text = "".join(lines)
    stripped = text.strip("\n")
    return stripped if stripped.strip() else ""
