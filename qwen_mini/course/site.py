"""The course as a static site (`make site`): one page per chapter, from the learner notebooks.

    python -m qwen_mini.course.site            # into build/site/ (open build/site/index.html)

Each notebook of `course/` (the learner copies: prose, figures, exercise statements, and a
`raise NotImplementedError` where each solution goes) is run on the stand-in weights, as a
learner would run it before writing any answer, and the executed copies are rendered by Sphinx
with MyST-NB and the book theme (Jupyter Book 1's stack): a page per chapter, links between them,
a search box, MathJax served from the site itself. Nothing in the site is fetched from the
internet when it is read. The solutions never reach the site: it is built from `course/` only.

Why not Jupyter Book 2: its HTML theme is downloaded at build time from a template server outside
the package registries, so it cannot be built on a machine that reaches PyPI and npm only.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from . import notebooks as nbs

ROOT = Path(__file__).resolve().parents[2]
WIDGET = "application/vnd.jupyter.widget-view+json"
DIAGRAMS = "diagrams"  # the folder of the site's sources that the notebooks' pictures go to
WIDGET_NOTE = (
    "*An interactive view (sliders) is drawn here when the notebook runs in JupyterLab: "
    "`make lab`.*"
)
STILL_NOTE = (
    "*Above: the interactive view at its first settings, as a still picture. Its sliders redraw "
    "it when the notebook runs in JupyterLab: `make lab`.*"
)

CONF = """# Written by python -m qwen_mini.course.site: the Sphinx settings of the course site.
project = "qwen-mini"
author = "the qwen-mini authors"  # the theme prints "By Author name not set" without one
html_title = "qwen-mini: build Qwen3 and Qwen3.5 from scratch"
extensions = ["myst_nb", "sphinx-mathjax-offline"]  # MathJax served from the site
nb_execution_mode = "off"  # the notebooks were run before Sphinx sees them
myst_enable_extensions = ["dollarmath", "amsmath"]
html_theme = "sphinx_book_theme"
html_theme_options = {"show_toc_level": 2, "use_download_button": False}
html_context = {"default_mode": "auto"}  # the theme's script logs an error when none is set
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]  # the notebooks skip levels
html_copy_source = False
"""

INDEX = """# qwen-mini

A course in which you build `qwen_mini`, a small and readable PyTorch package that runs the real
**Qwen3-0.6B** and **Qwen3.5-0.8B**, one architectural idea per chapter.

These pages are the course as a learner first sees it: the explanations, the figures and every
exercise's statement, run on the embedded stand-in weights (tiny models with the real
architecture and tokenizer, trained on a little English from the King James Bible, so generated
text is simple and knows nothing). Where an exercise goes, the code
says `raise NotImplementedError(...)`; the checks after it say "not implemented yet", and the
figures use the package's own pieces. To do the exercises, clone the repository and run
`make lab`.

```{{toctree}}
:maxdepth: 1
:caption: Chapters

{chapters}
```
"""


def title(nb: dict, fallback: str) -> str:
    for cell in nb["cells"]:
        if cell.get("cell_type") == "markdown":
            for line in nbs.source(cell).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


def executed(path: Path, timeout: int) -> dict:
    """`path` run top to bottom in a fresh kernel in a scratch folder (widget state is not
    stored: it needs a live kernel, and the site replaces each view, `static_outputs`)."""
    import tempfile

    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="qwen-mini-site-") as tmp:
        client = NotebookClient(
            nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": tmp}}
        )
        client.store_widget_state = False
        client.execute()
    return nb


def static_outputs(outputs: list) -> list:
    """A cell's outputs with each widget view replaced by what a static page can show: the
    view's default figure where its display carries one (chapter 2's views do), and a note that
    the sliders need JupyterLab."""
    import nbformat

    static = []
    for output in outputs:
        data = output.get("data", {})
        if WIDGET not in data:
            static.append(output)
        elif "image/png" in data:
            still = {"image/png": data["image/png"], "text/plain": "<the view's first figure>"}
            static.append(nbformat.v4.new_output("display_data", data=still))
            static.append(nbformat.v4.new_output("display_data", {"text/markdown": STILL_NOTE}))
        else:
            static.append(nbformat.v4.new_output("display_data", {"text/markdown": WIDGET_NOTE}))
    return static


def attachments_as_files(nb: dict, folder: Path) -> None:
    """Write each markdown cell's attachments (the chapters' diagrams) into `folder` and point
    the cell's `attachment:NAME` links at those files, in place: Sphinx copies an image it finds
    as a file onto the page, and the attachment stays what the learner sees in JupyterLab."""
    import base64

    for cell in nb["cells"]:
        attachments = cell.get("attachments") or {}
        if cell.get("cell_type") != "markdown" or not attachments:
            continue
        text = nbs.source(cell)
        for name, bundle in attachments.items():
            data = next(iter(bundle.values()))  # one picture per name, base64
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(base64.b64decode(data))
            text = text.replace(f"(attachment:{name})", f"({folder.name}/{name})")
        cell["source"] = text
        cell.pop("attachments")


def stamp(path: Path) -> str:
    """What an executed copy of `path` depends on: the notebook, the package and its data, and
    the check mode (QWEN_MINI_CHECKS), Python and torch: a run by `make test` is reused only
    while they are unchanged."""
    digest = hashlib.sha256(path.read_bytes())
    digest.update(os.environ.get("QWEN_MINI_CHECKS", "").encode())
    digest.update(f"{sys.version} torch {importlib.metadata.version('torch')}".encode())
    for folder in (ROOT / "qwen_mini", ROOT / "assets"):
        for file in sorted(folder.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts:
                digest.update(str(file.relative_to(ROOT)).encode() + file.read_bytes())
    return digest.hexdigest()


def _run_one(job: tuple[Path, Path, int]) -> tuple[str, float, str | None]:
    """Run one notebook into `target` (and its stamp beside it); the error, if a cell raised."""
    import nbformat
    from nbclient.exceptions import CellExecutionError

    path, target, timeout = job
    started = time.monotonic()
    key = stamp(path)
    target.with_suffix(".stamp").unlink(missing_ok=True)
    try:
        nb = executed(path, timeout)
    except CellExecutionError as e:  # its text names the cell and holds the traceback
        return path.name, time.monotonic() - started, str(e)
    nbformat.write(nb, target)
    target.with_suffix(".stamp").write_text(key)
    return path.name, time.monotonic() - started, None


def run_all(course: Path, executed_dir: Path, jobs: int, timeout: int) -> list[Path]:
    """Every chapter notebook of `course` run top to bottom into `executed_dir`, skipping one
    whose executed copy there is up to date (its stamp); exits naming each notebook whose cell
    raised. Returns the executed copies."""
    notebooks = sorted(course.glob("ch*.ipynb"))
    if not notebooks:
        raise SystemExit(f"error: no chapter notebooks in {course}")
    executed_dir.mkdir(parents=True, exist_ok=True)
    copies = [executed_dir / p.name for p in notebooks]
    todo = []
    for p, copy in zip(notebooks, copies, strict=True):
        kept = copy.with_suffix(".stamp")
        if kept.is_file() and kept.read_text() == stamp(p):
            print(f"{p.name}: its run in {executed_dir} is up to date", flush=True)
        else:
            todo.append((p, copy, timeout))
    if jobs > 1:  # each kernel on a core of its own
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    failed = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for name, seconds, error in pool.map(_run_one, todo):
            print(f"ran {name} ({seconds:.0f} s){' — a cell raised' if error else ''}", flush=True)
            if error:
                failed.append(f"{name}:\n{error}")
    if failed:
        raise SystemExit("error: a cell raised in " + "\n\n".join(failed))
    return copies


def build(out: Path, course: Path, executed_dir: Path, jobs: int, timeout: int) -> None:
    import nbformat

    src = out.parent / f"{out.name}-src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    copies = run_all(course, executed_dir, jobs, timeout)
    for copy in copies:
        nb = nbformat.read(copy, as_version=4)
        for cell in nb.cells:
            if "outputs" in cell:
                cell["outputs"] = static_outputs(cell["outputs"])
        nb.metadata.pop("widgets", None)
        attachments_as_files(nb, src / DIAGRAMS)
        nbformat.write(nb, src / copy.name)
    chapters = "\n".join(copy.stem for copy in copies)
    (src / "index.md").write_text(INDEX.format(chapters=chapters), encoding="utf-8")
    (src / "conf.py").write_text(CONF, encoding="utf-8")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going"]
    subprocess.run([*cmd, str(src), str(out)], check=True)
    print(f"wrote {out}/index.html")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_mini.course.site", description=__doc__)
    p.add_argument("--out", type=Path, default=ROOT / "build" / "site", help="(build/site)")
    p.add_argument("--course", type=Path, default=ROOT / "course", help="notebooks (course/)")
    p.add_argument(
        "--executed",
        type=Path,
        default=ROOT / "build" / "executed",
        help="where the executed notebooks are kept and reused while up to date (build/executed)",
    )
    p.add_argument(
        "--run-only",
        action="store_true",
        help="only run the notebooks (failing if a cell raises), no site: what `make test` does",
    )
    p.add_argument("--jobs", type=int, default=2, help="notebooks run at once (2)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell (600)")
    args = p.parse_args(argv)
    jobs = max(1, args.jobs)
    if args.run_only:
        run_all(args.course, args.executed.resolve(), jobs, args.timeout)
        return 0
    try:
        build(args.out.resolve(), args.course, args.executed.resolve(), jobs, args.timeout)
    except subprocess.CalledProcessError:
        print("error: Sphinx failed (its messages are above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
