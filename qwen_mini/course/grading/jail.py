"""The jail each submission's worker runs in: bubblewrap (`bwrap`, the Debian package
`bubblewrap`), one jail per worker.

A worker runs with new user, pid, network, IPC, UTS and mount namespaces (`--unshare-all`):
it has no network, sees no process but its own (its /proc is its pid namespace's), holds no
capability and runs as an unprivileged user id inside. Its root shows, read-only, only what
Python and the package need: the system folders, the Python installation and the folders on
`sys.path`, and the package itself (from a source checkout, only `qwen_mini/`, its top-level
`assets/` and `pyproject.toml`, never `solutions/` or `tests/`), with its check modules replaced
by an empty folder and the modules of the graded chapter's references by their bytecode. Its
/tmp, /var/tmp and /dev/shm are tmpfs of its own, each capped at the submission's memory
limit, and its folder (the current directory) is a fresh one of its own.
When the jail's first process ends (`--die-with-parent`: also when the grader dies), the kernel
ends every process of its pid namespace: nothing a submission starts outlives it.

Limits, set in the child before `bwrap` is executed: CPU seconds, file size, open files, core
dumps, address space (generous here, tightened by the worker to its memory limit once Python
and torch are loaded, as is the number of processes: see worker.py). Where the machine offers
cgroups the grader may write (cgroup v1, or v2 with the controllers delegated), each worker
also gets a group of its own that caps memory (tmpfs files and shared memory included) and
processes, and gives it one equal share of the CPU however many processes it starts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .plan import GraderError

JAIL_UID = 65534  # the worker's user id inside (nobody); outside it is the grader's
SYSTEM = ["/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt"]
PRIVATE = {"/", "/tmp", "/var", "/var/tmp", "/dev", "/dev/shm", "/proc"}  # never shown whole
SITE = ("site-packages", "dist-packages")  # folders of installed packages, not a checkout
PACKAGE = Path(__file__).resolve().parents[2]  # .../qwen_mini
CHECKS_DIR = PACKAGE / "course" / "checks"  # the chapters' check modules: never shown
FILE_SIZE_LIMIT = 64 * 2**20  # bytes: a submission may write files, but not fill the disk
PROCESS_LIMIT = 64  # processes and threads of a submission (fork bombs)
OPEN_FILES = 1024
START_AS = 16 * 2**30  # address space while Python and torch load (the worker then tightens it)
LOADED_MB = 512  # a worker's memory once Python, torch and the references are loaded
CGROUP = Path("/sys/fs/cgroup")
GROUPS = "qwen-mini-grading"  # the folder of the submissions' cgroups in each hierarchy
KEPT_ENV = {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "MPLBACKEND", "MKL_NUM_THREADS"}

NO_JAIL = """the grader runs every submission in a bubblewrap jail, and it cannot start one here:
  {}
Install bubblewrap (Debian/Ubuntu: `sudo apt-get install bubblewrap`; `make grading-deps` does
it) and allow unprivileged user namespaces (Debian/Ubuntu: `sudo sysctl -w
kernel.unprivileged_userns_clone=1`, Ubuntu 24.04 and later also
`kernel.apparmor_restrict_unprivileged_userns=0`; in a container, run it with user namespaces
allowed). Nothing was graded."""


def visible_paths(path: list[str] | None = None) -> list[str]:
    """The host folders a worker sees, read-only: the system, the Python installation, every
    existing folder on `sys.path` (a source checkout's root contributes only the package and
    its data)."""
    found = [p for p in SYSTEM if os.path.lexists(p)]
    found += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    found.append(os.path.dirname(os.path.realpath(sys.executable)))
    for entry in path if path is not None else [*_worker_path(), str(PACKAGE.parent)]:
        real = os.path.realpath(entry) if entry else "/"
        if real in PRIVATE or not os.path.exists(real):  # never the machine, nor a shared /tmp
            continue
        found.append(str(PACKAGE) if real == str(PACKAGE.parent) else real)
    found.append(str(PACKAGE))
    if PACKAGE.parent.name not in SITE:  # a source checkout: its package data (config.ASSETS)
        for name in ("assets", "pyproject.toml"):  # the top-level assets/, beside pyproject.toml
            if os.path.exists(PACKAGE.parent / name):
                found.append(str(PACKAGE.parent / name))
    found += [os.path.realpath(p) for p in found]  # where a link (a venv's) leads
    return _outermost(found)


@functools.cache
def _worker_path() -> list[str]:
    """The folders on a worker's `sys.path` (`python -I`: not this process's, which a test
    runner or PYTHONPATH may extend), before the worker adds the package's."""
    said = subprocess.run(
        [sys.executable, "-I", "-c", "import sys, json; print(json.dumps(sys.path))"],
        capture_output=True,
        check=True,
        cwd="/",
    )
    return json.loads(said.stdout)


def _outermost(paths: list[str]) -> list[str]:
    """`paths` without those inside another (a bind of the outer one shows them already)."""
    kept: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return sorted(kept)


def _inside(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def hidden_paths() -> list[str]:
    """Folders inside the visible ones that a worker must not read: the package's check modules
    (their hidden cases, generators and mistakes; what a check hands to the learner's code is in
    `qwen_mini/course/fakes/`, which stays visible) and any extra check folder named in the
    environment (test fixtures, an instructor's)."""
    from ..checking import PATH_ENV

    extra = [os.path.realpath(f) for f in os.environ.get(PATH_ENV, "").split(os.pathsep) if f]
    return [str(CHECKS_DIR), *extra]


def command(
    argv: list[str], cwd: str, memory_mb: int, files=(), info_fd=None, sourceless=None
) -> list[str]:
    """`argv` run in a jail (see the module's doc) in `cwd`, a host folder it may write.
    `files`: single files shown read-only even inside a hidden folder (an extra chapter's check
    file that defines its references: the worker loads them, so their source is no secret).
    `sourceless`: {a module's source file: its compiled .pyc}; the jail shows the .pyc beside
    where the source was, and not the source (see `without_sources`)."""
    size = str(memory_mb * 2**20)
    args = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns"]
    args += ["--die-with-parent", "--new-session"]
    args += ["--cap-drop", "ALL", "--uid", str(JAIL_UID), "--gid", str(JAIL_UID)]
    args += ["--hostname", "jail"]
    shown = visible_paths()
    for folder in ("/tmp", "/var/tmp"):  # first: a visible folder may lie in the host's /tmp
        args += ["--size", size, "--tmpfs", folder]
    for path in shown:
        if os.path.islink(path):  # /bin -> usr/bin: the same link (its target is shown too)
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind", path, path]
    replaced = without_sources(sourceless or {}, shown)
    for folder, entries in replaced:  # a folder of its own, its entries bound one by one
        args += ["--tmpfs", folder]
        for source, target in entries:
            args += ["--ro-bind", source, target]
    hidden = [a for p in hidden_paths() if os.path.isdir(p) for a in aliases(p, shown)]
    for path in hidden:  # an empty folder in its place
        args += ["--tmpfs", path]
    for path in files:
        args += ["--ro-bind", path, path]
    for path in hidden + [folder for folder, _ in replaced]:
        args += ["--remount-ro", path]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
    args += ["--bind", cwd, cwd, "--chdir", cwd]
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]
    return [*args, "--", *argv]


def without_sources(sourceless: dict[str, str], shown: list[str]) -> list[tuple[str, list]]:
    """[(folder, [(host path, path in the jail)])]: each visible folder holding a source to
    hide, with everything it holds but those sources, and each one's .pyc in its place (Python
    imports a module from a .pyc with no source beside it). Outer folders first: a folder's
    entries show its subfolders as they are, then a subfolder gets its own."""
    by_folder: dict[str, dict[str, str]] = {}
    for source, compiled in sourceless.items():
        source = os.path.realpath(source)
        if source.endswith(".py"):
            by_folder.setdefault(os.path.dirname(source), {})[os.path.basename(source)] = compiled
    out = []
    for folder, hide in by_folder.items():
        kept = [n for n in sorted(os.listdir(folder)) if n not in hide and not n.endswith(".pyc")]
        for where in aliases(folder, shown):  # wherever the jail shows that folder
            entries = [(os.path.join(folder, n), os.path.join(where, n)) for n in kept]
            entries += [(pyc, os.path.join(where, n[:-3] + ".pyc")) for n, pyc in hide.items()]
            out.append((where, entries))
    return sorted(out, key=lambda item: len(item[0]))


def aliases(path: str, shown: list[str]) -> list[str]:
    """Every path in the jail that shows the host folder `path` (given as its real path): inside
    each shown path whose real path holds it (a folder may be shown twice, as itself and
    through a link in its path)."""
    found = []
    for top in shown:
        if os.path.islink(top):  # the jail has the same link: it shows its target, shown too
            continue
        real = os.path.realpath(top)
        if path == real or path.startswith(real.rstrip("/") + "/"):
            found.append(top + path[len(real) :])
    return sorted(set(found))


def environment(cwd: str) -> dict[str, str]:
    """The worker's environment: nothing of the grader's (a sudo command line, its paths)."""
    keep = {k: v for k, v in os.environ.items() if k in KEPT_ENV or k.startswith(("LC_", "OMP_"))}
    return dict(keep, HOME=cwd, TMPDIR="/tmp", QWEN_MINI_CHECKS="learner", QWEN_MINI_MINE="off")


def require() -> None:
    """Refuse to grade, saying why and what to do, where no jail can be started here."""
    if shutil.which("bwrap") is None:
        raise GraderError(NO_JAIL.format("bwrap is not installed (no `bwrap` on PATH)"))
    probe = command(["true"], "/", 16)
    try:
        done = subprocess.run(probe, capture_output=True, timeout=60, env=environment("/"))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GraderError(NO_JAIL.format(f"bwrap did not run: {e}")) from None
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()[-500:]
        raise GraderError(NO_JAIL.format(said or f"bwrap exited with code {done.returncode}"))


# --- limits --------------------------------------------------------------------------------------


def _hierarchies() -> list[tuple[Path, bool]]:
    """(folder, is cgroup v2) where each submission's group is made: cgroup v1's memory, pids
    and cpu hierarchies, or a cgroup v2 tree whose controllers this process may delegate."""
    v1 = [CGROUP / c for c in ("memory", "pids", "cpu") if (CGROUP / c / "cgroup.procs").exists()]
    if v1:
        return [(folder / GROUPS, False) for folder in v1]
    try:
        if "memory" in (CGROUP / "cgroup.subtree_control").read_text().split():
            return [(CGROUP / GROUPS, True)]
    except OSError:
        pass
    return []


def controllers() -> set[str]:
    """Which of memory, pids and cpu each worker gets a cgroup of (none where the machine
    offers no cgroup this process may write). A memory cgroup counts tmpfs files and shared
    memory with the process's own (without one, each is capped at the limit on its own); a cpu
    cgroup gives each worker one equal share of the CPU however many processes it starts."""
    found = set()
    for parent, v2 in _hierarchies():
        if not v2:
            found.add(parent.parent.name)
            continue
        with contextlib.suppress(OSError):
            found |= set((CGROUP / "cgroup.subtree_control").read_text().split())
    return found & {"memory", "pids", "cpu"}


class Limits:
    """A worker's limits: rlimits for the child before it executes bwrap, and its cgroups
    (none where the machine offers none: skipped quietly; see `memory_counted`)."""

    def __init__(self, name: str, memory_mb: int, cpu_seconds: float):
        self.memory, self.cpu = memory_mb * 2**20, int(cpu_seconds) + 1
        counted = self.memory + LOADED_MB * 2**20  # the group also counts Python and torch
        self.groups: list[Path] = []
        knobs = {
            "memory.limit_in_bytes": counted,  # v1
            "memory.memsw.limit_in_bytes": counted,
            "memory.max": counted,  # v2
            "memory.swap.max": 0,
            "pids.max": PROCESS_LIMIT,
        }
        for parent, v2 in _hierarchies():
            with contextlib.suppress(OSError):
                parent.mkdir(exist_ok=True)
                if v2:  # let the groups below limit memory and processes, and share the CPU
                    wanted = {"memory", "pids", "cpu"}
                    offered = set((parent.parent / "cgroup.subtree_control").read_text().split())
                    wanted &= offered
                    (parent / "cgroup.subtree_control").write_text(
                        " ".join(f"+{c}" for c in sorted(wanted))
                    )
                group = parent / name
                group.mkdir()
                self.groups.append(group)
                for knob, value in knobs.items():
                    if (group / knob).exists():
                        with contextlib.suppress(OSError):
                            (group / knob).write_text(str(value))

    def apply(self) -> None:
        """In the child, before it executes bwrap (which, and all it starts, inherit them)."""
        for group in self.groups:
            (group / "cgroup.procs").write_text("0")
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu, self.cpu + 5))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_AS, (START_AS + self.memory, START_AS + self.memory))

    def remove(self, patience: float = 30.0) -> None:
        """Once the jail is gone: its groups (a group empties as the kernel reaps its last
        processes)."""
        give_up = time.monotonic() + patience
        for group in self.groups:
            while True:
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > give_up:
                        break
                    time.sleep(0.02)


def jail_pid(info: bytes) -> int | None:
    """The pid of the jail's first process (its pid namespace's init), from bwrap's --info-fd."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        pid = json.loads(info.decode())["child-pid"]
        return pid if type(pid) is int and pid > 1 else None
    return None


def stopped(pid: int | None) -> bool:
    """A process of the jail is stopped (SIGSTOP): it will never answer."""
    if pid is None:
        return False
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return False
    for child in children:
        with contextlib.suppress(OSError, IndexError):
            stat = Path(f"/proc/{child}/stat").read_bytes()
            if stat.rsplit(b")", 1)[1].split()[0] in (b"T", b"t"):
                return True
    return False
