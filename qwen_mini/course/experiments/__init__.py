"""Given experiment code of the chapters, hand-written: the plots, interactive views and
measurements a chapter runs but whose reading is not its lesson (one module per chapter, the
views' widget helper in `views`, and here `one_thread`, the thread count every training run uses).
A notebook imports them and keeps in its cells the calls and the code whose reading is the lesson.
Nothing here is imported to run a model; the exercises and the helpers the chapters export are in
`qwen_mini.course.lab`."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one thread, then give the count back: the experiments' matrices are small,
    a second thread gains nothing, and on a busy machine threads that wait for each other can
    cost 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
