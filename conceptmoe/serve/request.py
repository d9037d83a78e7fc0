"""What the engine (``engine.py``) is asked and what it answers: ``Request`` in, ``Event`` out.

A ``Request`` is token ids and sampling settings (``sampling.py`` applies them); the engine owns
its progress fields. Each ``Event`` goes to the request's ``emit`` callback from the scheduler
thread: one per new token, and a last one with ``finish_reason`` (and ``error`` when the engine
failed on this request alone, or on the step it was part of).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


class Refused(Exception):
    """The request cannot be taken: ``status`` 503 (busy, come back) or 400 (can never fit)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Event:
    tokens: list[int]  # new completion tokens (empty on the last event of a cancelled request)
    boundaries: list[int] = field(default_factory=list)  # completion indices whose boundary was decided: yes
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    logprobs: list | None = None  # per token in ``tokens``: (logprob, [(id, logprob), ...] best first)
    prompt_logprobs: list | None = None  # first event only, when asked: [None, (logprob, top), ...]


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int  # 0: the prompt's log-probabilities only (echo)
    emit: Callable[[Event], None]
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    eos: list[int] = field(default_factory=list)
    ratio: float | None = None  # an elastic run's R for this request (None: its design ratio)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top log-probabilities per completion token (None: none)
    prompt_logprobs: int | None = None  # the same for every prompt token (None: none)
    id: int = field(default_factory=itertools.count().__next__)
    # Owned by the engine:
    generated: list[int] = field(default_factory=list)
    boundary_list: list[int] = field(default_factory=list)  # completion indices that start a concept
    decided: list[int] = field(default_factory=list)  # boundaries decided since the last event
    fed: int = 0  # tokens fed to the model (prompt + generated tokens already stepped)
    prompt_concepts: int = 0
    concepts: int = 0  # concept entries held in the cache
    cancelled: bool = False
    finish_reason: str | None = None
    preemptions: int = 0
    admitted_step: int = -1  # the engine step at which the row last joined the batch
    prompt_lp: list | None = None  # prompt log-probabilities, computed once, sent with the first event
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    generator: torch.Generator | None = None

    @property
    def seen(self) -> int:
        """Tokens the cache holds once the last sampled token is fed (prompt + generated)."""
        return len(self.prompt) + len(self.generated)
