"""A request recomputed after a flagged step, on vLLM's worker: as if the step had never run
(CONCEPTMOE.md §4; the flag and the recompute are ``sched.py``'s).

When a step makes more concepts than a request's estimate held, the scheduler drops everything the
step produced for the request and preempts it; vLLM recomputes it from its first token. Two things
of the dropped step live on in vLLM 0.32's worker, which keeps a preempted request's state:

- **the seeded generator**: the dropped token's draw has advanced it, so the recompute would sample
  the next token from a later state and the text would drift (the same seed giving another text
  depending on chunk sizes, hence on other traffic). Each seeded row's generator state is kept
  before each sample, with the request's output count; a request resumed with that very count (its
  last sample was dropped) gets the state back.
- **prompt log-probabilities**: the worker returns them once, at the prompt's last chunk, and then
  stops computing them for the request. A request resumed with no output token has had none
  delivered (they travel with the first sampled token): the worker is told to compute them again,
  from scratch.

``patch`` wraps ``GPUModelRunner._sample`` and ``_update_states`` (idempotent); applied by
``register`` on the vLLM versions the plugin accepts. It changes nothing for a request that is not
resumed, nor for one whose last sample was kept (vLLM's own preemptions).
"""

from __future__ import annotations


def patch() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_conceptmoe_recompute", False):
        return
    sample, update_states = GPUModelRunner._sample, GPUModelRunner._update_states

    def _sample(self, *args, **kwargs):
        batch = self.input_batch
        draws = self.__dict__.setdefault("_conceptmoe_draws", {})
        discarded = self.discard_request_mask.np
        for i, gen in batch.generators.items():  # seeded rows only; a discarded draw is rewound anyway
            if i < batch.num_reqs and not discarded[i]:
                req_id = batch.req_ids[i]
                draws[req_id] = (len(self.requests[req_id].output_token_ids), gen.get_state())
        return sample(self, *args, **kwargs)

    def _update_states(self, scheduler_output):
        out = update_states(self, scheduler_output)
        draws = self.__dict__.setdefault("_conceptmoe_draws", {})
        for req_id in scheduler_output.finished_req_ids:
            draws.pop(req_id, None)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in cached.resumed_req_ids:
                continue
            state, kept = self.requests[req_id], cached.num_output_tokens[i]
            drawn = draws.get(req_id)
            if drawn is not None and drawn[0] == kept and state.generator is not None:
                state.generator.set_state(drawn[1])  # the dropped sample's draw undone
            params = state.sampling_params
            if kept == 0 and params is not None and params.prompt_logprobs is not None:
                n = params.prompt_logprobs
                self.num_prompt_logprobs[req_id] = self.input_batch.vocab_size if n == -1 else n
                state.in_progress_prompt_logprobs_cpu = None
        return out

    GPUModelRunner._sample, GPUModelRunner._update_states = _sample, _update_states
    GPUModelRunner._conceptmoe_recompute = True
