"""A live vLLM server started by ``conceptmoe serve --engine vllm``, on 127.0.0.1, for the tests.

vLLM starts slowly (30-40 s here), so each test module shares one server per model."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest


def need_vllm():
    """Skip with one line where vLLM is missing (CI sets CONCEPTMOE_REQUIRE_VLLM=1: fail there)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        if os.environ.get("CONCEPTMOE_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"vLLM is not installed (pip install -e \".[vllm]\"): {e}", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(argv: list[str], log: Path, env: dict, ready, timeout: float):
    """Runs ``argv`` (its output into ``log``) until ``ready(log)`` holds; stops it afterwards."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not ready(log):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server did not start (exit {proc.poll()}); log tail:\n"
                                   + log.read_text()[-3000:])
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)


@contextlib.contextmanager
def vllm_server(run: Path, log: Path, *cli: str, timeout: float = 400, env: dict | None = None):
    """Yields the base URL of ``conceptmoe serve RUN --engine vllm ...``; stops it afterwards.
    ``env``: more environment for the server."""
    port = free_port()
    argv = [sys.executable, "-m", "conceptmoe", "serve", str(run), "--engine", "vllm", "--port", str(port), *cli]
    listening = lambda f: re.search(r"^serving .* with vLLM at ", f.read_text(), re.M)  # noqa: E731
    with _server(argv, log, dict(os.environ, OMP_NUM_THREADS="2", **(env or {})), listening, timeout):
        yield f"http://127.0.0.1:{port}"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def plain_vllm_server(folder: Path, log: Path, *args: str, env: dict | None = None, timeout: float = 400):
    """Yields the base URL of vLLM's own OpenAI server on a transformers folder (no launcher of ours)."""
    from conceptmoe.vllm_plugin.launch import cpu_bind

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND=cpu_bind(), **(env or {}))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
            "--port", str(port), *args]
    with _server(argv, log, env, lambda _: _healthy(url), timeout):
        yield url


def metric(url: str, name: str) -> float:
    """One unlabelled (or summed over labels) Prometheus value from vLLM's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def complete(url: str, prompts: list[list[int]], max_tokens: int, per_prompt: list[dict] | None = None,
             **extra) -> list[list[int]]:
    """Completions of every prompt, sent concurrently; the generated token ids of each.
    ``per_prompt``: more fields for each prompt's request."""
    def one(i):
        body = {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **extra, **(per_prompt[i] if per_prompt else {})}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    out: list = [None] * len(prompts)

    def run(i):
        out[i] = one(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def complete_together(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of every prompt in one request (a list of prompts): they reach the engine
    in the same step, however slowly its API server takes requests in. The token ids of each."""
    body = {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]
