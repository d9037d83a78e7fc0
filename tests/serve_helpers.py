"""A live ``conceptmoe serve`` in a background thread of the test process, on 127.0.0.1."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import uvicorn

from conceptmoe.serve.app import create_app
from conceptmoe.serve.server import ServeConfig, bind, build


@contextlib.contextmanager
def live_server(run, **kw):
    """Yields (base_url, engine, tokenizer); stops the server and the engine afterwards."""
    cfg = ServeConfig(str(run), port=0, **kw)
    sock = bind(cfg.host, 0)
    engine, tok, limits, metrics = build(cfg)
    app = create_app(engine, tok, limits, metrics)
    engine.start()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    try:
        yield url, engine, tok
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown(0)
        sock.close()


def wait_idle(url: str, timeout: float = 10.0) -> dict:
    """/health once no request runs or waits (or the last reading at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=5).json()
        if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.02)
