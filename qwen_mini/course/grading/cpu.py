"""A notebook's clock: its time limits count the time it would have taken alone on one core.

Counted in wall time, a notebook's limits depend on its neighbours: with `--jobs 2`, twenty busy
processes started by one submission (each in a session of its own) slow the other notebook's
checks past a tight `--timeout`. So a notebook's clock runs with the wall clock, less

- the time its worker's main thread waited for a CPU that another process held, and the time
  the grader's own thread waited so while it ran the notebook's checks (Linux reports both:
  `/proc/<pid>/schedstat`, "time spent waiting on a runqueue"),

plus the CPU time of every other process of the submission (those of its user id, when the grader
runs as root): what a notebook starts in the background costs its own clock, not its
neighbour's. Where /proc does not say, the clock is the wall clock.
"""

from __future__ import annotations

import contextlib
import os
import time

REFRESH = 0.25  # seconds between two looks at the submission's other processes (a /proc scan)
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _waited(path: str) -> float | None:
    """Seconds the task of `path` (a schedstat file) has spent runnable but not running."""
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _cpu(pid: str) -> tuple[tuple[str, int], float] | None:
    """((pid, start time): one process, even if its pid is reused; CPU seconds it has used)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (pid, int(fields[19])), (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, ValueError, IndexError):
        return None


class Clock:
    """Seconds, like `time.monotonic()`, charged to one notebook (see the module's doc); never
    goes back. `follow(pid, uid)` each time a new worker starts for the notebook."""

    def __init__(self):
        self.wall0 = time.monotonic()
        self.grader = "/proc/thread-self/schedstat"
        self.grader0 = _waited(self.grader) or 0.0
        self.banked = 0.0  # waits of the notebook's earlier workers
        self.worker, self.worker0, self.worker_last = None, 0.0, 0.0
        self.uid, self.exclude = None, set()
        self.others: dict[tuple, float] = {}  # process -> its CPU seconds when last seen
        self.looked = float("-inf")
        self.last = float("-inf")

    def follow(self, pid: int, uid: int | None) -> None:
        self.banked += self.worker_last - self.worker0
        self.worker = f"/proc/{pid}/schedstat"
        self.worker0 = self.worker_last = _waited(self.worker) or 0.0
        self.uid, self.exclude = uid, {str(pid)}

    def _look(self, wall: float) -> float:
        """CPU seconds of the submission's other processes (those that ended: as last seen)."""
        if self.uid is not None and wall - self.looked >= REFRESH:
            self.looked = wall
            for pid in os.listdir("/proc"):
                if pid.isdigit() and pid not in self.exclude:
                    with contextlib.suppress(OSError):
                        if os.stat(f"/proc/{pid}").st_uid == self.uid:
                            seen = _cpu(pid)
                            if seen is not None:
                                self.others[seen[0]] = seen[1]
        return sum(self.others.values())

    def __call__(self) -> float:
        wall = time.monotonic()
        if self.worker is not None:
            seen = _waited(self.worker)
            if seen is not None:  # (an ended worker keeps what it had waited)
                self.worker_last = seen
        waited = self.banked + self.worker_last - self.worker0
        waited += (_waited(self.grader) or self.grader0) - self.grader0
        self.last = max(self.last, wall - waited + self._look(wall))
        return self.last
