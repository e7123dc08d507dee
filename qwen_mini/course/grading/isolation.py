"""What a submission's worker sees of the machine, when the grader runs as root on Linux.

Each worker gets private mount and System V IPC namespaces, built in the forked child before it
drops to its own user id. Its root is a fresh tmpfs holding, read-only and at their usual paths,
only what Python and the package need: /usr, /etc and the other system folders, the Python
installation and every folder on `sys.path`, and the package itself (from a source checkout,
only `qwen_mini/`, never `solutions/` or `tests/`), without its check modules (`hidden_paths`).
Its /tmp, /var/tmp and /dev/shm are tmpfs of its own and its System V shared memory lives in its
own namespace: all of it disappears with its last process, and each is capped at the
submission's memory limit. /proc shows only its own
processes (`hidepid=2`: the grader, other submissions and their command lines are invisible).
Because the folders are mounted by root at their own paths, a course installed under a folder
other users cannot enter (a 0700 home) works the same.

Where namespaces cannot be made (not root, a container that forbids them) the worker sees the
machine as its user id does (see `readable_problem`, which the zygote uses to refuse to start
rather than grade with files the worker cannot read).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from pathlib import Path

CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
SYSTEM = ["/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/sys"]
PRIVATE = {"/", "/tmp", "/var", "/var/tmp", "/dev", "/dev/shm", "/proc"}  # never shown whole
SITE = ("site-packages", "dist-packages")  # folders of installed packages, not a checkout
DEVICES = ["null", "zero", "full", "random", "urandom"]
PACKAGE = Path(__file__).resolve().parents[2]  # .../qwen_mini
CHECKS_DIR = PACKAGE / "course" / "checks"  # the chapters' check modules: never shown


GROUPS = "qwen-mini-grading"  # the memory cgroups of submissions


class IsolationError(OSError):
    pass


_libc = None


def _call(name: str, *args) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    encoded = [a.encode() if isinstance(a, str) else a for a in args]
    if getattr(_libc, name)(*encoded) != 0:
        err = ctypes.get_errno()
        raise IsolationError(err, f"{name}{args!r}: {os.strerror(err)}")


def _mount(source, target, fstype, flags: int, data=None) -> None:
    _call("mount", source, str(target), fstype, ctypes.c_ulong(flags), data)


def visible_paths(path: list[str] | None = None) -> list[str]:
    """The host folders a worker sees, read-only: the system, the Python installation, every
    existing folder on `sys.path` (a source checkout's root contributes only the package)."""
    found = [p for p in SYSTEM if os.path.lexists(p)]
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        found.append(prefix)
    found.append(os.path.dirname(os.path.realpath(sys.executable)))
    for entry in path if path is not None else sys.path:
        real = os.path.realpath(entry) if entry else "/"
        if real in PRIVATE or not os.path.exists(real):  # never the machine, nor a shared /tmp
            continue
        if real == str(PACKAGE.parent) and Path(real).name not in SITE:
            found.append(str(PACKAGE))  # a source checkout: the package, not its siblings
        else:
            found.append(real)
    found.append(str(PACKAGE))
    if PACKAGE.parent.name not in SITE:  # a source checkout: its package data (config.ASSETS)
        for name in ("assets", "pyproject.toml"):  # the top-level assets/, beside pyproject.toml
            if os.path.exists(PACKAGE.parent / name):
                found.append(str(PACKAGE.parent / name))
    found += [os.path.realpath(p) for p in found]  # where a link (a venv's) leads
    return _outermost(found)


def _outermost(paths: list[str]) -> list[str]:
    """`paths` without those inside another (a bind of the outer one shows them already)."""
    kept: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return sorted(kept)


def hidden_paths() -> list[str]:
    """Folders inside the visible ones that a worker must not read: the package's check modules
    (their hidden cases, generators and mistakes; what a check hands to the learner's code is in
    `qwen_mini/course/fakes/`, which stays visible) and any extra check folder named in the
    environment (test fixtures, an instructor's). The zygote never imports a check module, and
    hidden cases' inputs are drawn with a secret of the grader's process, per run."""
    from ..checking import PATH_ENV

    extra = [os.path.realpath(f) for f in os.environ.get(PATH_ENV, "").split(os.pathsep) if f]
    return [str(CHECKS_DIR), *extra]


def _bind(source: str, target: Path, writable: bool = False) -> None:
    if os.path.islink(source):  # /bin -> usr/bin: the same link (its target is shown too)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    # /sys without what is mounted on it (the machine's cgroups: every process id)
    _mount(source, target, None, MS_BIND | (0 if source == "/sys" else MS_REC))
    if not writable:
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
        _mount(None, target, None, flags)


def _tmpfs(target: Path, size_mb: int, mode: str = "1777", readonly: bool = False) -> None:
    target.mkdir(parents=True, exist_ok=True)
    flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if readonly else 0)
    _mount("tmpfs", target, "tmpfs", flags, f"size={size_mb}m,mode={mode}")


def enter(
    new_root: Path, cwd: str, memory_mb: int, visible: list[str], hidden: list[str], files=()
):
    """In the forked child, still root: unshare, build the worker's root on `new_root` (an empty
    folder), and chroot into it, in `cwd` (a host folder, kept writable at its own path).
    `files`: single files shown read-only even inside a hidden folder (an extra chapter's check
    file that defines its references: the zygote has loaded it, so its source is no secret)."""
    _call("unshare", CLONE_NEWNS | CLONE_NEWIPC)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    _tmpfs(new_root, 16, mode="755")
    inside = lambda p: new_root / str(p).lstrip("/")  # noqa: E731
    for folder in ("/tmp", "/var/tmp"):  # first: a visible folder may lie in the host's /tmp
        _tmpfs(inside(folder), memory_mb)
    for path in visible:
        _bind(path, inside(path))
    for path in hidden:
        if inside(path).is_dir():
            _tmpfs(inside(path), 1, mode="755", readonly=True)
    for path in files:
        _bind(path, inside(path))
    dev = inside("/dev")
    _tmpfs(dev, 1, mode="755")
    for name in DEVICES:
        _bind(f"/dev/{name}", dev / name, writable=True)
    for name, fd in [("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")]:
        os.symlink("/proc/self/fd" + fd, dev / name)
    _tmpfs(dev / "shm", memory_mb)
    proc = inside("/proc")
    proc.mkdir()
    _mount("proc", proc, "proc", MS_NOSUID | MS_NODEV, "hidepid=2")
    _bind(cwd, inside(cwd), writable=True)
    _limit_shared_memory(proc, memory_mb)
    os.chroot(new_root)
    os.chdir(cwd)


def _limit_shared_memory(proc: Path, memory_mb: int) -> None:
    """System V shared memory of this IPC namespace: at most the memory limit in all."""
    pages = memory_mb * 2**20 // os.sysconf("SC_PAGE_SIZE")
    for name, value in [("shmmax", memory_mb * 2**20), ("shmall", pages), ("shmmni", 64)]:
        (proc / "sys" / "kernel" / name).write_text(str(value))


def _memory_parent() -> Path | None:
    """The memory cgroup folder under which each submission gets a group of its own: cgroup v1's
    memory hierarchy, or a cgroup v2 tree whose memory controller this process may delegate."""
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        return v1 / GROUPS
    v2 = Path("/sys/fs/cgroup")
    try:
        if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            return v2 / GROUPS
    except OSError:
        pass
    return None


def join_memory_group(name: str, limit: int) -> bool:
    """In the forked child, still root: move into a memory cgroup of its own capped at `limit`
    bytes, which counts what RLIMIT_AS does not (tmpfs files, shared memory, page cache).
    False where this machine has no memory cgroup to use."""
    parent = _memory_parent()
    if parent is None:
        return False
    try:
        parent.mkdir(exist_ok=True)
        if (parent / "cgroup.subtree_control").exists():  # v2: let the groups below limit memory
            (parent / "cgroup.subtree_control").write_text("+memory")
        group = parent / name
        group.mkdir()
        for knob in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.max"):
            if (group / knob).exists():
                (group / knob).write_text(str(limit))
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")
        (group / "cgroup.procs").write_text("0")
    except OSError:
        return False
    return True


def leave_memory_group(name: str) -> None:
    """In the zygote, once every process of the submission is gone: remove its group."""
    parent = _memory_parent()
    if parent is not None:
        with contextlib.suppress(OSError):
            (parent / name).rmdir()


def readable_problem(uid: int, paths: list[str]) -> str:
    """In a forked child, as root: switch to `uid`; the first of `paths` it cannot read (and
    why), or "" if it can read them all."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    for path in paths:
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                with open(path, "rb") as f:
                    f.read(1)
        except OSError as e:
            return f"{path}: {e.strerror}"
    return ""
