"""What runs the course, never imported when a model runs: the in-notebook checks (`check`,
`use`), the per-chapter check modules (`checks/chNN.py`), the build that turns `solutions/` into
`course/` and the exported modules, and the grader.

In a chapter notebook::

    from qwen_mini.course import check, use
"""

from .checking import check, use

__all__ = ["check", "use"]
