"""Fixtures shared by the test files. Factories that are plain functions (one tiny config per
architecture, one randomiser, checkpoints written by transformers) live in tests/helpers.py."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """For tests of hundreds of tiny products: on a shared 2-core machine, waking a second thread
    for each costs 10-20x the product itself."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
