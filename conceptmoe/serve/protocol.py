"""The OpenAI completions request as this server reads it, validated field by field.

``parse_completion(body, limits)`` turns a decoded JSON body into ``CompletionParams`` or raises
``ApiError`` with the status and message the client gets, in OpenAI's error JSON (``error_body``).
Implemented beside OpenAI's fields (``n``, ``echo``, ``logprobs``, the penalties, ``logit_bias``,
several prompts): vLLM's sampling extras ``top_k``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids`` and ``ignore_eos``, which OpenAI clients pass through ``extra_body``, and
``concept_ratio`` (an elastic run's R for this request). Fields that this server does not
implement (``suffix``, ``min_p``, ...) are accepted only at the value that changes nothing, never
silently ignored; unknown fields are refused. Values that would overflow the sampling (a
temperature of 1e-39) are refused, and so are integers past 64 bits (Python would take a JSON
integer of 400 digits) and strings holding a lone UTF-16 surrogate (``"\\ud800"`` parses, but it is
not Unicode text: it can be neither tokenized nor written back as UTF-8).
"""

from __future__ import annotations

import math
import reprlib
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
    prompts: list[str | list[int]]  # one or more prompts; each gets ``n`` choices
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
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] | None = None

    @property
    def prompt(self) -> str | list[int]:
        return self.prompts[0]


# Fields OpenAI or vLLM define that are accepted only at the value that changes nothing.
NEUTRAL = {"suffix": None, "min_p": 0, "skip_special_tokens": True, "include_stop_str_in_output": False,
           "spaces_between_special_tokens": True, "add_special_tokens": True}
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
         "concept_ratio", "ignore_eos", "user", "n", "best_of", "echo", "logprobs", "repetition_penalty",
         "presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids", "logit_bias"} | set(NEUTRAL)
MAX_STOPS, MAX_STOP_CHARS = 64, 256  # stop strings per request (lm-eval sends more than OpenAI's 4), and chars each
MAX_N, MAX_PROMPTS, MAX_LOGPROBS = 16, 64, 20  # choices per prompt, prompts per request, top log-probabilities
MIN_TEMPERATURE = 0.01  # below it (and above 0) logits / temperature overflows fp32: refused, as vLLM clamps
MAX_INT = 2**63 - 1  # no field means anything past int64; a bigger JSON integer would overflow float() or torch


def _lone_surrogate(body) -> tuple[str | None, str] | None:
    """(the top-level field, the offending string's escape) of the first string in ``body`` (keys
    included) that holds a lone surrogate, or None. Iterative: any nesting that JSON parsed is walked."""
    stack = [(None, body)]
    while stack:
        field, v = stack.pop()
        if isinstance(v, dict):
            stack += [(field, k) for k in v] + [(k if field is None else field, x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(field, x) for x in v]
        elif isinstance(v, str) and not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return field, v[e.start].encode("unicode_escape").decode("ascii")
    return None


def _integral(v) -> int | None:
    """``v`` as an int when JSON calls it an integer (``5`` or ``5.0``, as JSON Schema and vLLM's
    pydantic models read it), else None (booleans are not integers here)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v if isinstance(v, int) else None


def _number(body: dict, name: str, default, lo=None, hi=None, integer=False, open_lo=False):
    v = body.get(name, default)
    if v is None:
        return default
    if integer and (i := _integral(v)) is not None:
        v = i
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'} (got {_short(v)})", name)
    if isinstance(v, int) and abs(v) > MAX_INT:
        raise ApiError(400, f"'{name}' is out of range: an integer of {len(str(abs(v)))} digits "
                            f"(at most {MAX_INT} in magnitude)", name)
    if not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be finite (got {v!r})", name)
    if lo is not None and (v <= lo if open_lo else v < lo):
        raise ApiError(400, f"'{name}' must be {'>' if open_lo else '>='} {lo} (got {v!r})", name)
    if hi is not None and v > hi:
        raise ApiError(400, f"'{name}' must be <= {hi} (got {v!r})", name)
    return v


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 40, 40, 40, 2, 4, 4


def _short(v) -> str:
    """``repr(v)`` cut short (strings, lists, nesting), for error messages about what a client sent:
    a plain ``repr`` of a deeply nested list would recurse as deep as the JSON did."""
    return _REPR.repr(v)


def _ids(p, lim: Limits, name: str) -> list[int] | None:
    """``p`` as token ids when it is a non-empty list of integers (each checked against the vocabulary)."""
    if not (isinstance(p, list) and p):
        return None
    p = [_integral(t) for t in p]
    if None in p:
        return None
    bad = [t for t in p if not 0 <= t < lim.vocab_size]
    if bad:
        raise ApiError(400, f"'{name}' holds token id {_short(bad[0])} outside the vocabulary "
                            f"[0, {lim.vocab_size})", name)
    return p


def _one_prompt(p, lim: Limits):
    if isinstance(p, str):
        if not p:
            raise ApiError(400, "'prompt' is empty", "prompt")
        return p
    ids = _ids(p, lim, "prompt")
    if ids is not None:
        return ids
    if isinstance(p, list) and not p:
        raise ApiError(400, "'prompt' is empty", "prompt")
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of either", "prompt")


def _prompts(body: dict, lim: Limits) -> list[str | list[int]]:
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):  # a batch of prompts
        if len(p) > MAX_PROMPTS:
            raise ApiError(400, f"'prompt': at most {MAX_PROMPTS} prompts per request", "prompt")
        return [_one_prompt(x, lim) for x in p]
    return [_one_prompt(p, lim)]


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


def _logit_bias(body: dict, lim: Limits) -> dict[int, float] | None:
    b = body.get("logit_bias")
    if b is None:
        return None
    if not isinstance(b, dict):
        raise ApiError(400, "'logit_bias' must map token ids to numbers", "logit_bias")
    out = {}
    for k, v in b.items():
        try:
            t = int(k)
        except ValueError:
            raise ApiError(400, f"'logit_bias': key {_short(k)} is not a token id", "logit_bias") from None
        if not 0 <= t < lim.vocab_size:
            raise ApiError(400, f"'logit_bias': token id {_short(t)} outside the vocabulary [0, {lim.vocab_size})",
                           "logit_bias")
        out[t] = float(_number({"logit_bias": v}, "logit_bias", 0, -100, 100))
    return out or None


def _stop_token_ids(body: dict, lim: Limits) -> list[int]:
    s = body.get("stop_token_ids")
    if s is None or s == []:
        return []
    ids = _ids(s, lim, "stop_token_ids")
    if ids is None or len(ids) > MAX_STOPS:
        raise ApiError(400, f"'stop_token_ids' must be a list of at most {MAX_STOPS} token ids", "stop_token_ids")
    return ids


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be true or false (got {_short(v)})", name)
    return v


def parse_completion(body, lim: Limits) -> CompletionParams:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    bad = _lone_surrogate(body)
    if bad:
        field, esc = bad
        where = f" of {field!r}" if field else ""
        raise ApiError(400, f"the request holds a lone surrogate ({esc}) in a string{where}: JSON text must "
                            f"be Unicode (a surrogate pair, or the character itself)",
                       field if field in KNOWN else None)
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] is not None and body[name] != neutral:
            raise ApiError(400, f"'{name}' is not supported by this server (only {neutral!r})", name)
    model = body.get("model")
    if model is not None and model != lim.model:
        raise ApiError(404, f"the model {_short(model)} does not exist here; this server serves '{lim.model}'",
                       "model", code="model_not_found")
    stream, ignore_eos, echo = _flag(body, "stream"), _flag(body, "ignore_eos"), _flag(body, "echo")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}
                             or opts.get("continuous_usage_stats")):
        raise ApiError(400, "'stream_options' may hold only 'include_usage'", "stream_options")
    top_p = _number(body, "top_p", None, 0, 1, open_lo=True)
    top_k = _number(body, "top_k", None, integer=True)
    if top_k is not None and top_k < 1 and top_k not in (-1, 0):  # -1 and 0: no top-k, as vLLM
        raise ApiError(400, f"'top_k' must be >= 1, or 0 or -1 for none (got {top_k})", "top_k")
    temperature = float(_number(body, "temperature", 1.0, 0, 100))
    if 0 < temperature < MIN_TEMPERATURE:
        raise ApiError(400, f"'temperature' must be 0 (greedy) or >= {MIN_TEMPERATURE} (got {temperature!r}): "
                            f"smaller ones overflow the logits", "temperature")
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise ApiError(400, f"'best_of' is not supported by this server (only equal to 'n', {n})", "best_of")
    max_tokens = _number(body, "max_tokens", 16, 0 if echo else 1, lim.max_model_len, integer=True)
    return CompletionParams(
        prompts=_prompts(body, lim), max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, top_k=None if top_k in (None, -1, 0) else top_k,
        seed=_number(body, "seed", None, 0, 2**63 - 1, integer=True),
        stop=_stop(body), stream=stream, include_usage=bool((opts or {}).get("include_usage", False)),
        concept_ratio=_ratio(body, lim), ignore_eos=ignore_eos, n=n, echo=echo,
        logprobs=_number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True),
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0, 0.01, 100)),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, -2, 2)),
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2, 2)),
        min_tokens=_number(body, "min_tokens", 0, 0, max_tokens, integer=True),
        stop_token_ids=_stop_token_ids(body, lim), logit_bias=_logit_bias(body, lim))
