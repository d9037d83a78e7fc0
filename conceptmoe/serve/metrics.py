"""The server's counters and histograms, rendered in Prometheus' text exposition format (``/metrics``).

Updated from the engine thread (``Metrics.finished``) and read by the HTTP thread; a lock keeps
a scrape consistent. Names follow Prometheus conventions (``_total`` counters, ``_seconds``).
"""

from __future__ import annotations

import threading

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.n += 1

    def render(self, name: str, help_: str) -> list[str]:
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return lines + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.n}"]


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.finished_total: dict[str, int] = {}
        self.prompt_tokens = self.generation_tokens = self.preemptions = 0
        self.concepts = self.concept_tokens = 0  # over finished ConceptMoE requests
        self.ttft, self.tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)

    def finished(self, req) -> None:
        """Account for a request that left the engine (any reason)."""
        with self.lock:
            self.finished_total[req.finish_reason] = self.finished_total.get(req.finish_reason, 0) + 1
            self.prompt_tokens += len(req.prompt)
            self.generation_tokens += len(req.generated)
            self.preemptions += req.preemptions
            if req.concepts:
                self.concepts += req.concepts
                self.concept_tokens += req.seen - (1 if req.generated else 0)
            if req.first_token is not None:
                self.ttft.observe(req.first_token - req.arrival)
                if len(req.generated) > 1 and req.finished is not None:
                    self.tpot.observe((req.finished - req.first_token) / (len(req.generated) - 1))

    def render(self, engine: dict, prefix: str = "conceptmoe") -> str:
        """All metrics; ``engine`` is ``Engine.snapshot()``."""
        g = lambda name, help_, v, kind="gauge": [f"# HELP {prefix}_{name} {help_}",  # noqa: E731
                                                  f"# TYPE {prefix}_{name} {kind}", f"{prefix}_{name} {v}"]
        with self.lock:
            out = g("requests_running", "Requests in the running batch.", engine["running"])
            out += g("requests_waiting", "Requests queued for admission.", engine["waiting"])
            out += [f"# HELP {prefix}_requests_finished_total Requests that left the engine, by reason.",
                    f"# TYPE {prefix}_requests_finished_total counter"]
            out += [f'{prefix}_requests_finished_total{{reason="{k}"}} {v}' for k, v in sorted(self.finished_total.items())]
            out += g("requests_refused_total", "Requests refused (queue full, too large, shutting down).",
                     engine["refused"], "counter")
            out += g("preemptions_total", "Rows preempted (recomputed later) for lack of KV blocks.",
                     self.preemptions, "counter")
            out += g("prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens, "counter")
            out += g("generation_tokens_total", "Generated tokens of finished requests.", self.generation_tokens, "counter")
            out += [f"# HELP {prefix}_kv_blocks_used KV-pool blocks held, by kind of layer.",
                    f"# TYPE {prefix}_kv_blocks_used gauge",
                    f'{prefix}_kv_blocks_used{{kind="token"}} {engine["token_blocks_used"]}',
                    f'{prefix}_kv_blocks_used{{kind="concept"}} {engine["concept_blocks_used"]}',
                    f"# HELP {prefix}_kv_blocks_free KV-pool blocks free if the rest went to that kind.",
                    f"# TYPE {prefix}_kv_blocks_free gauge",
                    f'{prefix}_kv_blocks_free{{kind="token"}} {engine["token_blocks_free"]}',
                    f'{prefix}_kv_blocks_free{{kind="concept"}} {engine["concept_blocks_free"]}']
            out += g("kv_bytes_used", "KV-pool bytes held.", engine["bytes_used"])
            out += g("kv_bytes_budget", "KV-pool budget in bytes (--kv-cache-mb).", engine["bytes_budget"])
            out += g("kv_tensor_bytes", "Bytes of the K/V tensors held now (allocated, not the ledger).",
                     engine["kv_tensor_bytes"])
            out += g("kv_tensor_bytes_peak", "Most bytes the K/V tensors held at once.", engine["peak_kv_tensor_bytes"])
            out += g("peak_running", "Most requests held in the running batch at once.", engine["peak_running"])
            ratio = self.concept_tokens / self.concepts if self.concepts else 1.0
            out += g("compression_ratio", "Realised tokens per concept over finished requests (1: a MoE).", f"{ratio:.4f}")
            out += self.ttft.render(f"{prefix}_time_to_first_token_seconds", "Time from arrival to the first token.")
            out += self.tpot.render(f"{prefix}_time_per_output_token_seconds", "Mean time between output tokens.")
        return "\n".join(out) + "\n"
