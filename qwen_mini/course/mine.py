"""Your own qwen_mini: every exercise that passes its public checks in your notebook is kept as
your piece, and later chapters, `qwen-mini-course progress` and `--mine` build on your pieces.

    from qwen_mini.course.mine import mine
    Attention = mine("ch01.Attention")  # your kept one if it still passes, else the package's

A piece is the definition that passed (the function or class, with the helpers of yours it
calls and the imports it needs), written as a small module to a folder of your own:
`~/.qwen-mini/mine/<notebook folder>-<hash>/ch01.Attention.py` (`QWEN_MINI_HOME` moves
`~/.qwen-mini`). Each notebook folder has its own pieces, so two clones, or two students on one
JupyterHub, never share them, and nothing is ever written to `course/`, `solutions/` or the
package. A name the piece takes from another exercise (your Attention calling `repeat_kv`, or
the `apply_rope` this kernel loaded from your chapter-0 piece with `mine()`) is not copied: it
is bound when the piece is loaded, to your piece where that passes, to the package's otherwise,
so pieces chain across notebooks and processes. A given helper of the notebook that the package
also holds is imported from the package. A piece is used only while it loads (every name it
reads is bound; else "yours does not load: NameError: …") and passes its public checks again;
one whose check fails in the notebook is set aside (`ch01.Attention.stopped.py`), never used.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import hashlib
import inspect
import io
import json
import linecache
import math
import os
import pkgutil
import symtable
import sys
import types
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path

import torch

from . import checking, checks

PACKAGE_DIR = Path(checking.__file__).resolve().parents[1]  # the installed qwen_mini/


class NotKept(ValueError):
    """Why a passing exercise cannot be kept as a piece (said to the learner)."""


# --- where pieces live ---------------------------------------------------------------------------


def home() -> Path:
    return Path(os.environ.get("QWEN_MINI_HOME") or Path.home() / ".qwen-mini").expanduser()


def notebook_folder(start: Path | str = ".") -> Path:
    """The folder holding the learner's notebooks: `start`, or its course/ in a clone's root."""
    start = Path(start).expanduser().resolve()
    if not any(start.glob("*.ipynb")) and any((start / "course").glob("*.ipynb")):
        return start / "course"
    return start


def pieces_folder(notebooks: Path | str = ".") -> Path:
    folder = notebook_folder(notebooks)
    key = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    return home() / "mine" / f"{folder.name}-{key}"


# --- keeping a piece (in the learner's kernel, when a check passes) -------------------------------


def all_exercises() -> list[checking.Exercise]:
    """Every chapter's exercises, in chapter order."""
    names = sorted(m.name for m in pkgutil.iter_modules(checks.__path__) if m.name[:2] == "ch")
    return [e for name in names for e in checking.exercises(name)]


def _exercise_objects() -> dict[int, str]:
    """id(reference object) -> exercise id, for every exercise."""
    return {id(e.reference): e.id for e in all_exercises() if e.reference is not None}


def _own_function(obj) -> types.FunctionType | None:
    """A function of `obj`'s own definition: itself, or one of a class's own methods."""
    if isinstance(obj, types.FunctionType):
        return obj
    for value in vars(obj).values() if isinstance(obj, type) else ():
        value = getattr(value, "__func__", getattr(value, "fget", value))
        own = getattr(value, "__qualname__", "").startswith(obj.__qualname__ + ".")
        if isinstance(value, types.FunctionType) and own:
            return value
    return None


def _definition(obj) -> str:
    """The source of `obj`'s top-level def or class statement, decorators included, from the
    cell (or file) that defined it."""
    fn = _own_function(obj)
    if fn is None:
        raise NotKept(f"a {type(obj).__name__} is kept only as the def or class that made it")
    code = fn.__code__
    file = str(Path(code.co_filename).resolve()) if Path(code.co_filename).is_file() else None
    if file and Path(file).is_relative_to(PACKAGE_DIR):
        raise NotKept("it is the package's code, not yours")
    text = "".join(linecache.getlines(code.co_filename))
    try:
        tree = ast.parse(text)
    except SyntaxError:
        tree = None
    for node in tree.body if tree else []:
        ok = isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == obj.__name__
        if ok and node.lineno <= code.co_firstlineno <= node.end_lineno:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return "".join(text.splitlines(keepends=True)[start - 1 : node.end_lineno])
    raise NotKept(f"the source of {obj.__name__} is not available (define it with def or class)")


def _free_names(source: str) -> list[str]:
    """Names `source` reads that it does not define itself, in order of first appearance."""
    table = symtable.symtable(source, "<piece>", "exec")
    local = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    found: dict[str, None] = {}

    def walk(t: symtable.SymbolTable, top: bool) -> None:
        for s in t.get_symbols():
            if s.is_referenced() and (s.is_global() or (top and not s.is_assigned())):
                found[s.get_name()] = None
        for child in t.get_children():
            walk(child, False)

    walk(table, True)
    return [n for n in found if n not in local]


def _is_builtin_like(value) -> bool:
    module = getattr(value, "__module__", "") or ""
    return module in ("builtins", "_io", "io") or module.startswith("IPython")


def _import_line(name: str, value) -> str | None:
    """How a module-level name can be imported again, or None."""
    if isinstance(value, types.ModuleType):
        module = value.__name__
        if module == name:
            return f"import {module}"
        parent, _, leaf = module.rpartition(".")
        return f"from {parent} import {leaf}" if leaf == name else f"import {module} as {name}"
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module in (None, "__main__") or not isinstance(qualname, str) or "." in qualname:
        return None
    if getattr(sys.modules.get(module), qualname, None) is not value:
        return None
    return f"from {module} import {qualname}" + (f" as {name}" if qualname != name else "")


def _package_twin(name: str, value) -> str | None:
    """An import of the package's own copy of `value`, a function or class the notebook defines
    in a given cell that is exported to the package (chapter 4's encode_plain, whose cache is
    a dict of tokenizers): the same definition, statement for statement. None otherwise."""
    if not isinstance(value, types.FunctionType | type) or _own_function(value) is None:
        return None
    try:
        ours = ast.dump(ast.parse(_definition(value)))
    except (NotKept, SyntaxError):
        return None
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("qwen_mini.") or module_name.startswith("qwen_mini.course"):
            continue
        twin = vars(module).get(name) if isinstance(module, types.ModuleType) else None
        if twin is None or getattr(twin, "__module__", None) != module_name:
            continue
        try:
            theirs = ast.dump(ast.parse(inspect.getsource(twin)))
        except (OSError, TypeError, SyntaxError):
            continue
        if theirs == ours:
            return f"from {module_name} import {name}"
    return None


def _literal(value) -> str | None:
    """Python source for a constant (a number, string, dtype, tuple of them), or None."""
    if type(value) is float and not math.isfinite(value):
        return None
    if type(value) in (bool, int, float, str, bytes, type(None)) or isinstance(value, torch.dtype):
        return repr(value)  # a dtype's repr is torch.float32: the piece imports torch
    if type(value) is tuple and all(_literal(v) is not None for v in value):
        return "(" + "".join(_literal(v) + ", " for v in value) + ")"
    return None


def piece_source(exercise_id: str, obj) -> str:
    """The module text that keeps `obj` as the learner's `exercise_id`: its definition, the
    learner's helpers it calls (their definitions too), the imports it needs, and `__uses__`:
    the names it takes from other exercises, bound when the piece is loaded."""
    exercises = _exercise_objects()  # id(reference) -> exercise id
    imports, helpers, uses, seen = ["import torch"], [], {}, {obj.__name__}

    def gather(value) -> str:
        source = _definition(value)
        # each definition's names are those of the module it was made in: a helper copied from
        # a kept piece (your apply_rope, loaded in this kernel) calls that piece's rotate_half
        namespace = _own_function(value).__globals__
        for name in _free_names(source):
            if name in seen:
                continue
            seen.add(name)
            if name not in namespace:
                if hasattr(builtins, name):
                    continue
                raise NotKept(
                    f"it uses `{name}`, which is not defined in this kernel: define it (run its "
                    f"cell), then check again"
                )
            dep = namespace[name]
            if hasattr(builtins, name) and _is_builtin_like(dep):
                continue  # IPython puts its own open() in the namespace
            other = exercises.get(id(dep)) or _passed_as(dep)
            if other and other != exercise_id:
                uses[name] = other  # another exercise: yours or the package's, when loaded
            elif (line := _import_line(name, dep)) is not None:
                imports.append(line)
            elif (line := _package_twin(name, dep)) is not None:
                imports.append(line)  # a given helper of the notebook that the package holds
            elif isinstance(dep, types.FunctionType | type) and _own_function(dep) is not None:
                helpers.append(gather(dep))
            elif (text := _literal(dep)) is not None:
                helpers.append(f"{name} = {text}\n")
            else:
                raise NotKept(
                    f"it uses `{name}`, a {type(dep).__name__} made in another cell: define it "
                    f"inside the exercise's cell, or pass it in as an argument"
                )
        return source

    main = gather(obj)
    when = f"{datetime.now():%Y-%m-%d %H:%M}"
    lines = [
        f"# Your {exercise_id}, kept when it passed its public checks ({when}). Written by\n"
        "# qwen_mini.course.mine: the names in __uses__ are bound when it is loaded, to your\n"
        "# pieces where they pass, to the package's otherwise.\n",
        f"__piece__ = {json.dumps([exercise_id, obj.__name__])}\n",
        f"__uses__ = {json.dumps(uses)}\n",
        "".join(line + "\n" for line in dict.fromkeys(imports)),
        *helpers,
        main,
    ]
    return "\n".join(part for part in lines if part)


# what passed in this kernel: (exercise id, object), so that a piece calling the learner's own
# passing repeat_kv names the exercise instead of copying it
_PASSED: list[tuple[str, object]] = []


def _passed_as(obj) -> str | None:
    return next((x for x, passed in reversed(_PASSED) if passed is obj), None)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # classmates cannot read it
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _keeping() -> bool:
    # CI modes, the grader and nbgrader's runs check notebooks that are not the learner's work;
    # QWEN_MINI_MINE=off turns keeping off (the project's tests of check() itself do)
    off = os.environ.get("QWEN_MINI_MINE", "").strip().lower() == "off"
    return checking.mode() == "learner" and not os.environ.get("NBGRADER_EXECUTION") and not off


def remember(exercise_id: str, obj, result: checking.Result) -> None:
    """What check() and use() report (course/__init__.py tells checking so): a passing answer
    is kept as the learner's piece for later chapters; a kept one is set aside when the
    learner's answer now fails."""
    if result.ok:
        keep(exercise_id, obj)
    elif result.status == "failed":
        set_aside(exercise_id)


def keep(exercise_id: str, obj) -> Path | None:
    """Keep `obj`, which passes, as the learner's piece. Says why, in one line, when it cannot;
    never raises."""
    if not _keeping() or obj is checking.reference(exercise_id):
        return None
    _PASSED.append((exercise_id, obj))
    path = pieces_folder() / f"{exercise_id}.py"
    try:
        text = piece_source(exercise_id, obj)
        _write(path, text)
        (path.parent / "FOLDER").write_text(f"{notebook_folder()}\n", encoding="utf-8")
        return path
    except NotKept as e:
        print(f"  (not kept as your {exercise_id} for later chapters: {e})")
    except (OSError, SyntaxError, RecursionError) as e:
        print(f"  (could not keep your {exercise_id} for later chapters: {e})")
    return None


def set_aside(exercise_id: str) -> None:
    """Called when a check fails: a kept piece is no longer used (renamed, never deleted)."""
    if not _keeping():
        return
    path = pieces_folder() / f"{exercise_id}.py"
    if path.is_file():
        os.replace(path, path.with_name(f"{exercise_id}.stopped.py"))
        print(f"  (your kept {exercise_id} is set aside until this one passes)")


# --- loading pieces ------------------------------------------------------------------------------


@dataclass
class Piece:
    exercise: str
    whose: str  # "learner" or "package"
    obj: object
    note: str = ""  # why the package's stands in


def _load_one(path: Path, resolve) -> object:
    """Execute a piece file with the names of its `__uses__` bound by `resolve(exercise_id)`."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, str(path))
    header = {
        n.targets[0].id: ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
        if n.targets[0].id in ("__piece__", "__uses__")
    }
    exercise_id, name = header["__piece__"]
    namespace = {"__name__": f"qwen_mini_mine.{exercise_id}", "__file__": str(path)}
    namespace.update({n: resolve(x) for n, x in header["__uses__"].items()})
    exec(compile(tree, str(path), "exec"), namespace)
    # a name the piece reads that nothing binds would fail only when that line runs, inside a
    # check, and read as a wrong answer: say now that the piece does not load
    missing = [n for n in _free_names(text) if n not in namespace and not hasattr(builtins, n)]
    if missing:
        raise NameError(
            f"{', '.join(missing)} not defined in {path.name} (keep the piece again: run the "
            f"cell of {exercise_id} and its check)"
        )
    return namespace[name]


def load(notebooks: Path | str = ".", only: list[str] | None = None) -> dict[str, Piece]:
    """The pieces of the exercises `only` names (default: every exercise), and of those they
    use: the learner's where it is kept, loads and passes its public checks again, the
    package's otherwise, with the reason."""
    folder = pieces_folder(notebooks)
    pieces: dict[str, Piece] = {}

    def resolve(exercise_id: str) -> object:
        if exercise_id not in pieces:  # the package's while it loads: a cycle ends there
            pieces[exercise_id] = Piece(exercise_id, "package", checking.reference(exercise_id))
            pieces[exercise_id] = _piece(exercise_id)
        return pieces[exercise_id].obj

    def _piece(exercise_id: str) -> Piece:
        path, ref = folder / f"{exercise_id}.py", checking.reference(exercise_id)
        if not path.is_file():
            stopped = path.with_name(f"{exercise_id}.stopped.py").is_file()
            why = "yours stopped passing in the notebook" if stopped else "not passed yet"
            return Piece(exercise_id, "package", ref, why)
        try:
            obj = _load_one(path, resolve)
        except Exception as e:  # the learner's code: any error means "not usable"
            why = f"yours does not load: {checking.exception_text(e)}"
            return Piece(exercise_id, "package", ref, why)
        with contextlib.redirect_stdout(io.StringIO()):  # what the learner's code prints
            result = checking.run_checks(exercise_id, obj)
        if not result.ok:
            return Piece(exercise_id, "package", ref, f"yours no longer passes: {result.message}")
        # a later piece that calls this one (your Attention calling your apply_rope, loaded in
        # a kernel by mine()) names the exercise instead of copying it
        _PASSED.append((exercise_id, obj))
        return Piece(exercise_id, "learner", obj)

    for exercise_id in only if only is not None else [e.id for e in all_exercises()]:
        resolve(exercise_id)
    return pieces


def mine(exercise_id: str, notebooks: Path | str = "."):
    """Your kept `exercise_id` if it loads and passes, else the package's; says which. In CI's
    modes (QWEN_MINI_CHECKS=solutions or course) always the package's."""
    if not _keeping():
        print(f"→ using the package's {exercise_id} (QWEN_MINI_CHECKS={checking.mode()})")
        return checking.reference(exercise_id)
    piece = load(notebooks, only=[exercise_id])[exercise_id]
    if piece.whose == "learner":
        print(f"✓ using your {exercise_id} (kept from your notebook; it passes its checks)")
    else:
        print(f"→ using the package's {exercise_id}: {piece.note}")
    return piece.obj


# --- a model from your pieces --------------------------------------------------------------------

# the architecture row's blocks an exercise can fill; each replaces the package's block only in
# rows built from that very block (a Qwen3.5 row keeps its zero-centred norm and gated attention)
BLOCKS = {
    "ch00.rms_norm": "norm",
    "ch00.mlp": "mlp",
    "ch01.Attention": "full_attention",
    "ch01.DecoderLayer": "layer",
    "ch01.model_forward": "forward",
    # chapters 2 and 3: Qwen2's attention, and the mixture-of-experts blocks ("moe": the block
    # the row's feed-forward builder makes in its sparse layers)
    "ch02.QKVBiasAttention": "full_attention",
    "ch03.SparseMoeBlock": "moe",
    "ch03.SharedExpertMoeBlock": "moe",
    # chapter 5: Qwen3.5's blocks (listed only for rows built from them)
    "ch05.GatedDeltaNet": "linear_attention",
    "ch05.GatedAttention": "full_attention",
    "ch05.ZeroCentredRMSNorm": "norm",
}
ONLY_WHERE_USED = {"ch05.GatedDeltaNet", "ch05.GatedAttention", "ch05.ZeroCentredRMSNorm"}


def _moe_block(mlp_builder):
    """The mixture-of-experts block class a row's feed-forward builder makes (its `block`
    argument), or None for a builder without one (the dense SwiGLU)."""
    try:
        parameter = inspect.signature(mlp_builder).parameters.get("block")
    except (TypeError, ValueError):
        return None
    return None if parameter is None else parameter.default


def _dense_mlp(mlp_class):
    def dense_mlp(cfg, layer_idx, arch):  # as architectures.dense_mlp, with your MLP
        return mlp_class(cfg.hidden_size, cfg.intermediate_size)

    return dense_mlp


def architecture(model_type: str, pieces: dict[str, Piece]):
    """The row of `model_type` with every block your pieces fill, and [(block, whose, note)]
    saying whose each block is."""
    from qwen_mini import architectures

    row = architectures.ARCHITECTURES[model_type]
    current = {
        "norm": row.norm,
        "mlp": row.mlp,
        "full_attention": row.mixers.get("full_attention"),
        "linear_attention": row.mixers.get("linear_attention"),
        "layer": row.layer,
        "forward": row.forward,
        "moe": _moe_block(row.mlp),
    }
    package = dict(current, mlp=checking.reference("ch00.mlp"))
    if row.mlp is not architectures.dense_mlp:
        package["mlp"] = None  # experts, or another feed-forward: not chapter 0's MLP
    blocks, table = {}, []
    for exercise_id, slot in BLOCKS.items():
        piece = pieces[exercise_id]
        label = f"{slot} ({exercise_id})"
        if package[slot] is not checking.reference(exercise_id):
            if exercise_id in ONLY_WHERE_USED:
                continue
            if slot == "moe" and package[slot] is None:
                note = f"{model_type} has no mixture of experts"
            else:
                note = f"{model_type} has a {slot} of its own"
            table.append((label, "package", note))
            continue
        if piece.whose == "learner" and slot == "moe":
            blocks["mlp"] = partial(row.mlp, block=piece.obj)  # the row's builder, your block
        elif piece.whose == "learner":
            blocks[slot] = _dense_mlp(piece.obj) if slot == "mlp" else piece.obj
        table.append((label, piece.whose, piece.note))
    mixers = {t: blocks.pop(t) for t in ("full_attention", "linear_attention") if t in blocks}
    if mixers:
        blocks["mixers"] = mixers
    return row.with_blocks(**blocks), table


def format_table(rows) -> str:
    """One line per (what, whose, note)."""
    width = max((len(r[0]) for r in rows), default=0)
    mark = {"learner": "yours    ", "package": "package's"}
    return "\n".join(
        f"  {what:<{width}}  {mark[whose]}  {note}".rstrip() for what, whose, note in rows
    )


def progress(pieces: dict[str, Piece]) -> str:
    """Per chapter, whose each exercise is."""
    chapters: dict[str, list] = {}
    for piece in pieces.values():
        chapters.setdefault(piece.exercise.split(".")[0], []).append(piece)
    lines = []
    for chapter, group in chapters.items():
        yours = sum(p.whose == "learner" for p in group)
        lines.append(f"{chapter}: {yours} of {len(group)} exercises are yours")
        rows = [(p.exercise, p.whose, p.note) for p in group]
        lines.append(format_table(rows))
    return "\n".join(lines)
