"""Grade a chapter's exercises in submitted notebooks (`qwen-mini grade`).

Split by concern:

- `plan.py`: the reference notebook and a submission into what to run (every code cell);
- `protocol.py`: the channel between grader and sandbox: framed messages, plain-data values;
- `worker.py`: the sandbox side: a zygote that forks one worker per submission, which runs the
  learner's cells and answers the grader's requests, with its limits and its user id;
- `monitor.py`: inside the sandbox, tamper and reference detection (which code runs while an
  exercise is checked);
- `sandbox.py`: the grader's side of it: starting workers, stand-ins for learner objects;
- `session.py`: grading one notebook (the checks run here, in the grader);
- `report.py`: statuses, points, the CSV and the JSON reports;
- `cli.py`: the command line (`main`), also `python -m qwen_mini.course.grading`.

Why the checks run in the grader and not next to the learner's code: whatever runs in the same
process as a submission can be patched by it. The sandbox only ever sends the grader plain data
(numbers, strings, lists, tensors as dtype + shape + bytes) and handles to its own objects; the
checks, the reference values and the comparisons never run where learner code does. A check
module written with `register` / `public` / `hidden` works unchanged: its functions receive a
stand-in (`sandbox.Remote`) whose calls, attributes, items and iteration are requests to the
sandbox, and every tensor the sandbox returns is rebuilt here as a plain `torch.Tensor`.
"""

from .cli import main

__all__ = ["main"]
