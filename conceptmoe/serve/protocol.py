"""The OpenAI completions request as this server reads it, validated field by field.

``parse_completion(body, limits)`` turns a decoded JSON body into ``CompletionParams`` or raises
``ApiError`` with the status and message the client gets, in OpenAI's error JSON (``error_body``).
Fields OpenAI defines that this server does not implement are refused when they would change the
answer (``n`` > 1, ``logprobs``, ``echo``, penalties), never silently ignored; unknown fields are
refused too. Extensions, which OpenAI clients pass through ``extra_body``: ``top_k`` and ``ignore_eos``
(as vLLM; the load generator asks for fixed output lengths) and ``concept_ratio`` (an elastic
run's R for this request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..model.config import ModelConfig
from ..model.elastic import check_ratio


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


@dataclass
class Limits:
    """What the served run accepts: its name, its ``ModelConfig`` and the server's length limit."""

    model: str
    cfg: ModelConfig
    max_model_len: int

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def concept(self) -> bool:
        return self.cfg.is_concept

    @property
    def ratio(self) -> float | None:
        """The fixed or design R (None: a MoE)."""
        return self.cfg.compression_ratio if self.concept else None

    @property
    def elastic_ratios(self) -> list[float] | None:
        return self.cfg.elastic_ratios if self.concept else None


@dataclass
class CompletionParams:
    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    concept_ratio: float | None = None
    ignore_eos: bool = False


# Fields OpenAI defines that are accepted only at the value that changes nothing.
NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0,
           "suffix": None, "logit_bias": None}
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
         "stream_options", "concept_ratio", "ignore_eos", "user"} | set(NEUTRAL)
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI's limit on stop sequences, and a sane length for each


def _number(body: dict, name: str, default, lo=None, hi=None, integer=False, open_lo=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'} (got {v!r})", name)
    if not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be finite (got {v!r})", name)
    if lo is not None and (v <= lo if open_lo else v < lo):
        raise ApiError(400, f"'{name}' must be {'>' if open_lo else '>='} {lo} (got {v!r})", name)
    if hi is not None and v > hi:
        raise ApiError(400, f"'{name}' must be <= {hi} (got {v!r})", name)
    return v


def _prompt(body: dict, lim: Limits) -> str | list[int]:
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one, as some clients send it
    if isinstance(p, str):
        if not p:
            raise ApiError(400, "'prompt' is empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < lim.vocab_size]
        if bad:
            raise ApiError(400, f"'prompt' holds token id {bad[0]} outside the vocabulary [0, {lim.vocab_size})",
                           "prompt")
        return p
    if isinstance(p, list) and not p:
        raise ApiError(400, "'prompt' is empty", "prompt")
    if isinstance(p, list) and all(isinstance(x, (str, list)) for x in p):
        raise ApiError(400, "one prompt per request: send several requests (they are batched together)", "prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt")


def _stop(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    stops = [s] if isinstance(s, str) else s
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in stops):
        raise ApiError(400, f"'stop': at most {MAX_STOPS} sequences of at most {MAX_STOP_CHARS} characters", "stop")
    return stops


def _ratio(body: dict, lim: Limits) -> float | None:
    """The request's R for an elastic run (None: the design ratio); the check every entry point
    shares (``model/elastic.py``), without its hint at extrapolation, which the API does not offer."""
    r = _number(body, "concept_ratio", None)
    if r is None:
        return None
    why = check_ratio(lim.cfg, [float(r)], flag="'concept_ratio'")
    if why:
        raise ApiError(400, why.split("; pass ")[0], "concept_ratio")
    return float(r) if lim.elastic_ratios else None


def parse_completion(body, lim: Limits) -> CompletionParams:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] is not None and body[name] != neutral:
            raise ApiError(400, f"'{name}' is not supported by this server (only {neutral!r})", name)
    model = body.get("model")
    if model is not None and model != lim.model:
        raise ApiError(404, f"the model '{model}' does not exist here; this server serves '{lim.model}'",
                       "model", code="model_not_found")
    stream, ignore_eos = body.get("stream", False), body.get("ignore_eos", False)
    for name, v in (("stream", stream), ("ignore_eos", ignore_eos)):
        if not isinstance(v, bool):
            raise ApiError(400, f"'{name}' must be true or false (got {v!r})", name)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise ApiError(400, "'stream_options' may hold only 'include_usage'", "stream_options")
    top_p = _number(body, "top_p", None, 0, 1, open_lo=True)
    top_k = _number(body, "top_k", None, integer=True)
    if top_k is not None and top_k < 1 and top_k != -1:  # -1: no top-k, as vLLM
        raise ApiError(400, f"'top_k' must be >= 1 or -1 (got {top_k})", "top_k")
    return CompletionParams(
        prompt=_prompt(body, lim),
        max_tokens=_number(body, "max_tokens", 16, 1, lim.max_model_len, integer=True),
        temperature=float(_number(body, "temperature", 1.0, 0, 100)),
        top_p=top_p, top_k=None if top_k in (None, -1) else top_k,
        seed=_number(body, "seed", None, 0, 2**63 - 1, integer=True),
        stop=_stop(body), stream=stream, include_usage=bool((opts or {}).get("include_usage", False)),
        concept_ratio=_ratio(body, lim), ignore_eos=ignore_eos)
