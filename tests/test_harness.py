"""lm-evaluation-harness on our runs (issue 11 B): offline tasks, the direct LM, the hf path, the CLI.

The key check: the harness through transformers' ``hf`` model type on the exported directory
gives the same log-likelihood as our direct ``ConceptMoEHarnessLM``, request by request.
Nothing is downloaded (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
from hf_helpers import concept_run

from conceptmoe import load_run
from conceptmoe.cli import main
from conceptmoe.harness.lm import ConceptMoEHarnessLM
from conceptmoe.harness.tasks import NIAH_LENGTHS, build_tasks, ensure_tasks
from conceptmoe.training.validation import evaluate_tokens
from conceptmoe.data.tokenizer import byte_lengths

SEQ = 64  # the test runs' training length: their maximum length, rolling windows of 64 tokens
TASKS = ["cmoe_nextline", "cmoe_niah_05k"]


@pytest.fixture(autouse=True)
def _offline(offline_harness):
    """Every test here runs the harness offline (conftest.offline_harness)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    concept_run(root / "run", seed=2, seq_len=SEQ)
    return root / "run"


def test_tasks_are_deterministic_and_well_formed(tmp_path):
    build_tasks(tmp_path / "a")
    build_tasks(tmp_path / "b")
    for f in sorted((tmp_path / "a").iterdir()):
        if f.suffix == ".jsonl":
            assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name
    docs = [json.loads(x) for x in (tmp_path / "a" / "cmoe_nextline.jsonl").read_text().splitlines()]
    assert len(docs) == 300 and all(len(set(d["choices"])) == 4 and d["context"].endswith("\n") for d in docs)
    assert {d["play"] for d in docs} == {"macbeth", "twelfth-night", "richard-ii"}
    for tag, n in NIAH_LENGTHS.items():
        docs = [json.loads(x) for x in (tmp_path / "a" / f"cmoe_niah_{tag}.jsonl").read_text().splitlines()]
        for d in docs:
            word = d["choices"][d["label"]]
            assert f"The secret word is {word}." in d["context"] and d["context"].endswith("The secret word is")
            assert abs(len(d["context"]) - n) < 200
    labels = [d["label"] for d in docs]
    assert len(set(labels)) > 1  # the answer is not always in one slot
    assert json.loads((tmp_path / "a" / "cmoe_niah.yaml").read_text())["group"] == "cmoe_niah"


def test_rolling_windows_are_conceptmoe_evals_windows(run):
    """Rolling log-likelihood of a text = minus evaluate_tokens' NLL over [prefix] + its tokens
    (windows of max_length = SEQ input tokens sharing one token: evaluate's at SEQ + 1)."""
    model, cfg, tok, _ = load_run(run, "cpu")
    lm = ConceptMoEHarnessLM(run=str(run))
    assert lm.max_length == SEQ
    text = ensure_tasks().joinpath("cmoe_heldout_ppl.jsonl").read_text()
    text = json.loads(text)["text"][:3000]

    class Req:
        args = (text,)
    tokens = tok.encode(text).ids
    tokens = tokens[:len(tokens) // SEQ * SEQ]  # whole windows
    lm.tok_encode = lambda s, **kw: tokens
    ll = lm.loglikelihood_rolling([Req()], disable_tqdm=True)[0]
    ids = np.array([lm.prefix_token_id, *tokens])
    ev = evaluate_tokens(model, ids, byte_lengths(tok, cfg.vocab_size), SEQ + 1)
    assert ev["tokens"] == len(ids) - 1
    nll = ev["val_loss"] * ev["tokens"]
    assert abs(-ll - nll) < 1e-5 * nll, (-ll, nll)
    assert lm.prefix_token_id == tok.encode("\n\n").ids[-1]


def _samples(model, model_args, manager):
    import lm_eval

    res = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, limit=3,
                                  task_manager=manager, log_samples=True, bootstrap_iters=0,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0)
    out = {}
    for task, samples in res["samples"].items():
        for s in samples:
            for i, r in enumerate(s["resps"]):
                out[(task, s["doc_id"], i)] = float(r[0][0] if isinstance(r[0], (list, tuple)) else r[0])
    return out, res["results"]


def test_hf_model_type_on_the_export_equals_our_direct_path(run, tmp_path):
    from lm_eval.tasks import TaskManager

    assert main(["export-hf", str(run), "--out", str(tmp_path / "hf")]) == 0
    prefix = json.loads((tmp_path / "hf" / "config.json").read_text())["prefix_token_id"]
    manager = TaskManager(include_path=str(ensure_tasks()), include_defaults=False)
    # HFLM has one max_length for contexts and rolling windows: give ours the same (SEQ - 1)
    ours, ours_res = _samples(ConceptMoEHarnessLM(run=str(run), max_length=SEQ - 1, batch_size=4), None, manager)
    theirs, hf_res = _samples("hf", f"pretrained={tmp_path / 'hf'},trust_remote_code=True,"
                                    f"prefix_token_id={prefix},max_length={SEQ - 1},batch_size=4,device=cpu",
                              manager)
    assert set(ours) == set(theirs) and len(ours) == 3 * 4 + 3 * 4
    worst = max(abs(ours[k] - theirs[k]) for k in ours)
    assert worst < 1e-4, worst
    for task in TASKS:
        assert ours_res[task]["acc,none"] == hf_res[task]["acc,none"]
    # loglikelihood_rolling (the perplexity task) on a few held-out texts, request by request
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(tmp_path / "hf"), trust_remote_code=True, prefix_token_id=prefix,
              batch_size=4, device="cpu")  # max_length: the export's max_position_embeddings (SEQ)
    text = json.loads((ensure_tasks() / "cmoe_heldout_ppl.jsonl").read_text())["text"]
    reqs = [Instance("loglikelihood_rolling", {}, (text[a:a + n],), 0) for a, n in ((0, 900), (5000, 400), (9000, 31))]
    a = ConceptMoEHarnessLM(run=str(run)).loglikelihood_rolling(reqs, disable_tqdm=True)
    b = hf.loglikelihood_rolling(reqs, disable_tqdm=True)
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)


def test_cli_eval_tasks_json(run, capsys):
    assert main(["eval", str(run), "--tasks", "cmoe_nextline,cmoe_niah", "--limit", "2", "--json",
                 "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["results"]) >= {"cmoe_nextline", "cmoe_niah", "cmoe_niah_4k"}
    assert 0 <= out["results"]["cmoe_nextline"]["acc"] <= 1 and out["n_samples"]["cmoe_nextline"] == 2
    assert out["groups"]["cmoe_niah"]["acc"] == pytest.approx(
        np.mean([out["results"][f"cmoe_niah_{t}"]["acc"] for t in NIAH_LENGTHS]))


@pytest.mark.parametrize("argv,words", [(["--limit", "2"], "--tasks"), (["--tasks", "nope_task"], "unknown"),
                                        (["--tasks", "cmoe_nextline", "--val-tokens", "5"], "--val-tokens")])
def test_cli_eval_tasks_refusals(run, capsys, argv, words):
    assert main(["eval", str(run), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err


def test_plain_eval_is_unchanged_by_the_harness(run, capsys):
    assert main(["eval", str(run), "--data", str(ensure_tasks() / "cmoe_heldout_ppl.jsonl"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"val_loss", "val_bpb", "compression", "tokens", "health"} and out["tokens"] > 1000
