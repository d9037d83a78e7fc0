"""Data: what a model is trained and evaluated on (CONCEPTMOE.md §5).

Corpora and the held-out split (``corpus.py``: the embedded Shakespeare plays, a text file or a
folder), named corpora from installed files (``recipes.py``: python-stdlib, kjv, shakespeare-kjv),
document sources (``sources.py``: text, JSONL, parquet), the byte-level BPE tokenizer
(``tokenizer.py``), token shards made by ``conceptmoe prepare`` (``prepare.py``, ``shards.py``)
and the vision-language digits record (``digits.py``). Imports nothing of the package but the
shared modules (``errors``, ``files``, ``lock``).
"""
