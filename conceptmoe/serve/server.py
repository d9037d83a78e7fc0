"""Start the server: load a run, bind the port, run uvicorn until SIGTERM/SIGINT (``conceptmoe serve``).

The port is bound before the model is loaded, so a port in use, a missing run or a run that
cannot be served ends with one line and a non-zero exit before anything listens. On SIGTERM or
SIGINT the server stops accepting connections and requests, lets in-flight requests finish for
``grace`` seconds, cancels what is left and exits 0.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..training.checkpoint import load_run
from ..training.conventions import eos_list, max_length, token_ids
from .engine import Engine
from .metrics import Metrics
from .pool import expected_concepts
from .protocol import Limits


@dataclass
class ServeConfig:
    run: str
    host: str = "127.0.0.1"
    port: int = 8000
    kv_cache_mb: float = 256.0
    max_batch: int = 32
    max_waiting: int = 256
    max_model_len: int | None = None  # default: the run's own maximum length
    dtype: str = "fp32"
    device: str = "auto"
    grace: float = 10.0  # seconds in-flight requests get to finish after SIGTERM
    served_model_name: str | None = None  # the name clients send (default: the run directory's name)
    max_prefill_tokens: int = 2048  # prompt tokens one engine step may prefill (chunked prefill)

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port must be in [0, 65535] (got {self.port})")
        if not self.kv_cache_mb > 0:
            raise UserError(f"--kv-cache-mb must be > 0 (got {self.kv_cache_mb})")
        if self.max_batch < 1 or self.max_waiting < 0:
            raise UserError("--max-batch must be >= 1 and --max-waiting >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UserError(f"--max-model-len must be >= 2 (got {self.max_model_len})")
        if self.dtype not in ("fp32", "bf16"):
            raise UserError(f"--dtype must be fp32 or bf16 (got {self.dtype!r})")
        if not self.grace >= 0:
            raise UserError(f"--grace must be >= 0 (got {self.grace})")
        if self.max_prefill_tokens < 1:
            raise UserError(f"--max-prefill-tokens must be >= 1 (got {self.max_prefill_tokens})")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise UserError("--served-model-name must not be empty")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening); a UserError naming the reason if it cannot be."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def build(cfg: ServeConfig):
    """(engine, tokenizer, limits, metrics) of a run, ready to serve."""
    run = Path(cfg.run)
    if not (run / "model.safetensors").is_file():
        raise UserError(f"{run} is not a trained run (no model.safetensors); train, import-hf or convert one first")
    model, mcfg, tok, run_cfg = load_run(run, cfg.device)
    if mcfg.image_size:
        raise UserError(f"{run} is a vision-language run: this server serves text completions only")
    if cfg.dtype == "bf16":
        model = model.to(torch.bfloat16)
    max_len = cfg.max_model_len or max_length(run_cfg)
    eos = eos_list(token_ids(run_cfg, tok))
    metrics = Metrics()
    engine = Engine(model, int(cfg.kv_cache_mb * 2**20), cfg.max_batch, cfg.max_waiting, max_len, eos,
                    on_finish=metrics.finished, max_prefill_tokens=cfg.max_prefill_tokens)
    limits = Limits(model=cfg.served_model_name or run.resolve().name, cfg=mcfg, max_model_len=max_len)
    ratio = mcfg.compression_ratio if mcfg.is_concept else None
    one = engine.layout.bytes_for(max_len + 1, expected_concepts(max_len + 1, ratio))
    if one > engine.pool.budget:
        raise UserError(f"--kv-cache-mb {cfg.kv_cache_mb:g} cannot hold one sequence of --max-model-len {max_len} "
                        f"tokens (about {one / 2**20:.3g} MiB); raise it or lower --max-model-len")
    return engine, tok, limits, metrics


def describe(engine: Engine, limits: Limits) -> str:
    lay, budget = engine.layout, engine.pool.budget
    kind = f"ConceptMoE R={limits.ratio:g}" if limits.concept else "MoE"
    if limits.elastic_ratios:
        kind += f" (elastic {min(limits.elastic_ratios):g}-{max(limits.elastic_ratios):g})"
    per_seq = lay.bytes_for(limits.max_model_len, -(-limits.max_model_len // int(limits.ratio or 1))
                            if limits.concept else 0)
    return (f"{kind}, {engine.dtype}, KV pool {budget / 2**20:g} MiB: about {budget // max(per_seq, 1)} "
            f"sequences of {limits.max_model_len} tokens")


def serve(cfg: ServeConfig) -> int:
    import uvicorn

    from .app import create_app

    cfg.check()
    sock = bind(cfg.host, cfg.port)
    try:
        engine, tok, limits, metrics = build(cfg)
        app = create_app(engine, tok, limits, metrics)
        engine.start()

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # stop taking requests on keep-alive connections too
                engine.accepting = False
                super().handle_exit(sig, frame)
                # uvicorn re-raises a captured signal after its graceful shutdown (the process then
                # dies of it); a requested stop that finished cleanly exits 0 instead.
                getattr(self, "_captured_signals", []).clear()

        server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=cfg.grace,
                                       access_log=False))
        port = sock.getsockname()[1]
        # listen before announcing: a client that connects on the "serving" line waits in the
        # backlog until uvicorn accepts, instead of being refused
        sock.listen(2048)
        print(f"serving {cfg.run} at http://{cfg.host}:{port} ({describe(engine, limits)})", flush=True)
        server.run(sockets=[sock])
        engine.shutdown(0 if server.should_exit else cfg.grace)
    finally:
        sock.close()
    print("server stopped", file=sys.stderr, flush=True)
    return 0
