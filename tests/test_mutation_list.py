"""The mutation check's list stays runnable: every mutant's fragment is still in the source.

The check itself (``python tests/mutation/run_mutants.py``, ~2 min) is not part of the default
run; this test is, so a refactor that moves a mutated line shows up at once.
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("run_mutants", ROOT / "tests/mutation/run_mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod.MUTANTS


def test_every_mutant_applies_to_the_current_source():
    mutants = _mutants()
    assert len({m.name for m in mutants}) == len(mutants) >= 7
    for m in mutants:
        text = (ROOT / m.path).read_text()
        assert text.count(m.old) == 1, f"{m.name}: {m.old!r} must occur once in {m.path}"
        assert m.old != m.new
        for t in m.tests:
            assert (ROOT / t).is_file(), f"{m.name}: no test file {t}"
