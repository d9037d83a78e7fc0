"""``conceptmoe serve`` as a process: refusals before listening, and a graceful SIGTERM / SIGINT."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hf_helpers import concept_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-proc") / "cm"
    concept_run(path, seed=0, seq_len=256)
    return path


def _serve(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "conceptmoe", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _one_line_error(p: subprocess.Popen, needle: str) -> None:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_refusals_before_anything_listens(run, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        _one_line_error(_serve(str(run), "--port", str(busy.getsockname()[1])), "cannot listen on 127.0.0.1:")
    _one_line_error(_serve(str(tmp_path / "nothing"), "--port", "0"), "is not a trained run")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not weights")
    p = _serve(str(tmp_path / "broken"), "--port", "0")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2 and err.startswith("error: ") and "Traceback" not in err
    _one_line_error(_serve(str(run), "--kv-cache-mb", "0"), "--kv-cache-mb must be > 0")
    _one_line_error(_serve(str(run), "--port", "70000"), "--port must be in")
    _one_line_error(_serve(str(run), "--port", "0", "--kv-cache-mb", "0.01"), "cannot hold one sequence")
    _one_line_error(_serve(str(run), "--served-model-name", " "), "--served-model-name must not be empty")
    _one_line_error(_serve(str(run), "--max-prefill-tokens", "0"), "--max-prefill-tokens must be >= 1")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_in_flight_requests_and_exits_0(run, sig):
    p = _serve(str(run), "--port", "0", "--grace", "20")
    line = p.stdout.readline()
    assert line.startswith("serving "), line + p.stderr.read()
    url = line.split(" at ", 1)[1].split(" ", 1)[0]
    # the "serving" line promises a listening socket: a request sent at once is answered, not refused
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    result: dict = {}

    def stream():
        body = {"prompt": "Friends, Romans", "max_tokens": 150, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            result["lines"] = [ln for ln in r.iter_lines() if ln]
    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(url + "/health", timeout=5).json()["running"] == 0:
        time.sleep(0.02)
    p.send_signal(sig)
    t.join(timeout=60)
    assert p.wait(timeout=60) == 0, p.stderr.read()
    assert "lines" in result, "the streaming request did not complete"
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2][6:])
    assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 150
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
