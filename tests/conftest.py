"""Shared test set-up: deterministic seeds, one intra-op thread.

Tiny test tensors gain nothing from intra-op threads, and an oversubscribed machine (parallel
jobs, CI neighbours) makes OpenMP spin-waits dominate: one thread keeps tests fast and stable.
"""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
