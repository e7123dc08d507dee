"""The jail a submission's worker runs in (qwen_mini/course/grading/jail.py: bubblewrap), probed
with small programs run in it exactly as the grader starts a worker; the red-team corpus of
tests/test_grade.py checks it end to end through `qwen-mini-course grade`."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qwen_mini.course.checking import PATH_ENV
from qwen_mini.course.grading import jail
from qwen_mini.course.grading.plan import GraderError

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "qwen_mini" / "course" / "checks"


def _jailed(tmp_path: Path, code: str, memory_mb: int = 64, files=(), sourceless=None) -> dict:
    """What `code` (Python, run in a jail as the grader runs a worker) prints as JSON."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    limits = jail.Limits(f"test-{os.getpid()}-{time.monotonic_ns()}", memory_mb, 30)
    argv = [sys.executable, "-I", "-c", textwrap.dedent(code)]
    try:
        done = subprocess.run(
            jail.command(argv, str(cwd), memory_mb, files, sourceless=sourceless),
            capture_output=True,
            env=jail.environment(str(cwd)),
            preexec_fn=limits.apply,
            timeout=120,
        )
    finally:
        limits.remove()
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return json.loads(done.stdout)


def test_a_source_checkout_shows_only_its_package_and_its_data(monkeypatch, tmp_path):
    shown = jail.visible_paths([str(ROOT), "/", "/tmp", ""])
    assert str(ROOT / "qwen_mini") in shown
    assert not [p for p in shown if p in (str(ROOT), "/", "/tmp")]
    assert not [p for p in shown if Path(p) in (ROOT / "solutions", ROOT / "tests")]
    # hidden inside what is shown: the package's check modules, and any extra check folder
    monkeypatch.setenv(PATH_ENV, f"{tmp_path}{os.pathsep}")
    assert jail.hidden_paths() == [str(CHECKS), str(tmp_path.resolve())]
    assert not (ROOT / "qwen_mini" / "course" / "fakes").is_relative_to(CHECKS)


def test_nested_folders_are_shown_once():
    assert jail._outermost(["/usr/lib", "/usr", "/usrx", "/a/b", "/a/b/c"]) == [
        "/a/b",
        "/usr",
        "/usrx",
    ]


def test_the_jail_has_no_network(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))  # listening here, on the machine's loopback
    try:
        port = server.getsockname()[1]
        seen = _jailed(
            tmp_path,
            f"""
            import json, socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=5)
                got = "connected"
            except OSError as e:
                got = type(e).__name__
            names = [n for _, n in socket.if_nameindex()]
            print(json.dumps({{"connect": got, "interfaces": names}}))
            """,
        )
    finally:
        server.close()
    assert seen["connect"] != "connected" and seen["interfaces"] == ["lo"], seen


def test_the_jail_sees_no_other_process_and_holds_no_privilege(tmp_path):
    seen = _jailed(
        tmp_path,
        """
        import json, os
        caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")]
        print(json.dumps({"pids": sorted(p for p in os.listdir("/proc") if p.isdigit()),
                          "me": os.getpid(), "uid": os.getuid(), "caps": caps,
                          "host": os.uname().nodename}))
        """,
    )
    # pid 1 is the jail's own first process (bwrap's), the parent of the worker
    assert seen["pids"] == ["1", str(seen["me"])], seen
    assert seen["uid"] == jail.JAIL_UID and seen["uid"] != 0 and seen["caps"] == ["0" * 16]
    assert seen["host"] == "jail"


def test_the_jail_writes_only_its_own_folders_and_they_go_with_it(tmp_path):
    left = f"qwen-mini-jail-left-{os.getpid()}"
    seen = _jailed(
        tmp_path,
        f"""
        import json, os
        out = {{}}
        for folder in ("/tmp", "/var/tmp", "/dev/shm", os.getcwd(), {str(ROOT / "qwen_mini")!r},
                       "/usr", os.path.expanduser("~/..")):
            try:
                with open(os.path.join(folder, {left!r}), "w") as f:
                    f.write("x")
                out[folder] = "written"
            except OSError as e:
                out[folder] = type(e).__name__
        print(json.dumps(out))
        """,
    )
    written = {k for k, v in seen.items() if v == "written"}
    home = str(tmp_path / "cwd")  # its folder; the folder above it is on its own /tmp
    assert written == {"/tmp", "/var/tmp", "/dev/shm", home, f"{home}/.."}, seen
    assert seen["/usr"] == seen[str(ROOT / "qwen_mini")] == "OSError", seen  # read-only
    for folder in ("/tmp", "/var/tmp", "/dev/shm", ROOT / "qwen_mini", tmp_path):
        assert not (Path(folder) / left).exists(), folder  # tmpfs of its own: gone


def test_the_checks_and_the_graders_files_are_out_of_reach(tmp_path, monkeypatch):
    extra = tmp_path / "instructor-checks"
    extra.mkdir()
    (extra / "ch77.py").write_text("SECRET = 1\n")
    (extra / "ch78.py").write_text("REFERENCE = 1\n")  # defines a reference: shown on its own
    monkeypatch.setenv(PATH_ENV, str(extra))
    paths = [CHECKS, extra, ROOT / "solutions", ROOT / "tests"]
    paths += [extra / "ch77.py", extra / "ch78.py"]
    seen = _jailed(
        tmp_path,
        f"""
        import json, os
        out = {{}}
        for path in {[str(p) for p in paths]!r}:
            try:
                out[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
            except OSError as e:
                out[path] = type(e).__name__
        print(json.dumps(out))
        """,
        files=[str(extra / "ch78.py")],
    )
    assert list(CHECKS.glob("ch*.py"))  # there, outside
    assert seen[str(CHECKS)] == [], seen
    assert seen[str(extra)] == ["ch78.py"] and seen[str(extra / "ch78.py")] == "REFERENCE = 1\n"
    assert seen[str(extra / "ch77.py")] == "FileNotFoundError"
    assert seen[str(ROOT / "solutions")] == "FileNotFoundError"
    assert seen[str(ROOT / "tests")] == "FileNotFoundError"


def test_a_graded_module_is_bytecode_only_wherever_the_jail_shows_it(tmp_path, monkeypatch):
    """The source of a module that defines a graded reference is replaced by its .pyc, and the
    check modules hidden, also where the package is shown a second time, through a link."""
    import py_compile

    alias = tmp_path / "alias"
    alias.symlink_to(ROOT)
    shown = jail.visible_paths()
    monkeypatch.setattr(jail, "visible_paths", lambda: [*shown, str(alias / "qwen_mini")])
    compiled = tmp_path / "mlp.pyc"
    py_compile.compile(str(ROOT / "qwen_mini" / "mlp.py"), cfile=str(compiled), doraise=True)
    seen = _jailed(
        tmp_path,
        f"""
        import importlib, json, os, sys
        out = {{}}
        for top in {[str(ROOT / "qwen_mini"), str(alias / "qwen_mini")]!r}:
            out[top] = [
                sorted(n for n in os.listdir(top) if n.startswith("mlp")),
                os.listdir(os.path.join(top, "course", "checks")),
            ]
        sys.path.insert(0, {str(ROOT)!r})
        out["module"] = importlib.import_module("qwen_mini.mlp").__file__
        print(json.dumps(out))
        """,
        sourceless={str(ROOT / "qwen_mini" / "mlp.py"): str(compiled)},
    )
    for top in (ROOT / "qwen_mini", alias / "qwen_mini"):
        assert seen[str(top)] == [["mlp.pyc"], []], (top, seen)
    assert seen["module"] == str(ROOT / "qwen_mini" / "mlp.pyc")


def test_the_limits_are_set_before_the_workers_code_runs(tmp_path):
    seen = _jailed(
        tmp_path,
        """
        import json, resource
        print(json.dumps({n: resource.getrlimit(getattr(resource, n))[0]
                          for n in ("RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE",
                                    "RLIMIT_AS")}))
        """,
    )
    assert seen["RLIMIT_FSIZE"] == jail.FILE_SIZE_LIMIT and seen["RLIMIT_NOFILE"] == jail.OPEN_FILES
    assert seen["RLIMIT_CPU"] == 31 and seen["RLIMIT_CORE"] == 0
    assert seen["RLIMIT_AS"] == jail.START_AS + 64 * 2**20


def test_a_memory_cgroup_where_the_machine_has_one():
    if "memory" not in jail.controllers():
        pytest.skip("this machine offers no memory cgroup (README: then tmpfs caps only)")
    name = f"test-{os.getpid()}-{time.monotonic_ns()}"
    limits = jail.Limits(name, 64, 30)
    try:
        # the child (bwrap, and all it starts) is in the group before it runs anything
        said = subprocess.run(
            ["cat", "/proc/self/cgroup"],
            capture_output=True,
            text=True,
            preexec_fn=limits.apply,
            check=True,
        ).stdout
        assert f"qwen-mini-grading/{name}" in said, said
        memory = [g for g in limits.groups if (g / "memory.limit_in_bytes").exists()]
        memory += [g for g in limits.groups if (g / "memory.max").exists()]
        knob = "memory.max" if (memory[0] / "memory.max").exists() else "memory.limit_in_bytes"
        assert int((memory[0] / knob).read_text()) == (64 + jail.LOADED_MB) * 2**20
    finally:
        limits.remove()
    assert not [g for g in limits.groups if g.exists()]


def test_the_jail_dies_with_the_grader(tmp_path):
    # a grader that starts a jail whose process starts another in a session of its own, then
    # is killed: every process of the jail ends with it
    marker = f"qwen-mini-jail-orphan-{os.getpid()}"
    (tmp_path / "cwd").mkdir()
    grader = f"""
import subprocess, sys, time
from qwen_mini.course.grading import jail
inner = "import subprocess, time; subprocess.Popen(['sleep', '300', {marker!r}], " \\
    "start_new_session=True); time.sleep(300)"
cmd = jail.command([sys.executable, "-I", "-c", inner, {marker!r}], {str(tmp_path / "cwd")!r}, 64)
subprocess.Popen(cmd, env=jail.environment({str(tmp_path / "cwd")!r}))
time.sleep(300)
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", grader], env=env, cwd=ROOT)
    try:
        give_up = time.monotonic() + 60
        while len(_with(marker)) < 2 and time.monotonic() < give_up:
            time.sleep(0.2)
        assert len(_with(marker)) == 2  # the worker and its orphan
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    give_up = time.monotonic() + 30
    while _with(marker) and time.monotonic() < give_up:
        time.sleep(0.1)
    assert _with(marker) == []


def _with(marker: str) -> list[str]:
    """The processes whose command line holds `marker`."""
    found = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmd.read_bytes() and b"bwrap" not in cmd.read_bytes():
                found.append(cmd.parent.name)
        except OSError:
            pass
    return found


def test_without_bwrap_the_grader_refuses_and_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(GraderError) as raised:
        jail.require()
    said = str(raised.value)
    assert "bwrap is not installed" in said and "apt-get install bubblewrap" in said
    assert "user namespaces" in said and "Nothing was graded" in said
    # a bwrap that cannot make namespaces (the kernel forbids them): its own words, and what to do
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(GraderError, match="No permissions to create new namespace") as raised:
        jail.require()
    assert "unprivileged_userns_clone" in str(raised.value)


def test_what_a_check_hands_to_the_learners_code_is_never_of_a_check_module():
    # the jail cannot import a check module, so it could not unpickle such an object: the
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
