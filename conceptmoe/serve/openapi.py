"""The completions request and OpenAI's error JSON as JSON Schema, for ``/openapi.json``.

``protocol.py`` parses the body by hand (so that every refusal is OpenAI's error JSON with a
message that names the field), which leaves FastAPI nothing to describe; ``request_body(limits)``
states what ``parse_completion`` accepts for the served run (its vocabulary, ``max_model_len``,
name and ratios) in the OpenAPI 3.1 schema. It documents the API and is what the schema fuzzer
(``tests/test_serve_fuzz.py``) draws requests from; the parser, not this schema, is what the
server enforces. What a schema cannot say (a prompt's length in tokens, ``min_tokens`` <=
``max_tokens``, ``best_of`` == ``n``) is left to the parser's 400s.
"""

from __future__ import annotations

from .protocol import MAX_INT, MAX_LOGPROBS, MAX_N, MAX_PROMPTS, MAX_STOP_CHARS, MAX_STOPS, MIN_TEMPERATURE, Limits


def _opt(schema: dict) -> dict:
    """``schema`` or JSON null (the parser reads null as the default)."""
    return {"anyOf": [schema, {"type": "null"}]}


def _int(lo: int, hi: int = MAX_INT) -> dict:
    return _opt({"type": "integer", "minimum": lo, "maximum": hi})


def _num(lo: float, hi: float) -> dict:
    return _opt({"type": "number", "minimum": lo, "maximum": hi})


def _ratio(lim: Limits) -> dict:
    if not lim.concept:
        return {"type": "null", "description": "a plain MoE has no R"}
    if lim.elastic_ratios is None:
        return _opt({"const": lim.ratio, "description": "this run's fixed R"})
    return _num(min(lim.elastic_ratios), max(lim.elastic_ratios))


def completion_request(lim: Limits) -> dict:
    """JSON Schema of a ``POST /v1/completions`` body for the run ``lim`` describes."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": lim.vocab_size - 1},
           "minItems": 1, "maxItems": lim.max_model_len}
    text = {"type": "string", "minLength": 1}
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    props = {
        "model": _opt({"const": lim.model}),
        "prompt": {"anyOf": [text, ids, {"type": "array", "items": {"anyOf": [text, ids]},
                                         "minItems": 1, "maxItems": MAX_PROMPTS}]},
        "max_tokens": _int(0, lim.max_model_len),
        "temperature": _opt({"anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_TEMPERATURE,
                                                      "maximum": 100}]}),
        "top_p": _opt({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _int(-1),
        "seed": _int(0),
        "stop": _opt({"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOPS}]}),
        "stream": _opt({"type": "boolean"}),
        "stream_options": _opt({"type": "object", "additionalProperties": False,
                                "properties": {"include_usage": {"type": "boolean"},
                                               "continuous_usage_stats": {"const": False}}}),
        "concept_ratio": _ratio(lim),
        "ignore_eos": _opt({"type": "boolean"}),
        "user": {"type": "string"},
        "n": _int(1, MAX_N),
        "best_of": _int(1, MAX_N),
        "echo": _opt({"type": "boolean"}),
        "logprobs": _int(0, MAX_LOGPROBS),
        "repetition_penalty": _num(0.01, 100),
        "presence_penalty": _num(-2, 2),
        "frequency_penalty": _num(-2, 2),
        "min_tokens": _int(0, lim.max_model_len),
        "stop_token_ids": _opt({"type": "array", "maxItems": MAX_STOPS,
                                "items": {"type": "integer", "minimum": 0, "maximum": lim.vocab_size - 1}}),
        "logit_bias": _opt({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,6}$"},
                            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
        # accepted only at the value that changes nothing
        "suffix": {"type": "null"}, "min_p": _opt({"const": 0}), "skip_special_tokens": _opt({"const": True}),
        "include_stop_str_in_output": _opt({"const": False}),
        "spaces_between_special_tokens": _opt({"const": True}), "add_special_tokens": _opt({"const": True}),
    }
    return {"type": "object", "required": ["prompt"], "properties": props, "additionalProperties": False}


ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def completions_openapi(lim: Limits) -> dict:
    """``openapi_extra`` of the completions route: its request body and its error responses."""
    err = {"content": {"application/json": {"schema": ERROR}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": completion_request(lim)}}},
        "responses": {
            "200": {"description": "the completion (JSON), or server-sent events with \"stream\": true"},
            "400": {"description": "a request this server refuses, and why", **err},
            "404": {"description": "another model than the one served", **err},
            "499": {"description": "the client went away", **err},
            "500": {"description": "the engine failed on this request (no other request is touched)", **err},
            "503": {"description": "busy (--max-waiting) or shutting down; retry later", **err},
        },
    }
