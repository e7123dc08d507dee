"""Grade a chapter's exercises in submitted notebooks (`qwen-mini-course grade`).

Split by concern:

- `plan.py`: the reference notebook and a submission into what to run (every code cell);
- `protocol.py`: the channel between grader and sandbox: framed messages, plain-data values;
- `jail.py`: the bubblewrap jail each submission's worker runs in: namespaces, limits, cgroups;
- `worker.py`: the jail's side: the worker, which runs the learner's cells and answers the
  grader's requests;
- `monitor.py`: inside the jail, tamper and reference detection (which code runs while an
  exercise is checked);
- `sandbox.py`: the grader's side of it: starting a worker in its jail, stand-ins for learner
  objects;
- `byvalue.py`: a check's objects sent to the sandbox as copies, and their state brought back;
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

The other direction is by value (`byvalue.py`): what a check hands to the learner's code (its
modules, a model to fill, fakes) is pickled here and unpickled in the sandbox, so the learner's
code gets real objects (`add_module` accepts them, loops iterate them); handed back they are the
grader's own objects again, and what the learner's code did to them comes back as plain data.
Tensors from the sandbox keep their storage (views, `data_ptr()` identity). The tensors, lists,
dicts and sets a check passes as data come back as the learner's code left them (written in
place, keys deleted), and a check that observes how the code runs (the memory it allocates, the
dtype a softmax computes in) asks for the observation by name (`qwen_mini.course.observing`),
which the sandbox makes around the learner's calls: a check gives the same verdict on the same
code in the notebook and in the grader.
"""

from .cli import main

__all__ = ["main"]
