"""Cached inference (CONCEPTMOE.md §4): KV/concept caches, prefill and decode steps, sampling
and generation (which gives the models their ``generate`` method). Imports model/ only.
"""

from .cache import ChunkState, DechunkState, InferenceState, KVCache
from .generate import generate, sample, stream
from .steps import StepOutput, decode_step, prefill

__all__ = ["KVCache", "ChunkState", "DechunkState", "InferenceState", "prefill", "decode_step",
           "StepOutput", "generate", "stream", "sample"]
