"""lm-evaluation-harness on our runs (issue 11 B): offline tasks and a direct ``LM`` for our models.

- ``tasks.py``: the offline tasks (next line of a held-out play, needle in a haystack at four
  context lengths, rolling perplexity of the held-out text), built at run time into a cache folder;
- ``lm.py``: ``ConceptMoEHarnessLM``, an ``lm_eval`` ``TemplateLM`` that calls our model's forward
  pass and ``generate`` directly (registered as harness model ``"conceptmoe"``);
- ``run.py``: ``evaluate_tasks(run, tasks)``, what ``conceptmoe eval RUN --tasks ...`` calls.

Why a registered ``LM`` and not transformers' ``HFLM``: the direct path needs neither
transformers nor an exported directory, works on MoE and ConceptMoE runs alike, and gives the
harness an independent second path to check the exported transformers model against (the
tests hold the two equal per request). Needs the optional ``eval`` extra (``lm_eval``).
May import ``model/``, ``inference/`` and ``training/`` (run directories, held-out text); never ``cli/``,
``bench/`` or ``interop/``.
"""

from .tasks import TASKS, ensure_tasks, task_dir

__all__ = ["TASKS", "ensure_tasks", "task_dir"]
