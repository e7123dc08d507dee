"""The sandbox's view of the machine (qwen_mini/course/grading/isolation.py), piece by piece; the
red-team corpus of tests/test_grade.py checks it end to end through `qwen-mini-course grade`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_mini.course.checking import PATH_ENV
from qwen_mini.course.grading import isolation

ROOT = Path(__file__).resolve().parent.parent
ROOTED = os.geteuid() == 0 and sys.platform == "linux"


def test_a_source_checkout_shows_only_its_package(monkeypatch, tmp_path):
    shown = isolation.visible_paths([str(ROOT), "/", "/tmp", ""])
    assert str(ROOT / "qwen_mini") in shown
    assert not [p for p in shown if p in (str(ROOT), "/", "/tmp")]
    assert not [p for p in shown if Path(p) in (ROOT / "solutions", ROOT / "tests")]
    # hidden inside what is shown: the package's check modules, and any extra check folder
    monkeypatch.setenv(PATH_ENV, f"{tmp_path}{os.pathsep}")
    checks = str(ROOT / "qwen_mini" / "course" / "checks")
    assert isolation.hidden_paths() == [checks, str(tmp_path.resolve())]
    assert not (ROOT / "qwen_mini" / "course" / "fakes").is_relative_to(checks)


def test_nested_folders_are_shown_once():
    assert isolation._outermost(["/usr/lib", "/usr", "/usrx", "/a/b", "/a/b/c"]) == [
        "/a/b",
        "/usr",
        "/usrx",
    ]


def _in_child(fn) -> str:
    """What `fn()` returns, run in a forked child (it may switch users, mount, chroot)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.write(w, str(fn()).encode())
        except BaseException as e:
            os.write(w, f"raised {type(e).__name__}: {e}".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


@pytest.mark.skipif(not ROOTED, reason="switching users needs root")
def test_what_the_sandbox_user_cannot_read_is_named(tmp_path):
    closed = tmp_path / "home"
    closed.mkdir(mode=0o700)
    (closed / "tokenizer.json").write_text("{}")
    problem = _in_child(
        lambda: isolation.readable_problem(2_099_999_998, ["/usr", str(closed / "tokenizer.json")])
    )
    assert problem == f"{closed / 'tokenizer.json'}: Permission denied"
    assert _in_child(lambda: isolation.readable_problem(2_099_999_998, ["/usr"])) == ""


@pytest.mark.skipif(not ROOTED, reason="mount namespaces need root")
def test_the_view_shows_a_closed_folder_but_not_its_secrets(tmp_path):
    # a course under a 0700 folder: inside the view the package is readable by another user,
    # its check modules and everything beside it are not there
    closed = tmp_path / "home"
    package = closed / "course" / "pkg"
    package.mkdir(parents=True)
    closed.chmod(0o700)
    (package / "asset.txt").write_text("asset")
    (closed / "course" / "secret.txt").write_text("secret")
    secret_checks = package / "checks"
    secret_checks.mkdir()
    (secret_checks / "ch01.py").write_text("hidden = 1")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    root = tmp_path / "view"
    root.mkdir()

    def look():
        isolation.enter(root, str(cwd), 16, ["/usr", str(package)], [str(secret_checks)])
        os.setgroups([])
        os.setgid(2_099_999_997)
        os.setuid(2_099_999_997)
        seen = [(package / "asset.txt").read_text(), str(os.listdir(secret_checks))]
        seen.append(str(os.path.exists(closed / "course" / "secret.txt")))
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        seen.append(str(pids == [str(os.getpid())]))
        with open(left, "w") as f:  # its own /tmp: gone with it
            f.write("x")
        return " ".join(seen)

    left = f"/tmp/qwen-mini-isolation-left-{os.getpid()}"
    assert _in_child(look) == "asset [] False True"
    assert not os.path.exists(left)


def test_what_a_check_hands_to_the_learners_code_is_never_of_a_check_module():
    # the sandbox cannot import a check module, so it could not unpickle such an object: the
    # grader says where its class belongs instead of grading with a broken copy
    from qwen_mini.course.grading import sandbox

    spy = type("Spy", (), {"__module__": "qwen_mini.course.checks.ch77"})()
    with pytest.raises(TypeError, match="qwen_mini/course/fakes/"):
        sandbox.Connection._by_value(None, spy)
    fake = type("Spy", (), {"__module__": "qwen_mini.course.fakes.ch77"})()
    assert sandbox.byvalue.by_value(fake)


def test_printing_past_the_file_size_limit_is_dropped_not_an_error(tmp_path):
    # a fast machine reaches the worker's file size limit before the time limit: the learner's
    # print must not start raising there (s2_prints_forever in test_grade.py must time out)
    probe = f"""
import os, resource, signal, sys
from qwen_mini.course.grading import worker
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
os.dup2(os.open({str(tmp_path / "out")!r}, os.O_WRONLY | os.O_CREAT), 1)
out = worker._output(1)
for _ in range(500):
    print("still working...", file=out, flush=True)
os.write(2, b"went on")
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, cwd=ROOT)
    assert done.returncode == 0 and done.stderr == b"went on", done.stderr.decode()[-2000:]
    assert (tmp_path / "out").read_bytes() == (b"still working...\n" * 60)[:1000]
