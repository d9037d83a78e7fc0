"""Parallelism applied to a plain model from outside: torchrun process groups, DDP, FSDP2
(``distributed.py``) and expert parallelism (``expert_parallel.py``). The model never asks for
a rank; one process and N processes share one code path. Imports model/ only.
"""
