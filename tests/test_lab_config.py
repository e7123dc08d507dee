"""scripts/hide_test_tools.py: the test tools (nbgrader's JupyterLab and Jupyter Server
extensions, installed with the dev extra) are off in the environment `make lab` runs, and
Jupyter itself says so."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import hide_test_tools  # noqa: E402

JUPYTER = Path(sys.executable).with_name("jupyter")


def listed(command: str, config: Path) -> str:
    """What `jupyter <command> list` says about the config folder `config`."""
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(config))
    done = subprocess.run([str(JUPYTER), *command.split(), "list"], env=env, text=True,
                          capture_output=True, timeout=120)  # fmt: skip
    return done.stdout + done.stderr


@pytest.mark.skipif(not JUPYTER.exists(), reason="jupyter is not installed beside python")
def test_nbgrader_is_off_where_it_was_on(tmp_path):
    # the config folder as pip leaves it: nbgrader's own file enables its server extensions
    enabling = tmp_path / "jupyter_server_config.d" / "nbgrader.json"
    enabling.parent.mkdir()
    server = dict.fromkeys(hide_test_tools.SERVER_EXTENSIONS, True)
    enabling.write_text(json.dumps({"ServerApp": {"jpserver_extensions": server}}))
    (tmp_path / "labconfig").mkdir()
    (tmp_path / "labconfig" / "page_config.json").write_text('{"other": 1}')
    assert hide_test_tools.main(["--config-dir", str(tmp_path)]) == 0
    assert hide_test_tools.main(["--config-dir", str(tmp_path)]) == 0  # run twice: the same
    page = json.loads((tmp_path / "labconfig" / "page_config.json").read_text())
    assert page == {"other": 1, "disabledExtensions": {"@jupyter/nbgrader": True}}

    out = listed("server extension", tmp_path)
    ours = out.split(f"Config dir: {tmp_path}")[1].split("Config dir:")[0]
    for name in hide_test_tools.SERVER_EXTENSIONS:  # the folder's own verdict: .d, then root
        assert f"{name} \x1b[31mdisabled" in ours or f"{name} disabled" in ours, ours
    assert "enabled" not in ours, ours
    out = listed("labextension", tmp_path)
    if "@jupyter/nbgrader v" in out:  # installed here: JupyterLab reports it off
        line = next(x for x in out.splitlines() if "@jupyter/nbgrader v" in x)
        assert "disabled" in line, out
