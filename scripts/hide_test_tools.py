"""Keep the test tools out of the learner's JupyterLab.

`make test` installs the dev extra into the environment `make lab` runs, and nbgrader (which the
tests of the nbgrader export run) registers a JupyterLab extension (menus, a side panel) and
four Jupyter Server extensions. This turns them off in the environment's own Jupyter config
(`<venv>/etc/jupyter`, the `--sys-prefix` level); the tests use nbgrader's Python API and
command, never those extensions. Run by the Makefile after installing the dev extra.

    python scripts/hide_test_tools.py [--config-dir DIR]   (default: sys.prefix/etc/jupyter)

Check with `jupyter labextension list` and `jupyter server extension list`.
"""

import argparse
import json
import sys
from pathlib import Path

LAB_EXTENSIONS = ["@jupyter/nbgrader"]
SERVER_EXTENSIONS = [
    "nbgrader.server_extensions.formgrader",
    "nbgrader.server_extensions.validate_assignment",
    "nbgrader.server_extensions.assignment_list",
    "nbgrader.server_extensions.course_list",
]


def merge(path: Path, update: dict) -> None:
    """Merge `update` into the JSON object in `path` (created if missing), one level deep per
    key: other settings in the file are kept."""
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    def deep(into: dict, new: dict) -> None:
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                deep(into[key], value)
            else:
                into[key] = value

    deep(data, update)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-dir", type=Path, default=Path(sys.prefix) / "etc" / "jupyter")
    config = parser.parse_args(argv).config_dir
    # the root file: Jupyter Server reads it after jupyter_server_config.d/, where nbgrader
    # enables its extensions, so it wins
    server = {"ServerApp": {"jpserver_extensions": dict.fromkeys(SERVER_EXTENSIONS, False)}}
    merge(config / "jupyter_server_config.json", server)
    merge(config / "labconfig" / "page_config.json",
          {"disabledExtensions": dict.fromkeys(LAB_EXTENSIONS, True)})  # fmt: skip
    print(f"test tools hidden from JupyterLab: {', '.join(LAB_EXTENSIONS + SERVER_EXTENSIONS)} "
          f"disabled in {config}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
