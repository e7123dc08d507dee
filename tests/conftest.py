"""Fixtures shared by the test files. Factories that are plain functions (one tiny config per
architecture, one randomiser, checkpoints written by transformers) live in tests/helpers.py."""

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on a 2-core machine: each worker's torch on both cores too
    # oversubscribes them (measured: tests of many small passes ran 2.2-4x slower); the kernels
    # and commands a test starts inherit one thread too
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def one_thread():
    """For tests of hundreds of tiny products: on a shared 2-core machine, waking a second thread
    for each costs 10-20x the product itself."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _learner_pieces_kept_apart(tmp_path_factory):
    """Checks run in the learner's mode keep passing answers as the learner's pieces
    (qwen_mini/course/mine.py). Tests keep none (tests/test_mine.py turns it on for its own
    learners), and a folder of the run stands in for ~/.qwen-mini."""
    saved = {k: os.environ.get(k) for k in ("QWEN_MINI_HOME", "QWEN_MINI_MINE")}
    os.environ["QWEN_MINI_HOME"] = str(tmp_path_factory.mktemp("qwen-mini-home"))
    os.environ["QWEN_MINI_MINE"] = "off"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_collection_finish(session):
    """Under `--dist loadgroup` a file marked with an xdist_group must really run in one worker
    (its module fixtures grade a corpus once): pytest-xdist groups by a suffix it writes into
    each test's id, which a pytest release that stores ids elsewhere would silently drop."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [
        i.nodeid
        for i in session.items
        if i.get_closest_marker("xdist_group") and "@" not in i.nodeid
    ]
    if lost:
        pytest.exit(f"pytest-xdist did not group {lost[0]} (pytest and pytest-xdist disagree)", 3)
