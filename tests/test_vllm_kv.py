"""Issue 51: the concept layers' KV-cache manager in vLLM's scheduler, without a server.

A request's concept group holds C + (T' - T) slots for T' tokens once the worker has reported
(T tokens processed, C concepts), T' before any report; the report is keyed by the request's first
concept block and cleared when the request's blocks are freed (the block may go to another request).
"""

from __future__ import annotations

import pytest
import torch

from vllm_helpers import need_vllm

need_vllm()

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from conceptmoe.vllm_plugin import kv  # noqa: E402
from conceptmoe.vllm_plugin.kv import ConceptAttentionManager, ConceptAttentionSpec, FeedbackTable, concept_slots  # noqa: E402

BLOCK = 32


@pytest.fixture
def manager(tmp_path, monkeypatch):
    monkeypatch.setattr(kv, "FEEDBACK_DIR", tmp_path)
    monkeypatch.setattr(kv, "_TABLES", {})
    spec = ConceptAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, compression=2.0)
    pool = BlockPool(num_gpu_blocks=64, enable_caching=False, hash_block_size=BLOCK)
    return ConceptAttentionManager(spec, pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=BLOCK)


def to_allocate(m: ConceptAttentionManager, rid: str, tokens: int, computed: int) -> int:
    return m.get_num_blocks_to_allocate(rid, tokens, new_computed_blocks=[], total_computed_tokens=computed,
                                        num_local_computed_tokens=computed, num_tokens_main_model=tokens)


def test_concept_slots():
    assert concept_slots(100, None) == 100  # no report: as many slots as tokens
    assert concept_slots(100, (40, 15)) == 75  # 15 concepts for the first 40, at most one each after
    assert concept_slots(40, (40, 15)) == 15
    assert concept_slots(100, (0, 0)) == 100  # a cleared entry
    assert concept_slots(30, (40, 15)) == 30  # a report past the tokens asked for (another request's): ignored
    assert concept_slots(100, (10, 11)) == 100  # more concepts than tokens: not a report of ours


def test_manager_counts_blocks_in_concepts(manager):
    first = manager.allocate_new_blocks("r", 16, 16)
    assert len(first) == 1  # admitted before any report: as many slots as tokens
    assert to_allocate(manager, "r", 200, 16) == 7 - 1  # still no report: 200 token slots, 7 blocks
    manager._table.write(first[0].block_id, 16, 5)  # the worker: 16 tokens made 5 concepts
    # 5 + (200 - 16) = 189 slots: 6 blocks, one held
    assert to_allocate(manager, "r", 200, 16) == 5
    assert len(manager.allocate_new_blocks("r", 200, 200)) == 5
    assert len(manager.req_to_blocks["r"]) == 6
    free_before = manager.block_pool.get_num_free_blocks()
    manager.free("r")
    assert manager.block_pool.get_num_free_blocks() == free_before + 6
    assert manager._table.read(first[0].block_id) == (0, 0)  # the report goes with the blocks


def test_a_stale_report_does_not_shrink_a_new_request(manager):
    first = manager.allocate_new_blocks("a", 16, 16)
    manager._table.write(first[0].block_id, 16, 2)
    manager.free("a")
    again = manager.allocate_new_blocks("b", 16, 16)
    assert manager._table.read(again[0].block_id) == (0, 0)
    assert to_allocate(manager, "b", 100, 16) == 4 - 1


def test_the_table_is_shared_by_pid_and_zeroed_by_the_scheduler(tmp_path, monkeypatch):
    monkeypatch.setattr(kv, "FEEDBACK_DIR", tmp_path)
    scheduler = FeedbackTable(1234, 8, fresh=True)
    worker = FeedbackTable(1234, 8)
    worker.write(3, 40, 17)
    assert scheduler.read(3) == (40, 17)
    assert FeedbackTable(1234, 8, fresh=True).read(3) == (0, 0)  # a new scheduler with the same pid
