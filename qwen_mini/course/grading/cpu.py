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


def _sched(path: str | None) -> tuple[float, float]:
    """(seconds run, seconds runnable but not running) of the task of a schedstat file; zeros
    where it cannot be read (no such file, an ended process)."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                ran, waited = f.read().split()[:2]
            return int(ran) / 1e9, int(waited) / 1e9
        except (OSError, ValueError):
            pass
    return 0.0, 0.0


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
        self.grader = "/proc/thread-self/schedstat"
        self.worker = None
        self.wall = self.start = time.monotonic()
        self.seen = (*_sched(self.grader), 0.0, 0.0)  # grader's run, wait; worker's run, wait
        self.credit = 0.0  # seconds of waiting for a CPU, not charged
        self.uid, self.exclude = None, set()
        self.others: dict[tuple, float] = {}  # process -> its CPU seconds when last seen
        self.looked = float("-inf")

    def follow(self, pid: int, uid: int | None) -> None:
        self()  # the old worker's share, counted up to now
        self.worker = f"/proc/{pid}/schedstat"
        self.seen = (*self.seen[:2], *_sched(self.worker))
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
        worker = _sched(self.worker)
        if worker == (0.0, 0.0):  # ended: it ran and waited what it had when last seen
            worker = self.seen[2:]
        now = (*_sched(self.grader), *worker)
        ran = max(0.0, now[0] - self.seen[0]) + max(0.0, now[2] - self.seen[2])
        waited = max(0.0, now[1] - self.seen[1]) + max(0.0, now[3] - self.seen[3])
        # both may wait at once (the grader polls while the worker waits): what they ran counts
        self.credit += max(0.0, min(waited, wall - self.wall - ran))
        self.wall, self.seen = wall, now
        return wall - self.credit + self._look(wall)
