"""Issue 51, without a server: the concept layers' KV-cache manager in vLLM's scheduler; the per-request ratio.

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


def test_concept_ratio_follows_its_request_through_the_batch():
    """The ratio processor keeps each persistent-batch row's R as vLLM adds, removes and moves rows."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from conceptmoe.vllm_plugin import ratio

    proc = ratio.ConceptRatio(None, torch.device("cpu"), False)
    sp = lambda r: SamplingParams(extra_args=None if r is None else {"concept_ratio": r})  # noqa: E731
    proc.update_state(BatchUpdate(3, removed=[], added=[(0, sp(2.0), [1], []), (1, sp(None), [1], []),
                                                        (2, sp(4), [1], [])], moved=[]))
    assert ratio.row_ratios(4) == [2.0, None, 4.0, None]
    proc.update_state(BatchUpdate(3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))
    assert ratio.row_ratios(3) == [4.0, None, 2.0]
    # row 1 finishes; the last row moves into its place
    proc.update_state(BatchUpdate(2, removed=[1], added=[], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    assert ratio.row_ratios(2) == [4.0, 2.0]
    proc.update_state(None)  # no change this step
    assert ratio.row_ratios(2) == [4.0, 2.0]
    proc.update_state(BatchUpdate(2, removed=[0], added=[(0, sp(3.0), [1], [])], moved=[]))
    assert ratio.row_ratios(2) == [3.0, 2.0]


def test_concept_ratio_checks(tmp_path):
    from conceptmoe.vllm_plugin.ratio import check_request_ratio

    (tmp_path / "config.json").write_text('{"model_type": "qwen2_moe"}')
    assert "must be a number" in check_request_ratio("3", str(tmp_path))
    assert "must be finite" in check_request_ratio(float("nan"), str(tmp_path))
    assert "does not name the served export" in check_request_ratio(3.0, None)
    assert "ConceptMoE runs only" in check_request_ratio(3.0, str(tmp_path))


def test_launcher_bounds_a_conceptmoe_prefill_chunk_and_compiles(tmp_path):
    """A ConceptMoE gets CONCEPT_PREFILL_CHUNK unless --vllm-args sets a threshold; a MoE gets none;
    neither is forced eager any more (--enforce-eager only when asked)."""
    from conceptmoe.vllm_plugin.launch import CONCEPT_PREFILL_CHUNK, VllmServeConfig, server_command

    def argv(concept: bool, *extra: str) -> list[str]:
        return server_command(VllmServeConfig("r", extra=list(extra)), tmp_path, concept)[0]

    def threshold(a: list[str]) -> list[str]:
        return [a[i + 1] for i, x in enumerate(a) if x == "--long-prefill-token-threshold"]

    assert threshold(argv(True)) == [str(CONCEPT_PREFILL_CHUNK)]
    assert threshold(argv(True, "--long-prefill-token-threshold", "256")) == ["256"]
    assert threshold(argv(False)) == []
    assert "--enforce-eager" not in argv(True) + argv(False)
    assert "--enforce-eager" in argv(True, "--enforce-eager")
