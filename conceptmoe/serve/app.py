"""The HTTP side of ``conceptmoe serve``: OpenAI's completions API on FastAPI (CONCEPTMOE.md §4).

Routes: ``POST /v1/completions`` (plain JSON or server-sent events ending in ``data: [DONE]``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /`` (the
playground, one static page) and ``GET /openapi.json`` (the request's schema: ``openapi.py``).
Each choice of a completion (``n`` per prompt, one or more prompts) becomes an engine
``Request``; the engine's events cross from its thread into one ``asyncio.Queue`` per
completion and become text and log-probabilities (``choice.py``). A client
that goes away (a closed stream, or a plain request whose connection drops, checked at every
token) cancels its requests, so their rows leave the batch and free their KV blocks at the next
step. A choice the engine fails on ends the completion with OpenAI's error JSON (500, or an
error event in a stream); the engine and other completions go on.

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

from .choice import Choice
from .engine import Engine, Refused
from .engine import Request as EngineRequest
from .metrics import Metrics
from .openapi import completions_openapi
from .protocol import ApiError, CompletionParams, Limits, error_body, parse_completion

POLL = 0.25  # seconds between disconnect checks of a plain (non-streamed) request while no token arrives


def _err(status: int, message: str, kind: str = "invalid_request_error", param=None) -> JSONResponse:
    return JSONResponse(error_body(ApiError(status, message, param, kind)), status_code=status)


def summary(engine: Engine, req: EngineRequest, tracker, ratio) -> dict:
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

    @app.post("/v1/completions", openapi_extra=completions_openapi(limits))
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})")
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply to parse") from None
        p = parse_completion(body, limits)
        if len(p.prompts) * p.n > engine.max_waiting:  # it would be refused as busy, and busy forever
            raise ApiError(400, f"{len(p.prompts)} prompts x n={p.n} choices are more than the server ever "
                                f"queues at once ({engine.max_waiting}, --max-waiting)", "n")
        prompts = [tok.encode(x).ids if isinstance(x, str) else list(x) for x in p.prompts]
        if not all(prompts):
            raise ApiError(400, "'prompt' encodes to no tokens", "prompt")
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        choices = []
        for pi, ids in enumerate(prompts):
            for j in range(p.n):
                index = pi * p.n + j
                req = EngineRequest(
                    ids, p.max_tokens, lambda ev, i=index: loop.call_soon_threadsafe(queue.put_nowait, (i, ev)),
                    temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                    seed=None if p.seed is None else p.seed + j, eos=[] if p.ignore_eos else engine.eos,
                    ratio=p.concept_ratio, repetition_penalty=p.repetition_penalty,
                    presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                    min_tokens=p.min_tokens, logit_bias=p.logit_bias, stop_token_ids=p.stop_token_ids,
                    logprobs=p.logprobs, prompt_logprobs=p.logprobs if p.echo else None)
                echo = (p.prompts[pi] if isinstance(p.prompts[pi], str) else tok.decode(ids)) if p.echo else None
                choices.append(Choice(index, req, tok, p.stop, echo, p.logprobs is not None))
        try:
            for c in choices:
                engine.submit(c.req)
        except Refused as e:
            for c in choices:
                engine.cancel(c.req)
            raise ApiError(e.status, str(e), kind="server_error" if e.status >= 500 else "invalid_request_error",
                           code="overloaded" if e.status == 503 else None)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": limits.model}
        done = Completion(engine, choices, queue, p)
        if p.stream:
            return StreamingResponse(_stream(done, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(done, head, request)

    return app


class Completion:
    """The choices of one completion and the queue their events arrive on."""

    def __init__(self, engine: Engine, choices: list[Choice], queue: asyncio.Queue, p: CompletionParams) -> None:
        self.engine, self.choices, self.queue, self.p = engine, choices, queue, p

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def cancel(self) -> None:
        for c in self.choices:
            self.engine.cancel(c.req)  # a no-op once finished

    async def next(self, timeout: float | None = None) -> tuple[Choice, str, dict | None]:
        i, ev = await asyncio.wait_for(self.queue.get(), timeout)
        c = self.choices[i]
        text, lp = c.take(ev, self.engine.cancel)
        return c, text, lp

    def failure(self) -> ApiError | None:
        for c in self.choices:
            if c.finish_reason == "error":
                return ApiError(500, f"the engine failed on this request: {c.error}", kind="server_error")
            if c.finish_reason == "cancelled":
                return ApiError(503, "the server stopped before this request finished", kind="server_error")
        return None

    def usage(self) -> dict:
        seen, prompt = set(), 0
        for c in self.choices:  # each prompt counts once, whatever n
            if c.index // self.p.n not in seen:
                seen.add(c.index // self.p.n)
                prompt += len(c.req.prompt)
        completion = sum(c.tracker.count for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def summary(self, c: Choice) -> dict:
        return summary(self.engine, c.req, c.tracker, self.p.concept_ratio)


async def _collect(done: Completion, head: dict, request: Request):
    try:
        while not done.done:
            try:
                c, _, _ = await done.next(POLL)
            except asyncio.TimeoutError:
                c = None
            # checked at every token too: a client gone while tokens arrive is noticed within a step
            if await request.is_disconnected():
                done.cancel()
                return _err(499, "client closed the request")
            if c is not None and c.finish_reason in ("error", "cancelled"):
                break
    finally:
        if not done.done:
            done.cancel()
    fail = done.failure()
    if fail:
        raise fail
    choices = [c.answer() for c in done.choices]
    if len(choices) > 1:
        for ch, c in zip(choices, done.choices):
            ch["conceptmoe"] = done.summary(c)
    return {**head, "choices": choices, "usage": done.usage(), "conceptmoe": done.summary(done.choices[0])}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(done: Completion, head: dict):
    engine = done.engine
    try:
        while not done.done:
            c, text, lp = await done.next()
            fail = done.failure()
            if fail:
                yield _sse(error_body(fail))
                break
            ev = c.last
            ext = {"tokens": len(ev.tokens)}
            if engine.concept:
                ext.update(boundaries=ev.boundaries, boundary_offsets=c.tracker.offsets(ev.boundaries))
            choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
            if c.done:
                ext["summary"] = done.summary(c)
                last = done.done
                yield _sse({**head, "choices": [choice], **({"usage": done.usage()} if last else {}),
                            "conceptmoe": ext})
                if last and done.p.include_usage:
                    yield _sse({**head, "choices": [], "usage": done.usage()})
            elif text or lp or ev.tokens or ev.boundaries:
                yield _sse({**head, "choices": [choice], "conceptmoe": ext})
        yield "data: [DONE]\n\n"
    finally:
        done.cancel()  # a no-op once finished; frees the rows of a client that went away
