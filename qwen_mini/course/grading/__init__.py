"""Grade a chapter's exercises in submitted notebooks (`qwen-mini grade`).

Split by concern:

- `plan.py`: a reference notebook and a submission into what to run;
- `worker.py`: what runs inside the sandboxed process (learner code, then the checks);
- `sandbox.py`: starting that process, its limits, and collecting what it reports;
- `session.py`: grading one notebook, restarting after a timeout or a crash;
- `report.py`: scores, the CSV and the JSON reports;
- `cli.py`: the command line (`main`), also `python -m qwen_mini.course.grading`.
"""

from .cli import main

__all__ = ["main"]
