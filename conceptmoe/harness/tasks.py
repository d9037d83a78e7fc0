"""Offline lm-evaluation-harness tasks built from the held-out plays (issue 11 B).

Stock harness tasks download their datasets; these are made here, from text the package already
has (the held-out plays of the default corpus, ``data/corpus.py``), into a cache folder of
harness YAML files (``dataset_path: json`` with local ``data_files``) plus JSON-lines data.
Everything is deterministic (fixed seeds), so every machine builds the same tasks. The folder is
``$CONCEPTMOE_TASKS_DIR`` or ``~/.cache/conceptmoe/harness-tasks/v<VERSION>``; pass it to the
harness as ``include_path`` (``lm_eval --include_path DIR``). YAML paths are absolute, which is
why the files are written at run time rather than shipped.

- ``cmoe_nextline`` (multiple choice, log-likelihood): a passage of a play, then the true next
  line against three other lines of the same play of similar length. ``acc``, ``acc_norm``.
- ``cmoe_niah`` (group of ``cmoe_niah_05k``/``1k``/``2k``/``4k``: 500 to 4000 characters):
  a needle line "The secret word is W." hidden at a random depth of held-out text; at the end
  "The secret word is" and four candidate words, all four absent from the haystack (so that only
  the needle names one). Long-context retrieval (CONCEPTMOE.md §5).
- ``cmoe_heldout_ppl`` (``loglikelihood_rolling``): the held-out text exactly as
  ``conceptmoe eval`` reads it (plays joined by ``DOC_SEP``), one document. ``bits_per_byte``
  is comparable to ``val_bpb`` (see ``harness/lm.py`` for the windows).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from pathlib import Path

from ..data.corpus import DOC_SEP, load_corpus

VERSION = 2  # 2: needle and distractors drawn from words absent from the haystack
NIAH_LENGTHS = {"05k": 500, "1k": 1000, "2k": 2000, "4k": 4000}
NIAH_PER_LENGTH = 20
NEXTLINE_PER_PLAY = 100
WORDS = ("apple", "river", "candle", "falcon", "silver", "garden", "lantern", "harbor", "violet",
         "copper", "meadow", "thunder", "pepper", "marble", "willow", "compass")
TASKS = ("cmoe_nextline", "cmoe_niah", "cmoe_heldout_ppl")
_LINE = re.compile(r"^[A-Za-z'\"(]")  # a spoken line, not a heading, stage direction or speaker tag


def task_dir() -> Path:
    env = os.environ.get("CONCEPTMOE_TASKS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "conceptmoe" / "harness-tasks" / f"v{VERSION}"


def _spoken_lines(text: str) -> list[tuple[int, str]]:
    """(character offset, line without trailing spaces) of every spoken line of 20..80 characters."""
    out, pos = [], 0
    for raw in text.split("\n"):
        line = raw.rstrip()
        if _LINE.match(line) and 20 <= len(line) <= 80:
            out.append((pos, line))
        pos += len(raw) + 1
    return out


def nextline_docs(plays, per_play: int = NEXTLINE_PER_PLAY, seed: int = 0) -> list[dict]:
    rng, docs = random.Random(seed), []
    for play in plays:
        lines = _spoken_lines(play.text)
        for pos, line in rng.sample([x for x in lines if x[0] > 600], per_play):
            start = play.text.rfind("\n", 0, pos - 400) + 1  # about 400 characters, whole lines
            near = [x for _, x in lines if x != line and 0.6 * len(line) <= len(x) <= 1.6 * len(line)]
            choices = [line, *rng.sample(sorted(set(near)), 3)]
            rng.shuffle(choices)
            docs.append({"play": play.name, "context": play.text[start:pos], "choices": choices,
                         "label": choices.index(line)})
    return docs


def absent_words(text: str) -> list[str]:
    """The candidate words that ``text`` does not contain as a word (any case)."""
    present = set(re.findall(r"[a-z]+", text.lower()))
    return [w for w in WORDS if w not in present]


def niah_docs(text: str, length: int, n: int = NIAH_PER_LENGTH, seed: int = 0) -> list[dict]:
    rng, docs = random.Random(seed * 1000 + length), []
    for _ in range(n):
        start = rng.randrange(0, len(text) - length - 1)
        start = text.find("\n", start) + 1
        hay = text[start:start + length]
        hay = hay[:hay.rfind("\n") + 1]  # whole lines
        cut = hay.rfind("\n", 0, int(len(hay) * rng.uniform(0.1, 0.9))) + 1
        words = rng.sample(absent_words(hay), 4)
        needle = words[0]
        rng.shuffle(words)
        context = f"{hay[:cut]}The secret word is {needle}.\n{hay[cut:]}\nThe secret word is"
        docs.append({"context": context, "choices": words, "label": words.index(needle),
                     "depth": round(cut / len(hay), 3)})
    return docs


def _mc_yaml(name: str, data: Path, delimiter: str) -> dict:
    return {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "context",
            "doc_to_choice": "choices", "doc_to_target": "label", "target_delimiter": delimiter,
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": VERSION}}


def _write(root: Path, name: str, docs: list[dict]) -> Path:
    path = root / f"{name}.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def build_tasks(root: Path) -> None:
    """Write every task's data and YAML under ``root``."""
    val = load_corpus().val
    root.mkdir(parents=True, exist_ok=True)
    yamls = {"cmoe_nextline": _mc_yaml("cmoe_nextline", _write(root, "cmoe_nextline", nextline_docs(val)), "")}
    text = DOC_SEP.join(d.text for d in val)
    subtasks = []
    for tag, length in NIAH_LENGTHS.items():
        name = f"cmoe_niah_{tag}"
        yamls[name] = _mc_yaml(name, _write(root, name, niah_docs(text, length)), " ")
        subtasks.append(name)
    yamls["cmoe_niah"] = {"group": "cmoe_niah", "task": subtasks,
                          "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean",
                                                     "weight_by_size": True}],
                          "metadata": {"version": VERSION}}
    ppl = _write(root, "cmoe_heldout_ppl", [{"text": text}])
    yamls["cmoe_heldout_ppl"] = {
        "task": "cmoe_heldout_ppl", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(ppl)}},
        "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "",
        "doc_to_target": "text",
        "metric_list": [{"metric": m, "aggregation": agg, "higher_is_better": False} for m, agg in
                        (("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
                         ("bits_per_byte", "bits_per_byte"))],
        "metadata": {"version": VERSION}}
    for name, cfg in yamls.items():  # JSON is YAML: no YAML writer needed
        (root / f"{name}.yaml").write_text(json.dumps(cfg, indent=1) + "\n")


def ensure_tasks(root: str | Path | None = None) -> Path:
    """The task folder, (re)built when missing or made from other text; returns it."""
    root = Path(root) if root is not None else task_dir()
    val = load_corpus().val
    stamp = hashlib.sha256("".join(d.name + d.text for d in val).encode() + Path(__file__).read_bytes()).hexdigest()
    marker = root / "tasks.json"
    want = {"version": VERSION, "sha256": stamp, "tasks": list(TASKS)}  # held-out text + this builder
    if not marker.is_file() or json.loads(marker.read_text()) != want:
        build_tasks(root)
        marker.write_text(json.dumps(want) + "\n")
    return root
