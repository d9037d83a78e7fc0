"""Shared test set-up: deterministic seeds, one intra-op thread, fp32 by default.

Tiny test tensors gain nothing from intra-op threads, and an oversubscribed machine (parallel
jobs, CI neighbours) makes OpenMP spin-waits dominate: one thread keeps tests fast and stable.
"""

import os

import pytest
import torch

torch.set_num_threads(1)
# The default precision follows the CPU (bf16 with AMX / AVX512-BF16): pin it to fp32 so that the
# suite computes the same on every machine; bf16 tests ask for it (--dtype bf16).
os.environ.setdefault("CONCEPTMOE_CPU_BF16", "0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tasks_root(tmp_path_factory):
    """One folder for the harness task files built by the tests (built once per session)."""
    return tmp_path_factory.mktemp("tasks")


@pytest.fixture
def offline_harness(monkeypatch, tasks_root):
    """lm-evaluation-harness without a hub, its task files in ``tasks_root``."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("CONCEPTMOE_TASKS_DIR", str(tasks_root))
