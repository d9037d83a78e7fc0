"""vLLM's scheduler with the ConceptMoE's concept cache allocated from an estimate (CONCEPTMOE.md §4;
``kv.py`` for the managers, ``feedback.py`` for the channel).

Load it with ``--scheduler-cls conceptmoe.vllm_plugin.sched.ConceptScheduler`` (``conceptmoe serve
--engine vllm`` does). It turns the concept managers' estimates on, tells them each request's R
(its ``concept_ratio``, else the export's), and after every step reads the model's flags:

- ``OVERFLOW``: the step made more concepts than the estimate granted. Nothing of the request's
  concepts was written; everything the step produced for it (its sampled token, its prompt
  log-probabilities) is dropped and it is preempted, so vLLM recomputes it from its first token,
  this time at the safe bound; the worker forgets the step too (``recompute.py``: the seeded
  generator's draw, the prompt log-probabilities already returned). Its tokens stay exact, and a
  seeded request's text is the one it gives unflagged.
- ``BROKEN``: a bound grant was short, which should never happen: the request ends with an error
  (finish reason ``error``), logged, and nothing else is touched.

Without this scheduler the managers allocate at the safe bound, which is never short.

With prefix caching it also keeps the concept side's prefix index (``prefix.py``): after every
step, before finished requests free their blocks, it registers the snapshots the model wrote, and
a request at an R other than the export's gets its R in its hashes.
"""

from __future__ import annotations

import logging
import time

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from .feedback import BROKEN, OVERFLOW
from .kv import ConceptAttentionManager, estimated_slots
from .prefix import PrefixIndex, salted
from .ratio import request_ratio

logger = logging.getLogger("vllm.conceptmoe")  # under vLLM's logger: its handler and level


def recompute_plan(n: int, pool: int, token: list[int], concept: list[tuple]) -> str | list[float] | None:
    """How to recompute a flagged request of ``n`` tokens with ``pool`` blocks in all, ``token``
    the token groups' block sizes, ``concept`` each concept group's (block size, rate, margin, pad,
    margin boost so far). "safe": at the safe bound, one slot a token in every group, when the
    pool could hold that (the request is then admitted as soon as blocks free up, and cannot stall
    the queue behind it). Otherwise (a KV budget vLLM accepted for max_model_len / R concepts) the
    estimate with its margin doubled, the new boosts, while that is short of the bound and the pool
    could hold it. None: nothing that fits can serve it."""
    need = sum(-(-n // b) for b in token)
    if need + sum(-(-n // c[0]) for c in concept) <= pool:
        return "safe"
    boosts = []
    for block, rate, margin, pad, boost in concept:
        boosts.append(boost * 2)
        slots = estimated_slots(n, None, rate, margin * boosts[-1], pad)
        if slots >= n:  # the estimate has reached the bound, which does not fit
            return None
        need += -(-slots // block)
    return None if need > pool else boosts


class ConceptScheduler(Scheduler):
    """vLLM's scheduler, acting on the ConceptMoE's flags (see the module's docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.concept_managers = [m for m in self.kv_cache_manager.coordinator.single_type_managers
                                 if isinstance(m, ConceptAttentionManager)]
        for m in self.concept_managers:
            m.estimates = True
        if self.concept_managers:
            m = self.concept_managers[0]
            logger.info("ConceptMoE: concept slots from estimates (new tokens / R x %g + %d), %d concept group(s)",
                        m.margin, m.pad, len(self.concept_managers))
        self.recomputed = 0  # requests recomputed after an estimate fell short
        self.prefix = self._prefix_index()

    def _group_of(self, layer: str) -> int:
        """The KV-cache group that holds the model's layer ``layer`` (``token_attn.0``, ``concept_attn.0``)."""
        groups = self.kv_cache_config.kv_cache_groups
        return next(i for i, g in enumerate(groups) if any(n.endswith(layer) for n in g.layer_names))

    def _prefix_index(self) -> PrefixIndex | None:
        managers = self.kv_cache_manager.coordinator.single_type_managers
        if not self.concept_managers or not self.concept_managers[0].enable_caching:
            return None
        token = self._group_of("token_attn.0")  # the group whose blocks the model's snapshots are keyed by
        first = managers[self._group_of("concept_attn.0")]  # the group whose epoch the model writes
        self.concept_managers.sort(key=lambda m: m is not first)
        m = self.concept_managers[0]
        tokens = sorted((i for i, t in enumerate(managers) if not isinstance(t, ConceptAttentionManager)),
                        key=lambda i: i != token)
        index = PrefixIndex(m.block_pool, tokens, [managers[i] for i in tokens], m._table, m.block_size)
        m.block_pool.conceptmoe_prefix = index  # where the managers' hit finder (a classmethod) finds it
        logger.info("ConceptMoE: prefix caching on (concept blocks and snapshots registered after each step)")
        return index

    def add_request(self, request) -> None:
        ratio = request_ratio(request.sampling_params) if request.sampling_params is not None else None
        for m in self.concept_managers:
            m.rates[request.request_id] = 1.0 / (ratio or m.kv_cache_spec.compression)
        if self.prefix is not None:
            salted(request, ratio, self.concept_managers[0].kv_cache_spec.compression)
        super().add_request(request)

    def _register(self, scheduler_output, flags: dict[str, int]) -> None:
        """The snapshots of the step's unflagged requests, into the prefix index."""
        m = self.concept_managers[0]
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if req_id not in flags and request is not None and req_id in m.epochs:
                self.prefix.register(request, m.epochs[req_id], self.concept_managers)

    def _flags(self, scheduler_output) -> dict[str, int]:
        """The flagged requests of the step (one read of the table per concept group)."""
        ids = list(scheduler_output.num_scheduled_tokens)
        worst = [max(fs) for fs in zip(*(m.flags(ids) for m in self.concept_managers))]
        return {r: f for r, f in zip(ids, worst) if f}

    def update_from_output(self, scheduler_output, model_runner_output):
        flags = self._flags(scheduler_output) if self.concept_managers else {}
        if self.prefix is not None:
            self._register(scheduler_output, flags)
            for req_id in flags:
                self.prefix.uncommitted(req_id)
        out = model_runner_output
        for req_id in flags:  # everything the step made for a flagged request is dropped (recompute.py)
            i = out.req_id_to_index.get(req_id)
            if i is not None and out.sampled_token_ids and i < len(out.sampled_token_ids):
                out.sampled_token_ids[i] = []
            for made in (out.prompt_logprobs_dict, out.prompt_token_id_logprobs_dict):
                if made:
                    made.pop(req_id, None)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if not flags:
            return outputs
        now = time.monotonic()
        broken = []
        for req_id, f in flags.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if f == BROKEN:
                broken.append(req_id)
            elif f == OVERFLOW and request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._preempt_request(request, now)
                how = self._plan_recompute(request)
                if how is None:
                    broken.append(req_id)
                    logger.error("ConceptMoE: request %s makes more concepts than this KV cache can hold for it "
                                 "(%d tokens); ended with an error", req_id, request.num_tokens)
                    continue
                self.recomputed += 1
                logger.info("ConceptMoE: request %s made more concepts than its estimate; recomputed at %s "
                            "(%d so far)", req_id, how, self.recomputed)
        for request in self.finish_requests(broken, RequestStatus.FINISHED_ERROR) if broken else []:
            out = EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                   finish_reason=request.get_finished_reason(), events=request.take_events(),
                                   trace_headers=request.trace_headers)
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(out)
        return outputs

    def _plan_recompute(self, request) -> str | None:
        """How a flagged request is recomputed (``recompute_plan``); sets the managers' state for it."""
        rid = request.request_id
        token = [m.block_size for m in self.kv_cache_manager.coordinator.single_type_managers
                 if not isinstance(m, ConceptAttentionManager)]
        concept = [(m.block_size, m.rate(rid), m.margin, m.pad, m.boost.get(rid, 1.0)) for m in self.concept_managers]
        leads = sum(m.lead for m in self.concept_managers)  # a row's lead block in each concept group
        plan = recompute_plan(request.num_tokens + 1, self.kv_cache_manager.block_pool.num_gpu_blocks - 1 - leads,
                              token, concept)
        if plan is None:
            return None
        for i, m in enumerate(self.concept_managers):
            if plan == "safe":
                m.safe.add(rid)
            else:
                m.boost[rid] = plan[i]
        return "the safe bound" if plan == "safe" else f"{max(plan):g}x the estimate's margin"

    def _free_request(self, request, *args, **kwargs):
        for m in self.concept_managers:
            m.forget(request.request_id)
        if self.prefix is not None:
            self.prefix.forget(request.request_id)
        return super()._free_request(request, *args, **kwargs)
