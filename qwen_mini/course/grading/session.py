"""Grading one notebook: run its code cells in order in a worker, and check each exercise here.

After each cell, the exercises it checked (`check("chNN.x", obj)` records `obj`, however the
call is written) are graded on that object; an exercise nobody checked is graded at the end on
the name it defines. The checks run in this process, on a `Remote` stand-in for the learner's
object: what the learner's code returns crosses as plain data and is compared here.

When a piece fails, whatever the reason (a failed check, an exception, a timeout, a crash), the
worker's name for it is set to the package's piece, as `use(...)` does in the notebook, so the
later exercises built on it are graded on their own. After a timeout or a crash a new worker
runs the cells that ran cleanly again (and those fallbacks), then goes on after the bad cell.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import observing
from ..checking import crash_idea, exception_text, learner_line
from .jail import FILE_SIZE_LIMIT
from .plan import GraderError, Reference, Submission
from .protocol import WrongType
from .report import Grades
from .sandbox import BadMessage, Connection, Jail, Remote, WorkerFault, WorkerGone, WorkerTimeout

LOST_OBJECT = (
    "its process died while an earlier exercise was checked, and running the notebook again up "
    "to its cell did not check it again"
)


@dataclass
class Options:
    # wall-clock seconds per cell and per exercise's checks: the chapters' longest cells take
    # about 25 s on a quiet 2-core machine, so 60 leaves room for a busy one
    timeout: float = 60.0
    budget: float = 300.0  # seconds per notebook, everything included
    memory_mb: int = 2048


class Session:
    def __init__(self, sub: Submission, ref: Reference, jail: Jail, options: Options):
        self.sub, self.ref, self.jail, self.options = sub, ref, jail, options
        self.grades = Grades(sub.name, {e.id: e.points for e in ref.exercises})
        self.grades.warnings += sub.warnings
        self.entries = {e.id: e for e in ref.exercises}
        self.conn: Connection | None = None
        self.log: list[tuple] = []  # what a new worker replays: ("cell", i, src) / ("fallback", x)
        self.graded: set[str] = set()
        self.clock = time.monotonic  # the notebook's time (its jail's cgroup: a fair CPU share)
        self.end_of_budget = self.clock() + options.budget
        self.replayed: dict[int, list] = {}  # cell index -> what it checked, in this worker

    # the worker

    def _deadline(self) -> float:
        return min(self.clock() + self.options.timeout, self.end_of_budget)

    def _connect(self) -> Connection:
        if self.conn is None:
            options = self.options
            started = self.clock()
            conn = Connection(self.jail, options.memory_mb, self._use, options.budget)
            # starting a jail (Python and torch) is the grader's time, not the notebook's: a
            # notebook whose cells crash it four times is not charged four starts on a busy machine
            self.end_of_budget += self.clock() - started
            self.conn = conn
            self.replayed = {}
            try:
                for entry in self.log:  # the state before the failure, without the bad cell
                    conn.deadline = self._deadline()
                    if entry[0] == "cell":
                        result = conn.request({"op": "cell", "i": entry[1], "src": entry[2]})
                        self.replayed[entry[1]] = self._validate_cell(result)
                    else:
                        self._package_piece(conn, entry[1])
            except WorkerFault as fault:
                self._lost(fault)
                raise
        return self.conn

    def _lost(self, fault: WorkerFault) -> str:
        """End the worker after a fault; a message that says what happened."""
        ended = self.conn.close() if self.conn else {}
        self._keep_output(ended)
        self.conn = None
        if isinstance(fault, WorkerTimeout):
            if self.clock() >= self.end_of_budget - 0.05:
                return f"the notebook used up its budget of {self.options.budget:g} s"
            stopped = " (the process was stopped, not running)" if ended.get("stopped") else ""
            return f"did not finish within {self.options.timeout:g} s{stopped}"
        if isinstance(fault, BadMessage):
            return f"the process running your code broke the grader's channel ({fault})"
        code = ended.get("exit")
        if code is not None and code < 0:
            return f"the process running your code was killed (signal {-code}; too much memory?)"
        if code is not None:
            return f"the process running your code exited with code {code} (os._exit?)"
        return "the process running your code died"

    def _keep_output(self, ended: dict) -> None:
        if ended.get("output"):
            text = ended["output"].decode("utf-8", "replace")
            self.grades.output += text
        if ended.get("output_bytes", 0) > len(ended.get("output", b"")):
            wrote = ended["output_bytes"]
            if wrote >= FILE_SIZE_LIMIT:  # what a print wrote past the limit was dropped
                wrote = f"at least {wrote}"
            self.grades.warnings.append(
                f"the process wrote {wrote} bytes of output; kept the first {len(ended['output'])}"
            )

    # running

    def run(self) -> Grades:
        for cell in self.sub.cells:
            if self.clock() >= self.end_of_budget:
                self._rest(
                    "timeout", f"the notebook used up its budget of {self.options.budget:g} s"
                )
                break
            self._cell(cell)
        for exercise in self.ref.order:
            if exercise not in self.graded and self.clock() < self.end_of_budget:
                self._by_name(exercise)
        self._rest("timeout", f"the notebook used up its budget of {self.options.budget:g} s")
        if self.conn is not None:
            self._keep_output(self.conn.close())
            self.conn = None
        return self.grades

    def _rest(self, status: str, message: str) -> None:
        for exercise in self.ref.ids:
            if exercise not in self.graded and self.clock() >= self.end_of_budget:
                self.grades.set(exercise, status, message)
                self.graded.add(exercise)

    def _cell(self, cell) -> None:
        failure, checked = None, []
        try:
            conn = self._connect()
            conn.deadline = self._deadline()
            result = conn.request({"op": "cell", "i": cell.index, "src": cell.source})
            checked = self._validate_cell(result)
            for note in result["notes"]:
                self.grades.warnings.append(f"cell {cell.index}: {note}")
            if result["ok"]:
                self.log.append(("cell", cell.index, cell.source))
            else:
                failure = _cell_failure(result)
        except WorkerFault as fault:
            failure = (
                "timeout" if isinstance(fault, WorkerTimeout) else "crashed",
                self._lost(fault),
            )
            failure = (failure[0], f"cell {cell.index}: {failure[1]}")
        order = list(dict.fromkeys([x for x, _ in checked] + cell.mentions))
        if failure:
            self.grades.warnings.append(f"cell {cell.index}: {failure[0]}: {failure[1]}")
        for exercise in order:
            if exercise not in self.entries:
                self.grades.warnings.append(
                    f"cell {cell.index} checks {exercise!r}, not an exercise; ignored"
                )
                continue
            if exercise in self.graded:
                self.grades.warnings.append(
                    f"{exercise} is checked again in cell {cell.index}: graded that copy"
                )
            objects = [obj for x, obj in checked if x == exercise]
            if objects:
                self._grade(exercise, objects[-1], cell)
            elif failure:
                self.grades.set(exercise, failure[0], failure[1])
                self.graded.add(exercise)
                self._fall_back(exercise)

    def _validate_cell(self, result) -> list[tuple[str, Remote]]:
        ok = (
            type(result) is dict
            and type(result.get("ok")) is bool
            and type(result.get("notes")) is list
            and all(type(n) is str for n in result["notes"])
            and type(result.get("checked")) is list
            and all(
                type(c) is list and len(c) == 2 and type(c[0]) is str and type(c[1]) is Remote
                for c in result["checked"]
            )
        )
        if ok and not result["ok"]:
            ok = (
                result.get("kind") in ("not-implemented", "exit", "memory", "error")
                and type(result.get("error")) is str
            )
        if not ok:
            raise BadMessage("a malformed answer to a cell")
        return [(x, obj) for x, obj in result["checked"]]

    def _by_name(self, exercise: str) -> None:
        name = self.ref.names[exercise]
        try:
            conn = self._connect()
            conn.deadline = self._deadline()
            obj = conn.request({"op": "lookup", "name": name})
        except NameError:
            self.grades.set(
                exercise,
                "missing",
                f'no cell calls check("{exercise}", …) and no `{name}` is defined',
            )
            self.graded.add(exercise)
            self._fall_back(exercise)
            return
        except WorkerFault as fault:
            status = "timeout" if isinstance(fault, WorkerTimeout) else "crashed"
            self.grades.set(exercise, status, self._lost(fault))
            self.graded.add(exercise)
            return
        except Exception as e:
            self.grades.set(exercise, "crashed", f"could not find `{name}`: {e}")
            self.graded.add(exercise)
            return
        if type(obj) is not Remote:
            self.grades.set(exercise, "failed", f"`{name}` is plain data, not a function or class")
            self.graded.add(exercise)
            return
        self.grades.warnings.append(f"{exercise}: no cell calls check(); graded `{name}`")
        self._grade(exercise, obj)

    # grading one exercise

    def _grade(self, exercise: str, obj: Remote, cell=None) -> None:
        """Grade `exercise` on `obj`, which `cell` checked (None: found by its name)."""
        self.graded.add(exercise)
        for earlier in self.ref.order[: self.ref.order.index(exercise)]:
            # one the notebook checks before: graded now on its name, or the package's piece
            if earlier not in self.graded:
                self._by_name(earlier)
        started = time.monotonic()
        try:
            obj = self._alive(exercise, obj, cell)
            if obj is None:
                status, message = "crashed", LOST_OBJECT
            else:
                status, message = self._check(exercise, obj)
        except WorkerFault as fault:
            status = "timeout" if isinstance(fault, WorkerTimeout) else "crashed"
            message = self._lost(fault)
        self.grades.set(exercise, status, message, runtime_s=round(time.monotonic() - started, 3))
        if status != "passed":
            self._fall_back(exercise)

    def _alive(self, exercise: str, obj: Remote, cell) -> Remote | None:
        """`obj`, or, when the worker that held it has ended since (an earlier exercise's checks
        ran past the time limit or killed it), the same object from a new worker: the one its
        cell checks once run again there (or found again by name). None if it is not there."""
        if obj._conn is self.conn:
            return obj
        conn = self._connect()  # runs again every cell that ran cleanly, and the fallbacks
        if cell is None:
            conn.deadline = self._deadline()
            try:
                found = conn.request({"op": "lookup", "name": self.ref.names[exercise]})
            except NameError:
                return None
            return found if type(found) is Remote else None
        if cell.index not in self.replayed:  # a cell that raised is not run again with the rest
            conn.deadline = self._deadline()
            result = conn.request({"op": "cell", "i": cell.index, "src": cell.source})
            self.replayed[cell.index] = self._validate_cell(result)
            for entry in self.log:  # the pieces that failed since are the package's again
                if entry[0] == "fallback":
                    conn.deadline = self._deadline()
                    self._package_piece(conn, entry[1])
        found = [o for x, o in self.replayed[cell.index] if x == exercise]
        return found[-1] if found else None

    def _check(self, exercise: str, obj: Remote) -> tuple[str, str]:
        conn = self.conn
        conn.deadline = self._deadline()
        conn.codec.mirrors.clear()
        # the processes the notebook left running are stopped first; they get half the
        # checks' time to be gone
        wait = max(0.0, conn.deadline - self.clock()) / 2
        begin = conn.request({"op": "begin", "ex": exercise, "wait": wait})
        if (
            type(begin) is not dict
            or type(begin.get("tampered")) is not str
            or type(begin.get("helpers")) is not str
            or type(begin.get("stopped")) is not int
        ):
            raise BadMessage("a malformed answer to begin")
        if begin["stopped"]:
            self.grades.warnings.append(
                f"{exercise}: {begin['stopped']} process(es) your code started were still running "
                "and were stopped before it was checked"
            )
        status, message = self._run_checks(exercise, obj)
        end = conn.request({"op": "end"})
        if type(end) is not dict or not all(
            type(end.get(k)) is str for k in ("reference", "tampered")
        ):
            raise BadMessage("a malformed answer to end")
        name = self.ref.names[exercise]
        if end["reference"]:
            return "reference", (
                f"your `{name}` runs the package's own {exercise} ({end['reference'][:200]}); "
                "an exercise must be your own code (calling earlier pieces is fine)"
            )
        tampered = begin["tampered"] or end["tampered"]
        if tampered:
            return "tampered", (
                f"your code replaced `{tampered[:200]}`; an exercise must not change torch, the "
                "builtins or qwen_mini"
            )
        if begin["helpers"]:
            return "tampered", (
                f"{begin['helpers'][:200]} started by your code was still running when "
                f"{exercise} was checked, though it was stopped; stop your processes first"
            )
        return status, message

    def _run_checks(self, exercise: str, obj, hidden: bool = True) -> tuple[str, str]:
        """Every public, then every hidden check; the first failure decides. Hidden checks
        report their name (their category), never their inputs."""
        try:
            return self._each_check(exercise, obj, hidden)
        finally:  # as after check() in the notebook: the learner's random stream as it was
            if self.conn is not None and self.conn.rng is not None:
                self.conn.request({"op": "restore_rng"})
                self.conn.rng = None

    def _each_check(self, exercise: str, obj, hidden: bool) -> tuple[str, str]:
        entry = self.entries[exercise]
        checks = [(n, f, False) for n, f in entry.public]
        if hidden:
            checks += [(n, f, True) for n, f in entry.hidden]
        for name, fn, is_hidden in checks:
            try:
                with torch.random.fork_rng(devices=[]), observing.sandboxed(self.conn.request):
                    torch.manual_seed(0)
                    fn(obj)
            except NotImplementedError:  # as the notebook's check() says (checking.run_checks)
                return "not attempted", "not implemented yet"
            except MemoryError:
                return "crashed", f"used more than the {self.options.memory_mb} MB memory limit"
            except WrongType as e:
                return "failed", f"{name} failed: {e}"
            except AssertionError as e:
                if is_hidden:
                    return "failed", f"a hidden check failed: {name}"
                return "failed", f"{name} failed: {e}"
            except Exception as e:
                what = f"your code raised {type(e).__name__}"
                where = learner_line(e)  # the line of the learner's cell (none: the check's own)
                if is_hidden:
                    at = f" at {where}" if where else ""
                    return "failed", f"a hidden check failed: {name} ({what}{at})"
                at = f" ({where})" if where else ""
                return (
                    "failed",
                    f"{name} failed: your code raised {exception_text(e)}{at}{crash_idea(e)}",
                )
        return "passed", f"passed {len(checks)}/{len(checks)} checks"

    def _use(self, exercise: str, obj) -> bool:
        """The learner's `use(...)`: does `obj` pass the exercise's public checks?"""
        if exercise not in self.entries or type(obj) is not Remote:
            return False
        status, _ = self._run_checks(exercise, obj, hidden=False)
        return status == "passed"

    def _package_piece(self, conn: Connection, exercise: str) -> None:
        """The worker's name for `exercise` is the package's piece from now on."""
        conn.request({"op": "fallback", "ex": exercise, "name": self.ref.names[exercise]})

    def _fall_back(self, exercise: str) -> None:
        self.log.append(("fallback", exercise))
        if self.conn is None:
            return  # the next worker replays the log, fallbacks included
        try:
            self.conn.deadline = self._deadline()
            self._package_piece(self.conn, exercise)
        except WorkerFault as fault:
            self._lost(fault)


def _cell_failure(result: dict) -> tuple[str, str]:
    kind, error = result["kind"], result["error"][:1000]
    if kind == "not-implemented":
        return "not attempted", f"not implemented yet (your cell {error})"
    if kind == "memory":
        return "crashed", f"your cell used more than the memory limit: {error}"
    return "crashed", f"your cell {error}"


def grade_notebook(sub: Submission, ref: Reference, jail: Jail, options: Options) -> Grades:
    if sub.error:
        grades = Grades(sub.name, {e.id: e.points for e in ref.exercises})
        grades.error = f"{sub.name}: {sub.error}"
        for exercise in ref.ids:
            grades.set(exercise, "unreadable", f"the notebook {sub.error}")
        return grades
    session = Session(sub, ref, jail, options)
    try:
        return session.run()
    except (WorkerFault, Exception) as e:
        # whatever went wrong grading this notebook costs this notebook only: its exercises
        # not graded yet are `crashed`, the others keep their grades, and the run goes on
        if session.conn is not None:
            session._keep_output(session.conn.close())
        why = exception_text(e, 300)
        if isinstance(e, (WorkerFault, GraderError, OSError)):
            why = f"the grading process could not go on ({why})"
        else:
            why = f"the grader could not finish this notebook ({why})"
        session.grades.error = f"{sub.name}: {why}"
        for exercise in ref.ids:
            if exercise not in session.graded:
                session.grades.set(exercise, "crashed", why)
        return session.grades


__all__ = ["Options", "grade_notebook", "WorkerGone"]
