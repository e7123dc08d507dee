"""Starting the grading worker (a zygote that forks one process per job) and collecting what a
job reports, with its time limit."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .plan import ROOT, GraderError

PROCESS_OUTPUT_CAP = 20_000  # bytes kept of what the process wrote to its stdout / stderr fds


class Zygote:
    def __init__(self, chapter: str, workdir: Path):
        self.chapter, self.workdir = chapter, workdir
        self._spawn()

    def _spawn(self) -> None:
        chapter, workdir = self.chapter, self.workdir
        self.sock, theirs = socket.socketpair()
        env = dict(os.environ, QWEN_MINI_CHECKS="learner")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.log = workdir / "zygote.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "qwen_mini.course.grading.worker",
                    "--zygote",
                    str(theirs.fileno()),
                    chapter,
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env=env,
            )
        theirs.close()
        self.buffer = b""
        ready = self.receive(timeout=600)
        if not ready or not ready.get("ready"):
            detail = (ready or {}).get("error") or self.log.read_text(errors="replace")
            self.close()
            raise GraderError(f"could not load the checks of {chapter}:\n{detail}")
        self.exercises = ready["exercises"]
        if not self.exercises:
            self.close()
            raise GraderError(
                f"no exercises are registered for {chapter} (qwen_mini/course/checks)"
            )

    def receive(self, timeout: float) -> dict | None:
        """The next message, or None at EOF or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def start(self, job_file: Path, fds: list[int]) -> int:
        """Hand a job to the worker and return the pid of the process it forked for it. A
        submission may have killed the worker (its parent): then start a new worker, once."""
        for attempt in range(2):
            reply = None
            if self.proc.poll() is None:
                with contextlib.suppress(OSError):
                    socket.send_fds(self.sock, [str(job_file).encode()], fds)
                    reply = self.receive(timeout=60)
            if reply and "pid" in reply:
                return reply["pid"]
            if attempt == 0:
                self.close()
                self._spawn()
        raise GraderError(f"the grading worker stopped: {self.log.read_text(errors='replace')}")

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


WORKER_GONE = 1 << 16  # an exit code no process has: the worker died before reporting one


@dataclass
class Run:
    """What one forked process reported before it finished or was stopped."""

    events: list[dict] = field(default_factory=list)
    output: bytearray = field(default_factory=bytearray)
    output_bytes: int = 0
    exit_code: int | None = None
    timed_out: bool = False


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_job(zygote: Zygote, job: dict, workdir: Path, timeout: float, setup_timeout: float) -> Run:
    """Fork a process for `job`; collect its events and output; kill it when a step overruns."""
    job_file = workdir / "job.json"
    job_file.write_text(json.dumps(job))
    events_r, events_w = os.pipe()
    output_r, output_w = os.pipe()
    pid = zygote.start(job_file, [events_w, output_w])
    os.close(events_w)
    os.close(output_w)
    run, pending = Run(), b""
    open_fds = {events_r, output_r}
    deadline, drain_until = time.monotonic() + setup_timeout, float("inf")
    while open_fds or run.exit_code is None:
        if run.exit_code is None and time.monotonic() > deadline:
            run.timed_out = True
            _kill(pid)
            deadline = float("inf")
        if run.exit_code is None and b"\n" in zygote.buffer:  # already read with the pid
            run.exit_code = zygote.receive(0)["exit"]
            drain_until = time.monotonic() + 5
        if run.exit_code is not None and time.monotonic() > drain_until:
            break  # something the submission started still holds the pipes; stop listening
        watch = list(open_fds) + ([zygote.sock] if run.exit_code is None else [])
        wait = 0.2 if run.exit_code is not None else min(deadline - time.monotonic(), 1.0)
        wait = max(0.0, wait)
        for fd in select.select(watch, [], [], wait)[0]:
            if fd is zygote.sock:
                reply = zygote.receive(5)
                run.exit_code = reply["exit"] if reply else WORKER_GONE
                drain_until = time.monotonic() + 5
                _kill(pid)  # anything the submission left running holds our pipes open
                continue
            data = os.read(fd, 65536)
            if not data:
                open_fds.discard(fd)
                os.close(fd)
            elif fd == output_r:
                run.output_bytes += len(data)
                run.output += data[: max(0, PROCESS_OUTPUT_CAP - len(run.output))]
            else:
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    event = json.loads(line)
                    run.events.append(event)
                    limit = setup_timeout if event["event"] == "setup-start" else timeout
                    deadline = time.monotonic() + limit
    for fd in open_fds:
        os.close(fd)
    return run
