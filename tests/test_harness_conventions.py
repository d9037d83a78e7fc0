"""Issue 19, evaluation conventions: the harness takes BOS/EOS and the maximum length as ``hf`` does.

- ``lm_eval --model hf --model_args pretrained=EXPORT,trust_remote_code=True`` (nothing else set)
  equals ``conceptmoe eval RUN --tasks`` request by request, for a run with special tokens;
- an imported run (no training config) gets its source's maximum length and BOS/EOS prefix;
- ``cmoe_niah`` candidates never occur in the haystack;
- ``generate_until`` is batched and each row stops at its stop string (= one request at a time).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
from hf_helpers import concept_run  # noqa: E402
from test_special_tokens import special_run  # noqa: E402

from conceptmoe.cli import main  # noqa: E402
from conceptmoe.data.tokenizer import EOT  # noqa: E402
from conceptmoe.harness.lm import ConceptMoEHarnessLM  # noqa: E402
from conceptmoe.harness.tasks import NIAH_LENGTHS, build_tasks, ensure_tasks  # noqa: E402
from conceptmoe.interop import import_hf  # noqa: E402

TASKS = ["cmoe_nextline", "cmoe_niah_05k"]


@pytest.fixture(autouse=True)
def _offline(offline_harness):
    """Every test here runs the harness offline (conftest.offline_harness)."""


class Req:
    def __init__(self, *args):
        self.args = args


def _samples(res):
    out = {}
    for task, samples in res["samples"].items():
        for s in samples:
            for i, r in enumerate(s["resps"]):
                out[(task, s["doc_id"], i)] = float(r[0][0] if isinstance(r[0], (list, tuple)) else r[0])
    return out


def test_lm_eval_hf_on_the_export_equals_conceptmoe_eval_tasks(tmp_path, capsys):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    _, tok = special_run(tmp_path / "run", seq_len=48)
    assert main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    ours = ConceptMoEHarnessLM(run=str(tmp_path / "run"), batch_size=4)
    assert ours.prefix_token_id == ours.eot_token_id == tok.token_to_id(EOT) and ours.max_length == 48
    hf = HFLM(pretrained=str(tmp_path / "hf"), trust_remote_code=True, device="cpu")  # no prefix, no length
    assert (hf.prefix_token_id, hf.max_length) == (ours.prefix_token_id, ours.max_length)
    manager = TaskManager(include_path=str(ensure_tasks()), include_defaults=False)
    kw = dict(tasks=TASKS, limit=3, task_manager=manager, log_samples=True, bootstrap_iters=0, random_seed=0,
              numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    a = lm_eval.simple_evaluate(model=ours, **kw)
    b = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'},trust_remote_code=True",
                                device="cpu", **kw)  # = lm_eval --model hf --model_args ... --device cpu
    sa, sb = _samples(a), _samples(b)
    assert set(sa) == set(sb) and len(sa) == 3 * 4 * 2
    assert max(abs(sa[k] - sb[k]) for k in sa) < 1e-4
    # `conceptmoe eval --tasks` reports what the direct LM computed
    assert main(["eval", str(tmp_path / "run"), "--tasks", ",".join(TASKS), "--limit", "3", "--json",
                 "--device", "cpu"]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    for task in TASKS:
        assert cli[task]["acc"] == b["results"][task]["acc,none"]
    # loglikelihood_rolling: windows of max_length tokens after the EOS prefix, longer texts than one window
    text = json.loads((ensure_tasks() / "cmoe_heldout_ppl.jsonl").read_text())["text"]
    from lm_eval.api.instance import Instance
    reqs = [Instance("loglikelihood_rolling", {}, (text[a:a + n],), 0) for a, n in ((0, 700), (5000, 300))]
    x, y = ours.loglikelihood_rolling(reqs, disable_tqdm=True), hf.loglikelihood_rolling(reqs, disable_tqdm=True)
    assert max(abs(p - q) for p, q in zip(x, y)) < 1e-4, (x, y)


def test_imported_run_takes_its_sources_length_and_prefix(tmp_path):
    from test_interop import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "hf", "olmoe", max_position_embeddings=96, bos_token_id=7)
    lm = ConceptMoEHarnessLM(run=str(import_hf(ckpt, tmp_path / "run")))
    assert lm.max_length == 96 and lm.prefix_token_id == 7 and lm.eot_token_id == 299  # OLMoE's eos, shrunk


def test_niah_candidates_are_absent_from_the_haystack(tmp_path):
    build_tasks(tmp_path)
    for tag in NIAH_LENGTHS:
        for line in (tmp_path / f"cmoe_niah_{tag}.jsonl").read_text().splitlines():
            d = json.loads(line)
            needle = f"The secret word is {d['choices'][d['label']]}.\n"
            assert d["context"].count(needle) == 1
            hay = set(re.findall(r"[a-z]+", d["context"].replace(needle, "").lower()))
            assert not hay & set(d["choices"]), (tag, sorted(hay & set(d["choices"])))


@torch.no_grad()
def test_generate_until_batched_equals_one_at_a_time(tmp_path):
    concept_run(tmp_path / "run", seed=5)
    lm = ConceptMoEHarnessLM(run=str(tmp_path / "run"), batch_size=3, max_length=512)
    contexts = ["To be, or not to be", "Thou art", "Good my lord, what", "O", "Now is the winter of our"]
    free = [lm.tok_decode(lm.model.generate(torch.tensor([lm.tok_encode(c)]), 12, temperature=0)[0, len(
        lm.tok_encode(c)):].tolist()) for c in contexts]
    stop = next(ch for ch in "etaoins" if sum(ch in f[1:] for f in free) >= 2)  # some rows stop early
    reqs = [Req(c, {"until": [stop], "max_gen_toks": 12}) for c in contexts]
    calls = []
    hook = lm.model.embed.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    got = lm.generate_until(reqs, disable_tqdm=True)
    hook.remove()
    assert [c[0] for c in calls].count(3) >= 1 and len(calls) <= 2 * 12  # two batches (3 + 2), not 5 x 12 steps
    for text, f in zip(got, free):
        assert text == (f[:f.index(stop)] if stop in f else f), (text, f, stop)
    lm.batch_size = 1
    assert lm.generate_until(reqs, disable_tqdm=True) == got
