"""Issues 51, 59, 60, without a server: the concept layers' KV-cache manager in vLLM's scheduler,
the scheduler-worker table, the model's bounds check; the per-request ratio; the launcher.

A request's concept group holds, for T' tokens, C + (T' - T) slots once the worker has reported
(T tokens processed, C concepts) at the safe bound, or C + the new tokens at the request's rate with
a margin under the plugin's scheduler (estimates); every allocation grants the request its capacity
under an epoch, every report carries the epoch it was made under, so a report of another life of
the block (an earlier owner, a request before its preemption) is never used, nor a torn one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_helpers import need_vllm

need_vllm()

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from conceptmoe.vllm_plugin import feedback  # noqa: E402
from conceptmoe.vllm_plugin.feedback import (BROKEN, ESTIMATED, HANDLED, OVERFLOW, FeedbackError,  # noqa: E402
                                             FeedbackTable)
from conceptmoe.vllm_plugin.cache import ConceptCache  # noqa: E402
from conceptmoe.vllm_plugin.kv import (ConceptAttentionManager, ConceptAttentionSpec, concept_slots,  # noqa: E402
                                       estimated_slots)

BLOCK = 32


@pytest.fixture
def manager(tmp_path, monkeypatch):
    monkeypatch.setattr(feedback, "FEEDBACK_DIR", tmp_path)
    monkeypatch.setattr(feedback, "_TABLES", {})
    spec = ConceptAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, compression=2.0)
    pool = BlockPool(num_gpu_blocks=64, enable_caching=False, hash_block_size=BLOCK)
    return ConceptAttentionManager(spec, pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=BLOCK)


def to_allocate(m: ConceptAttentionManager, rid: str, tokens: int, computed: int) -> int:
    return m.get_num_blocks_to_allocate(rid, tokens, new_computed_blocks=[], total_computed_tokens=computed,
                                        num_local_computed_tokens=computed, num_tokens_main_model=tokens)


def report(m: ConceptAttentionManager, rid: str, tokens: int, concepts: int, flag: int = 0, epoch=None) -> None:
    """What the worker writes after a step, under the request's grant."""
    key = m.req_to_blocks[rid][0].block_id
    m._table.report_many(np.array([key]), [m.epochs[rid] if epoch is None else epoch], [tokens], [concepts], [flag])


def test_concept_slots():
    assert concept_slots(100, None) == 100  # no report: as many slots as tokens
    assert concept_slots(100, (40, 15)) == 75  # 15 concepts for the first 40, at most one each after
    assert concept_slots(40, (40, 15)) == 15
    assert concept_slots(100, (0, 0)) == 100  # a cleared entry
    assert concept_slots(30, (40, 15)) == 30  # a report past the tokens asked for (another request's): ignored
    assert concept_slots(100, (10, 11)) == 100  # more concepts than tokens: not a report of ours


def test_estimated_slots():
    assert estimated_slots(2048, None, 0.5, 1.25, 16) == 1280 + 16  # a whole prompt at R = 2, with the margin
    assert estimated_slots(1, (100, 50), 0.5, 1.25, 16) == 1  # never past the safe bound: a decode step is exact
    assert estimated_slots(101, (100, 50), 0.5, 1.25, 16) == 51
    assert estimated_slots(1100, (1000, 800), 0.5, 1.0, 0) == 800 + 80  # its own rate (0.8) once it shows one
    assert estimated_slots(40, None, 0.5, 1.25, 16) == 40  # short chunks: the bound


def test_manager_counts_blocks_in_concepts_at_the_safe_bound(manager):
    first = manager.allocate_new_blocks("r", 16, 16)
    assert len(first) == 1  # admitted before any report: as many slots as tokens
    assert to_allocate(manager, "r", 200, 16) == 7 - 1  # still no report: 200 token slots, 7 blocks
    report(manager, "r", 16, 5)  # the worker: 16 tokens made 5 concepts
    # 5 + (200 - 16) = 189 slots: 6 blocks, one held
    assert to_allocate(manager, "r", 200, 16) == 5
    assert len(manager.allocate_new_blocks("r", 200, 200)) == 5
    assert len(manager.req_to_blocks["r"]) == 6
    epoch, capacity, mode = manager._table.grants(np.array([first[0].block_id]))[0, :3]
    assert (epoch, capacity, mode) == (manager.epochs["r"], 6 * BLOCK, 0)  # granted: bound, not estimated
    free_before = manager.block_pool.get_num_free_blocks()
    manager.free("r")
    assert manager.block_pool.get_num_free_blocks() == free_before + 6
    assert manager._table.grants(np.array([first[0].block_id]))[0].tolist() == [0] * 5  # gone with the blocks


def test_estimates_hold_a_prompt_at_concept_rate(manager):
    manager.estimates = True
    manager.rates["r"] = 0.5
    assert to_allocate(manager, "r", 2048, 0) == 41  # 1296 slots, not 2048: admission at concept rate
    manager.allocate_new_blocks("r", 2048, 2048)
    key = manager.req_to_blocks["r"][0].block_id
    epoch, capacity, mode = manager._table.grants(np.array([key]))[0, :3]
    assert capacity == 41 * BLOCK and mode == ESTIMATED | HANDLED
    report(manager, "r", 2048, 1010)
    assert to_allocate(manager, "r", 2049, 2048) == 0  # one decode token: the bound, within what it holds
    manager.safe.add("r")  # after an overflow: the safe bound from then on
    assert to_allocate(manager, "r", 4096, 2048) == 96 - 41


def test_a_report_of_another_life_is_not_used(manager):
    first = manager.allocate_new_blocks("a", 16, 16)
    stale = manager.epochs["a"]
    report(manager, "a", 16, 2)
    manager.free("a")
    again = manager.allocate_new_blocks("b", 16, 16)
    key = again[0].block_id
    # a report of a's (late, under its epoch) lands on b's block: b does not read it
    manager._table.report_many(np.array([key]), [stale], [16], [2], [0])
    assert manager.epochs["b"] != stale
    assert to_allocate(manager, "b", 100, 16) == 4 - 1
    assert manager.flag("b") == 0


def test_a_torn_report_is_not_used(manager):
    manager.allocate_new_blocks("r", 16, 16)
    report(manager, "r", 16, 2)
    assert to_allocate(manager, "r", 100, 16) == 3 - 1  # 2 + 84 = 86 slots: 3 blocks
    key = manager.req_to_blocks["r"][0].block_id
    manager._table.table[key, feedback._R] += 1  # a write under way (odd sequence number)
    assert to_allocate(manager, "r", 100, 16) == 4 - 1  # as without a report
    manager._table.table[key, feedback._R] += 1
    assert to_allocate(manager, "r", 100, 16) == 3 - 1


def test_the_table_is_shared_by_pid_and_key_and_made_by_the_scheduler_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(feedback, "FEEDBACK_DIR", tmp_path)
    monkeypatch.setenv(feedback.KEY_ENV, "k1")
    scheduler = FeedbackTable(1234, 8, fresh=True)
    worker = FeedbackTable(1234)
    assert worker.num_blocks == 8
    worker.report_many(np.array([3]), [7], [40], [17], [0])
    assert scheduler.report(3, 7) == (40, 17, 0)
    assert scheduler.report(3, 8) is None  # another epoch's
    assert oct(scheduler.path.stat().st_mode & 0o777) == oct(0o600) and "k1" in scheduler.path.name
    # a table of that name made already (another engine's, another user's, or planted): refused, one line
    with pytest.raises(FeedbackError, match="exists already") as e:
        FeedbackTable(1234, 8, fresh=True)
    assert "\n" not in str(e.value)
    monkeypatch.setenv(feedback.KEY_ENV, "k2")  # another launch: another name, nothing shared
    with pytest.raises(FeedbackError, match="cannot open"):
        FeedbackTable(1234)
    other = FeedbackTable(1234, 8, fresh=True)
    assert other.path != scheduler.path and other.report(3, 7) is None
    scheduler.path.chmod(0o644)  # open to others: the model refuses it
    monkeypatch.setenv(feedback.KEY_ENV, "k1")
    with pytest.raises(FeedbackError, match="open to others"):
        FeedbackTable(1234)


def test_each_launch_draws_its_own_key(monkeypatch):
    monkeypatch.delenv(feedback.KEY_ENV, raising=False)
    a = feedback.session_key()
    assert a == feedback.session_key() and len(a) == 32
    monkeypatch.delenv(feedback.KEY_ENV)
    assert feedback.session_key() != a


def test_a_table_that_cannot_be_opened_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(feedback, "FEEDBACK_DIR", tmp_path / "missing" / "dir")
    monkeypatch.setattr(feedback, "_TABLES", {})
    spec = ConceptAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, compression=2.0)
    pool = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=BLOCK)
    with pytest.raises(FeedbackError, match="CONCEPTMOE_VLLM_FEEDBACK_DIR"):
        ConceptAttentionManager(spec, pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=BLOCK)


def test_the_model_writes_no_concept_past_its_grant():
    """admit: every request's concepts against each group's grant (epoch, capacity, mode)."""
    cache, none = ConceptCache(None, []), np.zeros(4, dtype=bool)
    firsts, counts = [10, 60, 0, 5], [3, 10, 2, 0]
    grants = [np.array([[1, 32, ESTIMATED | HANDLED], [2, 64, ESTIMATED | HANDLED], [3, 32, HANDLED],
                        [4, 0, HANDLED]])]
    assert cache.admit(grants, firsts, counts, none).tolist() == [0, OVERFLOW, 0, 0]  # 70 > 64, estimated
    grants[0][1, 2] = HANDLED  # the same, under a bound grant: a bug, the request is ended
    assert cache.admit(grants, firsts, counts, none).tolist() == [0, BROKEN, 0, 0]
    grants[0][2, 0] = 0  # no grant for a request with concepts: nothing to write into
    assert cache.admit(grants, firsts, counts, none).tolist() == [0, BROKEN, BROKEN, 0]
    grants[0][:, 2] &= ~HANDLED  # no scheduler acts on flags: vLLM stops rather than serve it
    with pytest.raises(RuntimeError, match="refusing to write outside its blocks"):
        cache.admit(grants, firsts, counts, none)
    missing = np.array([False, False, False, True])  # a prefix hit whose snapshot is not there: ended
    grants[0][:, 2] |= HANDLED
    assert cache.admit(grants, firsts, counts, missing).tolist() == [0, BROKEN, BROKEN, BROKEN]


def test_a_flagged_requests_concepts_are_dropped():
    from conceptmoe.vllm_plugin.state import Batch, drop_requests

    batch = Batch(starts=[0, 4, 9], ends=[4, 9, 12], done=[0, 0, 0], rows=[0, 1, 2])
    b = torch.tensor([1, 0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.bool)
    counts = [2, 3, 2]
    c_raw = torch.arange(7.0)[:, None]
    c_pos, c_p = torch.arange(7), torch.full((7,), 0.9)
    raw, pos, p, counts2, b2 = drop_requests([1], c_raw, c_pos, c_p, counts, b, batch)
    assert raw.flatten().tolist() == [0, 1, 5, 6] and pos.tolist() == [0, 1, 5, 6]
    assert counts2 == [2, 0, 2] and not b2[4:9].any() and b2[:4].equal(b[:4]) and b2[9:].equal(b[9:])


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


def test_launcher_flags(tmp_path):
    """A ConceptMoE gets the plugin's scheduler (large prefill chunks: no threshold any more) unless
    --vllm-args names one; a MoE gets vLLM's; neither is forced eager on CPU; the KV size is always
    passed as bytes; on CUDA a ConceptMoE gets the flags it needs."""
    from conceptmoe.vllm_plugin import SCHEDULER
    from conceptmoe.vllm_plugin.launch import VllmServeConfig, choose_kv_bytes, server_command

    def argv(concept: bool, *extra: str, **kw) -> list[str]:
        return server_command(VllmServeConfig("r", extra=list(extra), **kw), tmp_path, concept)[0]

    def value(a: list[str], flag: str) -> list[str]:
        return [a[i + 1] for i, x in enumerate(a) if x == flag]

    assert value(argv(True), "--scheduler-cls") == [SCHEDULER]
    assert value(argv(True, "--scheduler-cls", "x.y:Z"), "--scheduler-cls") == ["x.y:Z"]
    assert value(argv(False), "--scheduler-cls") == []
    assert "--long-prefill-token-threshold" not in argv(True) + argv(False)
    assert "--enforce-eager" not in argv(True) + argv(False)
    assert "--enforce-eager" in argv(True, "--enforce-eager")
    assert value(argv(True, kv_cache_mb=64), "--kv-cache-memory-bytes") == [str(64 * 2 ** 20)]
    assert len(value(argv(True), "--kv-cache-memory-bytes")) == 1  # chosen here, never vLLM's 92% rule
    cuda, env = server_command(VllmServeConfig("r", device="cuda"), tmp_path, True)
    assert "--no-async-scheduling" in cuda and "--enforce-eager" in cuda and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    gib = 2 ** 30
    assert choose_kv_bytes(20 * gib, gib) == (17 * gib) // 4
    assert choose_kv_bytes(gib, gib) == 256 * 2 ** 20  # little to give: the built-in server's 256 MiB
    assert choose_kv_bytes(1000 * gib, gib) == 16 * gib


def test_stages_of_one_method_keep_their_own_graphs():
    """Two stages compiled from one method with the same options share dynamo's cache entries (the
    decode step's graph for one concept, that size specialized, and its graph for several). The
    guards a stage keeps (``stages.shape_guards``: not the weights') must tell them apart; with the
    shape guards alone, the several-concept call ran the one-concept graph (vLLM turns inductor's
    size asserts off: a heap overrun there)."""
    from conceptmoe.vllm_plugin.stages import shape_guards

    lin = torch.nn.Linear(8, 8)

    def f(h, at):
        return lin(h[at]) * 2

    h = torch.randn(6, 8)
    with torch.no_grad():
        one, several = (torch.compile(f, dynamic=True, options={"guard_filter_fn": shape_guards}) for _ in "ab")
        for g, at in [(one, [1]), (several, [1, 2]), (one, [4]), (several, [0, 3, 5]), (one, [2])]:
            at = torch.tensor(at)
            torch.testing.assert_close(g(h, at), f(h, at))


def test_a_flagged_request_is_recomputed_where_it_fits_or_ended():
    """Issue 68: a recompute at the safe bound needs one slot a token in every group; where the pool
    cannot hold that, the estimate's margin doubles (each flag again) while it is short of the bound
    and fits; beyond that the request is ended rather than left blocking the queue."""
    from conceptmoe.vllm_plugin.sched import recompute_plan

    one = [(32, 0.5, 1.25, 16, 1.0)]  # a concept group at R = 2, today's estimate
    assert recompute_plan(200, 14, [32], one) == "safe"  # 7 + 7 blocks
    assert recompute_plan(200, 13, [32], one) is None  # doubled, 200 x 0.5 x 2.5 + 16 >= 200: the bound, too big
    assert recompute_plan(200, 11, [32], [(32, 0.5, 0.1, 0, 1.0)]) == [2.0]  # 7 + cdiv(20, 32) = 8 <= 11
    assert recompute_plan(200, 11, [32], [(32, 0.5, 0.1, 0, 8.0)]) is None  # 7 + cdiv(160, 32) = 12 > 11
    assert recompute_plan(200, 100, [32], [(32, 0.5, 0.1, 0, 8.0)]) == "safe"
    two = [(32, 0.5, 0.1, 0, 1.0), (32, 0.5, 0.1, 0, 4.0)]  # several concept groups: each its own boost
    assert recompute_plan(200, 12, [32], two) == [2.0, 8.0]


def test_a_prefix_hit_shares_full_concept_blocks_copies_the_last_and_ends_with_eviction(tmp_path, monkeypatch):
    """Prefix caching (prefix.py) without a server: request a's snapshots registered after its step;
    b, sharing its first two token blocks, hits 64 tokens with a's 37 concepts: its row is a lead
    block of its own, a's first concept block shared, and a copy of a's second (5 of its slots are
    the prefix's; b appends there); once a's blocks are evicted, nothing hits."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from conceptmoe.vllm_plugin.prefix import Hit, PrefixIndex

    monkeypatch.setattr(feedback, "FEEDBACK_DIR", tmp_path)
    monkeypatch.setattr(feedback, "_TABLES", {})
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BLOCK)
    spec = ConceptAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, compression=2.0)
    token = FullAttentionManager(FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32),
                                 pool, enable_caching=True, kv_cache_group_id=0, scheduler_block_size=BLOCK)
    concept = ConceptAttentionManager(spec, pool, enable_caching=True, kv_cache_group_id=1, scheduler_block_size=BLOCK)
    pool.conceptmoe_prefix = index = PrefixIndex(pool, [0], [token], concept._table, BLOCK)
    hashes = [bytes([i]) * 32 for i in range(3)]

    def lookup(hs, max_length):
        (hit,), n = ConceptAttentionManager.find_longest_cache_hit(hs, max_length, [1], pool, spec, False, BLOCK)
        return hit, n

    a = SimpleNamespace(request_id="a", block_hashes=hashes, num_computed_tokens=96)
    token.allocate_new_blocks("a", 96, 96)
    concept.allocate_new_blocks("a", 96, 96)  # the safe bound: 96 concept slots after the lead block
    assert len(concept.req_to_blocks["a"]) == 1 + 3
    for h, blk in zip(hashes, token.req_to_blocks["a"]):  # what vLLM does for the token group at allocation
        pool._insert_block_hash(make_block_hash_with_group_id(h, 0), blk, None)
    assert lookup(hashes, 96)[1] == 0  # nothing registered yet: the step has not run
    ids = np.array([b.block_id for b in token.req_to_blocks["a"]])
    epoch = concept.epochs["a"]
    concept._table.snapshot_many(ids, [epoch] * 3, [32, 64, 96], [20, 37, 50])  # the worker's, after the step
    index.register(a, epoch, [concept])
    assert index.done["a"] == (epoch, 3)

    hit, n = lookup(hashes[:2] + [b"x" * 32], 95)
    assert (n, hit.tokens, hit.concepts) == (64, 64, 37) and isinstance(hit, Hit)
    assert hit.snapshot == (token.req_to_blocks["a"][1].block_id, epoch)  # where the model copies the state from
    a_row = concept.req_to_blocks["a"]
    assert list(hit) == a_row[1:3]  # ceil(37 / 32) = 2 concept blocks, after a's lead block
    assert lookup(hashes, 95)[1] == 64 and lookup(hashes, 96)[1] == 96  # at most max_length tokens
    assert lookup([b"y" * 32, b"z" * 32], 64)[1] == 0  # another prefix (hashes chain: every block differs)
    free = pool.get_num_free_blocks()
    need = concept.get_num_blocks_to_allocate("b", 80, hit, 64, 64, 80)
    concept.add_local_computed_blocks("b", hit, 64, 0)
    concept.allocate_new_blocks("b", 80, 80)
    row = concept.req_to_blocks["b"]
    assert free - pool.get_num_free_blocks() == need == 2  # its lead block and the copy (37 + 16 <= 64 slots)
    assert row[1] is a_row[1] and row[2] is not a_row[2] and row[0] not in a_row
    assert [(s.block_id, d.block_id) for s, d in concept.take_pending_cow_copies()] == [(a_row[2].block_id,
                                                                                        row[2].block_id)]
    assert concept.hits["b"][:2] == (64, 37) and concept._report("b") == (64, 37)  # b's slots start from the hit
    # a request whose step is flagged (c): its token blocks, never committed, leave vLLM's cache
    c = SimpleNamespace(request_id="c", block_hashes=[b"c" * 32], num_computed_tokens=32)
    token.allocate_new_blocks("c", 32, 32)
    pool._insert_block_hash(make_block_hash_with_group_id(c.block_hashes[0], 0), token.req_to_blocks["c"][0], None)
    index.uncommitted("c")
    assert token.req_to_blocks["c"][0].block_hash is None
    for m in (token, concept):
        for rid in ("a", "b"):
            m.free(rid)
    pool.get_new_blocks(pool.get_num_free_blocks())  # everything reused: a's blocks evicted
    assert lookup(hashes, 96)[1] == 0
