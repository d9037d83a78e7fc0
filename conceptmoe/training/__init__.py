"""Training and the run directory: the loop (``loop.py``) and its entry point ``train(cfg)``
(``train.py``), the validation it logs (``validation.py``), the digits task's sampler and metrics
(``digits.py``), the run's files (``checkpoint.py``, ``parallel_checkpoint.py``, ``config.py``,
``init_run.py``) and graceful stops (``signals.py``). Imports model/, data/ and parallel/.
"""
