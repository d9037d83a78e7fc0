"""lm-eval's ``local-completions`` against a live ``conceptmoe serve``: the model's own log-likelihoods.

The recipe of docs/serving.md ("lm-evaluation-harness against the server") through lm-eval's
Python API: ``LocalCompletionsAPI`` with the run directory as its tokenizer (transformers reads
its tokenizer.json; nothing is downloaded), the run's prefix token and the server's
``max_model_len`` as ``max_length``. It posts token ids with ``echo`` and ``logprobs``; every
log-likelihood must equal a full forward pass of the model on the same tokens within 1e-4 (and
its greedy flag the argmax), and ``cmoe_nextline`` through ``simple_evaluate`` must score as our
direct harness model (``ConceptMoEHarnessLM``) scores it, request by request.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval[api]: what its API models need
pytest.importorskip("transformers")
from hf_helpers import concept_run  # noqa: E402
from serve_helpers import live_server  # noqa: E402

from conceptmoe.harness.lm import ConceptMoEHarnessLM  # noqa: E402
from conceptmoe.harness.tasks import ensure_tasks  # noqa: E402

SEQ = 512  # the run's training length: the server's max_model_len, lm-eval's max_length
NAME = "cm"


@pytest.fixture(autouse=True)
def _offline(offline_harness):
    """No hub, no datasets download (conftest.offline_harness)."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-lm-eval")
    model = concept_run(root / NAME, seed=4, seq_len=SEQ)
    with live_server(root / NAME, kv_cache_mb=8, max_batch=16) as (url, engine, tok):
        prefix = ConceptMoEHarnessLM(run=str(root / NAME)).prefix_token_id
        yield url, tok, model, root / NAME, prefix


def _model_args(url: str, run, prefix: int) -> str:
    """``--model_args`` of the documented ``lm_eval --model local-completions`` command."""
    return (f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={run},"
            f"max_length={SEQ},custom_prefix_token_id={prefix}")


def _reference(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """The continuation's log-likelihood and greedy flag from one forward pass over what lm-eval
    sends: (context + continuation) cut on the left to max_length - 1 tokens (one is generated)."""
    ids = (ctx + cont)[-(SEQ - 1):]
    start = len(ids) - len(cont)
    lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (T, V)
    rows, want = lp[start - 1:len(ids) - 1], torch.tensor(ids[start:])
    return float(rows[torch.arange(len(want)), want].sum()), bool((rows.argmax(-1) == want).all())


def test_local_completions_loglikelihood_equals_the_models(served):
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    url, tok, model, run, prefix = served
    lm = get_model("local-completions").create_from_arg_string(_model_args(url, run, prefix))
    long_ctx = " ".join(["Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace"] * 40)
    pairs = [("To be, or not to be,", " that is the question"), ("", "Friends, Romans, countrymen"),
             ("Œuvre — 5 € ou ½?", " Où est le café"), (long_ctx, " from day to day")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    assert len(tok.encode(long_ctx).ids) > SEQ, "the long context is not cut: the test misses max_length"
    greedy = 0
    with torch.no_grad():
        for (c, x), (ll, is_greedy) in zip(pairs, got):
            ctx = tok.encode(c).ids if c else [prefix]
            assert tok.encode(c + x).ids == tok.encode(c).ids + tok.encode(x).ids  # lm-eval's split is ours
            want_ll, want_greedy = _reference(model, ctx, tok.encode(x).ids)
            assert ll == pytest.approx(want_ll, abs=1e-4) and is_greedy == want_greedy, (c[:20], ll, want_ll)
            greedy += want_greedy
    # the model's own argmax as token ids (text might re-encode otherwise): the flag seen both ways
    ctx = tok.encode("Now is the winter").ids
    cont = model.generate(torch.tensor([ctx]), 4, temperature=0)[0, len(ctx):].tolist()
    (ll, is_greedy), = lm._loglikelihood_tokens([(None, ctx, cont)])
    assert is_greedy and greedy < len(pairs)
    with torch.no_grad():
        assert ll == pytest.approx(_reference(model, ctx, cont)[0], abs=1e-4)


def test_simple_evaluate_through_the_server_equals_the_direct_model(served):
    import lm_eval
    from lm_eval.tasks import TaskManager

    url, _, _, run, prefix = served
    manager = TaskManager(include_path=str(ensure_tasks()), include_defaults=False)
    kw = dict(tasks=["cmoe_nextline"], limit=3, task_manager=manager, log_samples=True, bootstrap_iters=0,
              random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    args = _model_args(url, run, prefix) + ",num_concurrent=4"  # lm-eval's parallel (aiohttp) path
    served_res = lm_eval.simple_evaluate(model="local-completions", model_args=args, **kw)
    direct_res = lm_eval.simple_evaluate(model=ConceptMoEHarnessLM(run=str(run), max_length=SEQ), **kw)

    def lls(res) -> dict:
        return {(s["doc_id"], i): float(r[0][0]) for s in res["samples"]["cmoe_nextline"]
                for i, r in enumerate(s["resps"])}
    a, b = lls(served_res), lls(direct_res)
    assert set(a) == set(b) and len(a) == 3 * 4
    assert max(abs(a[k] - b[k]) for k in a) < 1e-4
    assert served_res["results"]["cmoe_nextline"]["acc,none"] == direct_res["results"]["cmoe_nextline"]["acc,none"]
