"""What runs the course, never imported when a model runs: the in-notebook checks (`check`,
`use`), the per-chapter check modules (`checks/chNN.py`), the build that turns `solutions/` into
`course/` and the exported modules, and the grader.

In a chapter notebook::

    from qwen_mini.course import check, use
"""

from . import checking
from .checking import check, use

__all__ = ["check", "use"]


def _keep_pieces(exercise_id: str, obj, result: checking.Result) -> None:
    """A passing answer is kept as the learner's piece for later chapters (mine.py), imported
    at the first check, not with the course."""
    from . import mine

    mine.remember(exercise_id, obj, result)


checking.AFTER_CHECK.append(_keep_pieces)
