"""Serving (CONCEPTMOE.md §4): an OpenAI-compatible server with continuous batching over the
concept-level KV cache. ``engine.py`` (the scheduler that owns the model), ``pool.py`` (the
memory-budgeted KV ledger), ``batch.py`` (rows joining and leaving the running batch),
``protocol.py`` / ``text.py`` / ``app.py`` (the HTTP side), ``server.py`` (start and stop).
Imports inference/ and model/; the HTTP side needs the extra ``serve`` (FastAPI, uvicorn).
"""
