"""The HTTP side of ``conceptmoe serve``: OpenAI's completions API on FastAPI (CONCEPTMOE.md §4).

Routes: ``POST /v1/completions`` (plain JSON or server-sent events ending in ``data: [DONE]``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text) and ``GET /`` (the
playground, one static page). Each completion becomes an engine ``Request``; the engine's events
cross from its thread into an ``asyncio.Queue`` and become text (``text.py``). A client that goes
away (a closed stream, or a plain request whose connection drops) cancels its request, so its row
leaves the batch and its KV blocks are freed at the next decode step.

Responses carry OpenAI's fields and, under the ``conceptmoe`` key that clients ignore, the concept
boundaries of the returned tokens (completion token indices and character offsets), the request's
realised compression (tokens per concept over the tokens it fed) and its KV bytes against what a
per-token cache of the same layers would hold.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, Event, Refused
from .engine import Request as EngineRequest
from .metrics import Metrics
from .protocol import ApiError, CompletionParams, Limits, error_body, parse_completion
from .text import TextTracker

POLL = 0.25  # seconds between disconnect checks of a plain (non-streamed) request


def _err(status: int, message: str, kind: str = "invalid_request_error", param=None) -> JSONResponse:
    return JSONResponse(error_body(ApiError(status, message, param, kind)), status_code=status)


def summary(engine: Engine, req: EngineRequest, tracker: TextTracker, ratio) -> dict:
    """The ``conceptmoe`` extension of a finished request."""
    lay = engine.layout
    fed = req.fed
    out = {"tokens_fed": fed, "kv_bytes": lay.token_entry_bytes * fed + lay.concept_entry_bytes * req.concepts,
           "kv_bytes_per_token_cache": lay.per_token_cache_bytes(fed), "preemptions": req.preemptions}
    if engine.concept:
        bounds = req.boundary_list
        out.update(concepts=req.concepts, compression=round(fed / max(req.concepts, 1), 4),
                   prompt_concepts=req.prompt_concepts, boundaries=bounds, boundary_offsets=tracker.offsets(bounds),
                   concept_ratio=ratio if ratio is not None else engine.design_ratio)
    return out


def create_app(engine: Engine, tok, limits: Limits, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="conceptmoe serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return JSONResponse(error_body(e), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return _err(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.get("/health")
    async def health():
        if not engine.accepting:
            return _err(503, "shutting down", "server_error")
        return {"status": "ok", **engine.snapshot()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": limits.model, "object": "model", "created": created, "owned_by": "conceptmoe",
            "max_model_len": limits.max_model_len,
            "conceptmoe": {"kind": "conceptmoe" if limits.concept else "moe", "concept_ratio": limits.ratio,
                           "elastic_ratios": limits.elastic_ratios,
                           "kv_token_entry_bytes": engine.layout.token_entry_bytes,
                           "kv_concept_entry_bytes": engine.layout.concept_entry_bytes,
                           "kv_cache_bytes": engine.pool.budget}}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine.snapshot()), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def playground():
        return HTMLResponse(resources.files(__package__).joinpath("playground.html").read_text(encoding="utf-8"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})")
        p = parse_completion(body, limits)
        ids = tok.encode(p.prompt).ids if isinstance(p.prompt, str) else list(p.prompt)
        if not ids:
            raise ApiError(400, "'prompt' encodes to no tokens", "prompt")
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        req = EngineRequest(ids, p.max_tokens, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev),
                            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                            eos=[] if p.ignore_eos else engine.eos, ratio=p.concept_ratio)
        try:
            engine.submit(req)
        except Refused as e:
            raise ApiError(e.status, str(e), kind="server_error" if e.status >= 500 else "invalid_request_error",
                           code="overloaded" if e.status == 503 else None)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": limits.model}
        tracker = TextTracker(tok, p.stop)
        if p.stream:
            return StreamingResponse(_stream(engine, req, queue, tracker, head, p), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(engine, req, queue, tracker, head, p, request)

    return app


async def _next(queue: asyncio.Queue, engine: Engine, req: EngineRequest, tracker: TextTracker) -> Event:
    """The engine's next event; a stop string met in the text ends the request here."""
    ev = await queue.get()
    tracker.add(ev.tokens)
    if tracker.stopped and ev.finish_reason is None:
        engine.cancel(req)
        ev.finish_reason = "stop"
    return ev


def _usage(req: EngineRequest) -> dict:
    return {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.generated),
            "total_tokens": len(req.prompt) + len(req.generated)}


def _failure(ev: Event) -> ApiError | None:
    if ev.finish_reason == "error":
        return ApiError(500, f"the engine failed on this request: {ev.error}", kind="server_error")
    if ev.finish_reason == "cancelled":
        return ApiError(503, "the server stopped before this request finished", kind="server_error")
    return None


async def _collect(engine, req, queue, tracker, head, p: CompletionParams, request: Request):
    while True:
        try:
            ev = await asyncio.wait_for(_next(queue, engine, req, tracker), POLL)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                engine.cancel(req)
                return _err(499, "client closed the request")
            continue
        if ev.finish_reason:
            break
    fail = _failure(ev)
    if fail:
        raise fail
    choice = {"index": 0, "text": tracker.pending(final=True), "logprobs": None, "finish_reason": ev.finish_reason}
    return {**head, "choices": [choice], "usage": _usage(req),
            "conceptmoe": summary(engine, req, tracker, p.concept_ratio)}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(engine, req, queue, tracker, head, p: CompletionParams):
    try:
        while True:
            ev = await _next(queue, engine, req, tracker)
            fail = _failure(ev)
            if fail:
                yield _sse(error_body(fail))
                break
            text = tracker.pending(final=ev.finish_reason is not None)
            ext = {"tokens": len(ev.tokens)}
            if engine.concept:
                ext.update(boundaries=ev.boundaries, boundary_offsets=tracker.offsets(ev.boundaries))
            if ev.finish_reason:
                ext["summary"] = summary(engine, req, tracker, p.concept_ratio)
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": ev.finish_reason}
                yield _sse({**head, "choices": [choice], "usage": _usage(req), "conceptmoe": ext})
                if p.include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(req)})
                break
            if text or ev.tokens or ev.boundaries:
                yield _sse({**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
                            "conceptmoe": ext})
        yield "data: [DONE]\n\n"
    finally:
        engine.cancel(req)  # a no-op once finished; frees the row of a client that went away
