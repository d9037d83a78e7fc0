"""Elastic compression (issue 21): one model, R chosen per sequence.

The per-sequence ratio loss against the hand formula, the ratio embedding reaching the router
(forward and cached step), log-R interpolation, the ratio draw as a pure function of (seed,
sample index), gradient accumulation and resume of an elastic run, and configs that do not use
it staying as they were.
"""

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from conceptmoe.errors import Interrupted, UserError
from conceptmoe.model.config import ModelConfig
from conceptmoe.model.elastic import check_ratio, interp_weights
from conceptmoe.inference.generate import stream
from conceptmoe.model.lm import build_model
from conceptmoe.training import checkpoint as ck
from conceptmoe.training import loop
from conceptmoe.training.config import TrainConfig
from conceptmoe.training.elastic import parse_ratios, sample_ratios
from conceptmoe.training.train import train
from training_helpers import TINY, make_corpus

RATIOS = [1.5, 2.0, 3.0, 4.0]


def _model(mode: str = "router+concept", seed: int = 0, **kw):
    torch.manual_seed(seed)
    m = build_model(ModelConfig.from_preset("tiny", elastic_ratios=RATIOS, ratio_embedding=mode, **kw))
    with torch.no_grad():  # random, independent tables (the zero start would hide a dropped term)
        scale = {"shift": 0.5, "router": 0.01, "concept": 0.3}  # router: the size of the encoder states
        for name, p in m.ratio_embed.named_parameters():
            p.normal_(0, scale[name])
    return m


def test_per_sequence_ratio_loss_equals_hand_formula():
    m = _model().train()
    x = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    R = torch.tensor([1.5, 4.0, 2.0, 3.0])
    u = torch.rand(4, 24, generator=torch.Generator().manual_seed(2))
    out = m(x, labels=x, ratio=R, boundary_noise=u)
    p, b = out.chunks.p, out.boundaries
    F_, G = b.float().mean(1).detach(), p.float().mean(1)  # per row
    hand = (R / (R - 1) * ((R - 1) * F_ * G + (1 - F_) * (1 - G))).mean()
    rl = out.aux["ratio_loss"]
    assert torch.allclose(rl, hand, atol=1e-6)
    # Not the batch-level F and G: rows with different R and boundary counts give another value.
    Fb, Gb = b.float().mean(), p.detach().float().mean()
    assert abs(float((R / (R - 1) * ((R - 1) * Fb * Gb + (1 - Fb) * (1 - Gb))).mean() - rl.detach())) > 1e-3
    # F carries no gradient: the gradients equal the hand formula's.
    shift = m.ratio_embed.shift
    g1, = torch.autograd.grad(rl, shift, retain_graph=True)
    g2, = torch.autograd.grad(hand, shift)
    assert torch.allclose(g1, g2, atol=1e-7) and g1.abs().sum() > 0


@pytest.mark.parametrize("mode", ["router", "router+concept"])
def test_ratio_embedding_reaches_the_router(mode):
    m = _model(mode).eval()
    with torch.no_grad():
        m.ratio_embed.shift.zero_()  # no threshold shift: only the vector can move p
    x = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    h, _ = m.encode(x)
    for r in (1.5, 2.5, 4.0):
        t = m.ratio_embed(torch.full((2,), r))
        want = m.chunk(h + t.router[:, None])  # p of the shifted router input, by hand
        got = m(x, ratio=r).chunks.p
        assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(m(x, ratio=1.5).chunks.p, m(x, ratio=4.0).chunks.p, atol=1e-4)


def test_concept_embedding_reaches_the_concept_model():
    m = _model("router+concept").eval()
    x = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    b = torch.rand(1, 20, generator=torch.Generator().manual_seed(5)) < 0.5
    a = m(x, ratio=2.0, boundaries_override=b).logits
    with torch.no_grad():
        m.ratio_embed.concept.zero_()
    assert not torch.allclose(a, m(x, ratio=2.0, boundaries_override=b).logits, atol=1e-5)


@pytest.mark.parametrize("source", ["output", "update"])
def test_concept_vector_is_not_carried_past_the_concept_model(source):
    """With identity concept layers (zero output projections) the vector changes nothing: it
    conditions the concept layers only, it never reaches the token stream itself."""
    m = _model("router+concept", dechunk_source=source).eval()
    with torch.no_grad():
        for name, p in m.concept.named_parameters():
            if name.endswith(("attn.wo.weight", "w_down", "down.weight")):
                p.zero_()
    x = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(7))
    b = torch.rand(2, 20, generator=torch.Generator().manual_seed(8)) < 0.5
    a = m(x, ratio=3.0, boundaries_override=b).logits
    with torch.no_grad():
        m.ratio_embed.concept.zero_()
    assert torch.allclose(a, m(x, ratio=3.0, boundaries_override=b).logits, atol=1e-6)


def test_shift_baseline_changes_only_the_threshold():
    m = _model("shift").eval()
    assert m.ratio_embed.router is None and m.ratio_embed.concept is None
    x = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(6))
    h, _ = m.encode(x)
    p0 = m.chunk(h)
    s = float(m.ratio_embed(torch.tensor([3.0])).shift.detach())
    want = torch.sigmoid(torch.logit(p0.clamp(1e-6, 1 - 1e-6)) + s)
    want[:, 0] = 1
    assert torch.allclose(m(x, ratio=3.0).chunks.p, want, atol=1e-5)


def test_interpolation_in_log_ratio():
    knots = torch.tensor(RATIOS)
    w = interp_weights(knots, knots)
    assert torch.allclose(w, torch.eye(4))  # the trained ratios read their own rows
    mid = interp_weights(torch.tensor([(2.0 * 3.0) ** 0.5]), knots)  # geometric midpoint of 2 and 3
    assert torch.allclose(mid, torch.tensor([[0, 0.5, 0.5, 0]]), atol=1e-6)
    out = interp_weights(torch.tensor([8.0]), knots)  # beyond 4: the last segment extended
    assert torch.allclose(out.sum(1), torch.ones(1)) and out[0, 3] > 1 and out[0, 2] < 0


def test_ratio_draw_is_a_pure_function_of_seed_and_sample_index():
    pairs = parse_ratios("1.5:1,2:2,3:1,4:1")
    assert pairs == [[1.5, 1.0], [2.0, 2.0], [3.0, 1.0], [4.0, 1.0]]
    whole = sample_ratios(7, 0, 64, pairs)
    assert torch.equal(sample_ratios(7, 10, 6, pairs), whole[10:16])  # any batch split
    assert not torch.equal(sample_ratios(8, 0, 64, pairs), whole)
    many = sample_ratios(0, 0, 20000, pairs)
    share = (many == 2.0).float().mean()
    assert abs(share - 0.4) < 0.02 and set(many.unique().tolist()) == {1.5, 2.0, 3.0, 4.0}


@pytest.mark.parametrize("spec", ["2", "2,2", "1,2", "2:0,3", "a,b", "2:x,3"])
def test_bad_ratio_sets_are_refused(spec):
    with pytest.raises(UserError, match="--ratios"):
        parse_ratios(spec)


def test_configs_without_elastic_ratios_are_unchanged():
    cfg = ModelConfig.from_preset("tiny")
    assert "elastic_ratios" not in cfg.to_dict() and "ratio_embedding" not in cfg.to_dict()
    assert "ratios" not in TrainConfig(**TINY).to_dict()
    assert not hasattr(build_model(cfg), "ratio_embed") or build_model(cfg).ratio_embed is None
    with pytest.raises(ValueError, match="trained range"):
        ModelConfig.from_preset("tiny", elastic_ratios=[3.0, 4.0])  # design R=2 outside
    with pytest.raises(ValueError, match="ratio_embedding"):
        ModelConfig.from_preset("tiny", elastic_ratios=RATIOS, ratio_embedding="mlp")
    el = ModelConfig.from_preset("tiny", elastic_ratios=RATIOS)
    assert check_ratio(el, [5.0]) and check_ratio(el, [5.0], extrapolate=True) is None
    assert check_ratio(cfg, [3.0]) and check_ratio(cfg, [2.0]) is None


def test_grad_accum_equals_one_batch(tmp_path):
    """Per-sequence ratio loss under --grad-accum 2: the same metrics and weights as one batch."""
    corpus = make_corpus(tmp_path / "c", n_docs=3, chars=3000)
    runs = {}
    for k in (1, 2):
        tc = TrainConfig(**TINY, data=str(corpus), out=str(tmp_path / f"k{k}"), max_steps=3, ratios="1.5,2,3,4",
                         grad_accum=k, eval_every=0, val_tokens=200, seed=3, dtype="fp32")
        runs[k] = train(tc)
    a, b = ck.read_metrics(runs[1]), ck.read_metrics(runs[2])
    for ra, rb in zip(a, b):
        for key in ("loss", "ratio_loss", "compression", "grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), key
    wa, wb = load_file(runs[1] / "model.safetensors"), load_file(runs[2] / "model.safetensors")
    assert all(torch.allclose(wa[n], wb[n], atol=1e-5) for n in wa)


def test_resume_of_an_elastic_run_is_exact(tmp_path, monkeypatch):
    corpus = make_corpus(tmp_path / "c", n_docs=3, chars=3000)
    kw = dict(**TINY, data=str(corpus), max_steps=6, save_every=3, ratios="1.5:1,2:2,4:1", eval_every=0,
              val_tokens=200, seed=5, dtype="fp32")
    ref = train(TrainConfig(**kw, out=str(tmp_path / "ref")))
    real = loop.boundary_uniforms

    def stop_at_4(seed, step, shape):  # a SIGTERM during step 4: checkpoint, then stop
        if step == 3:
            signal.raise_signal(signal.SIGTERM)
        return real(seed, step, shape)

    monkeypatch.setattr(loop, "boundary_uniforms", stop_at_4)
    out = tmp_path / "cut"
    with pytest.raises(Interrupted):
        train(TrainConfig(**kw, out=str(out)))
    monkeypatch.setattr(loop, "boundary_uniforms", real)
    assert len(ck.read_metrics(out)) == 4
    train(TrainConfig(**kw, out=str(out), resume=True))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]  # noqa: E731
    assert strip(ck.read_metrics(out)) == strip(ck.read_metrics(ref))
    a, b = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert json.loads((out / "config.json").read_text())["train"]["ratios"] == [[1.5, 1.0], [2.0, 2.0], [4.0, 1.0]]
    with pytest.raises(UserError, match="different ratios"):  # another draw of R would be another run
        train(TrainConfig(**{**kw, "ratios": "1.5,2,4"}, out=str(out), resume=True))


@pytest.mark.parametrize("mode,pooling,source", [("router+concept", "boundary", "output"),
                                                 ("router+concept", "mean", "update"), ("router", "mean", "update")])
def test_per_row_ratio_decode_equals_row_by_row_and_full_recompute(mode, pooling, source):
    m = _model(mode, seed=1, concept_pooling=pooling, dechunk_source=source).eval()
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 256, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:] = 0  # rows of different lengths (right padding)
    mask[2, 5:] = 0
    R = torch.tensor([2.5, 4.0, 3.0])
    batched = m.generate(ids, 16, temperature=0, attention_mask=mask, ratio=R)
    full = m.generate(ids, 16, temperature=0, attention_mask=mask, ratio=R, use_cache=False)
    assert torch.equal(batched, full)  # the cached steps equal recomputing the full forward
    for i in range(3):
        n = int(mask[i].sum())
        alone = m.generate(ids[i:i + 1, :n], 16, temperature=0, ratio=float(R[i]))
        assert torch.equal(batched[i, 12:], alone[0, n:])
    # The rows really are told different ratios, and the decode steps take boundaries.
    counts = []
    for r in (2.5, 4.0):
        state = []
        for _ in stream(m, ids[:1], 16, temperature=0, ratio=r, state_out=state):
            pass
        counts.append(len(state[0].boundaries[0]))
    assert counts[0] != counts[1] and max(counts) > 4


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory):
    """A tiny elastic run trained for 500 steps on Shakespeare (~30 s on one core)."""
    out = tmp_path_factory.mktemp("elastic") / "run"
    tc = TrainConfig(preset="tiny", device="cpu", progress=False, out=str(out), max_steps=500, batch_size=8,
                     seq_len=64, ratios="1.5,2,3,4", strategy=None, eval_every=0, val_tokens=2000, dtype="fp32",
                     overrides={"ratio_loss_weight": 0.3}, lr=2e-3)  # the rate it was tuned at (the
    # ConceptMoE's default is 1e-3 now; at that rate 500 tiny steps track R = 4 less closely: 4.55)
    return train(tc)


@pytest.mark.slow
def test_realised_compression_tracks_the_requested_ratio(elastic_run):
    """Across the trained range, including ratios between the trained ones: within 15% of R and
    rising with R. (15%, not 10%: a 500-step tiny model's realised compression moves with its
    trajectory, which the CPU's fp32 kernels change. Measured at R = 4: within 10% on an AMX CPU,
    4.46 on an AVX2 one; the same model trained 800 / 1,000 steps there gave 4.32 / 4.74, and
    3.33 at R = 3: a fluctuation, not a slow convergence. A ratio the model ignores stays flat.)"""
    from conceptmoe.evaluation.evaluate import evaluate

    got = []
    for r in (1.5, 2.0, 2.5, 3.0, 4.0):
        res = evaluate(elastic_run, device="cpu", max_tokens=20000, ratio=r)
        assert abs(res["compression"] / r - 1) < 0.15, (r, res["compression"])
        assert res["ratio"] == r
        got.append(res["compression"])
    assert got == sorted(got) and got[-1] > 2 * got[0], got


@pytest.mark.slow
def test_cli_ratio_flags_and_frontier(elastic_run, tmp_path, capsys):
    from conceptmoe.cli import main

    assert main(["eval", str(elastic_run), "--ratio", "3", "--val-tokens", "3000", "--json", "--device", "cpu"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ratio"] == 3.0 and 2.5 < res["compression"] < 3.5
    for cmd in (["eval", str(elastic_run)], ["boundaries", str(elastic_run), "--text", "To be, or not"],
                ["generate", str(elastic_run), "--prompt", "To be"]):
        assert main(cmd + ["--ratio", "6", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --ratio: R=6 is outside the trained range [1.5, 4]") and err.count("\n") == 1
    assert main(["boundaries", str(elastic_run), "--text", "To be, or not to be, that is the question",
                 "--ratio", "6", "--extrapolate", "--device", "cpu"]) == 0
    assert "target R = 6" in capsys.readouterr().out
    png = tmp_path / "f.png"
    assert main(["frontier", str(elastic_run), "--ratios", "1.5,3,5", "--val-tokens", "3000", "--json",
                 "--plot", str(png), "--device", "cpu", "--latency", "--latency-len", "64"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(r["prefill_s"] > 0 and r["decode_ms_per_token"] > 0 and r["prefill_tokens"] == 64 for r in rows)
    assert rows[0]["prefill_compression"] < rows[1]["prefill_compression"]  # the timed passes ran at each R
    assert [r["ratio"] for r in rows] == [1.5, 3.0]  # 5 is outside the trained range: left out
    assert rows[0]["activated_flops_per_token"] > rows[1]["activated_flops_per_token"]
    assert rows[0]["concept_kv_bytes_per_token"] > rows[1]["concept_kv_bytes_per_token"]
    assert rows[0]["design_ratio"] == 2.0 and png.stat().st_size > 0


def test_fixed_run_refuses_other_ratios(tmp_path, capsys):
    from conceptmoe.cli import main

    corpus = make_corpus(tmp_path / "c", n_docs=3, chars=3000)
    run = train(TrainConfig(**TINY, data=str(corpus), out=str(tmp_path / "fixed"), max_steps=2, eval_every=0,
                            val_tokens=200, dtype="fp32"))
    assert main(["eval", str(run), "--ratio", "3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "trained for R=2 only" in err and err.count("\n") == 1
    assert main(["eval", str(run), "--ratio", "2", "--device", "cpu", "--json"]) == 0
    with pytest.raises(UserError, match="--model moe"):
        TrainConfig(**TINY, model="moe", ratios="1.5,2")


@pytest.mark.slow
def test_harness_model_args_concept_ratio(elastic_run):
    """``--model_args run=RUN,concept_ratio=R``: the harness model scores text at that R."""
    pytest.importorskip("lm_eval")
    from conceptmoe.harness.lm import ConceptMoEHarnessLM

    req = [(None, list(range(40, 80)), list(range(80, 90)))]
    score = {r: ConceptMoEHarnessLM(run=str(elastic_run), concept_ratio=r)._loglikelihood_tokens(req)[0][0]
             for r in (1.5, 4.0)}
    m = ConceptMoEHarnessLM(run=str(elastic_run)).model
    ids = torch.tensor([list(range(40, 89))])
    with torch.no_grad():
        logp = torch.log_softmax(m(ids, ratio=4.0).logits.float(), -1)[0, 39:49]
    want = float(logp.gather(1, torch.arange(80, 90)[:, None]).sum())
    assert score[4.0] == pytest.approx(want, abs=1e-4) and score[1.5] != pytest.approx(score[4.0], abs=1e-4)


def test_converted_runs_become_elastic(tmp_path, capsys):
    """convert --ratios (a fresh ratio embedding) and train --init FIXED_RUN --ratios both give elastic runs."""
    from conceptmoe.cli import main
    from conceptmoe.training.checkpoint import load_run

    corpus = make_corpus(tmp_path / "c", n_docs=3, chars=3000)
    moe = train(TrainConfig(**TINY, model="moe", data=str(corpus), out=str(tmp_path / "moe"), max_steps=2,
                            eval_every=0, val_tokens=200, dtype="fp32"))
    assert main(["convert", str(moe), "--out", str(tmp_path / "el"), "--ratios", "1.5,2,3"]) == 0
    assert main(["convert", str(moe), "--out", str(tmp_path / "fx")]) == 0
    capsys.readouterr()
    src = load_run(tmp_path / "el", "cpu")[0]
    assert src.cfg.elastic_ratios == [1.5, 2.0, 3.0]
    for init, ratios in ((tmp_path / "el", None), (tmp_path / "fx", "1.5,2,3")):
        out = tmp_path / f"ct-{init.name}"
        train(TrainConfig(device="cpu", progress=False, batch_size=4, seq_len=32, init=str(init), ratios=ratios,
                          out=str(out), max_steps=2, eval_every=0, val_tokens=200, dtype="fp32"))
        m = load_run(out, "cpu")[0]
        assert m.cfg.elastic_ratios == [1.5, 2.0, 3.0]
        fixed = load_run(init, "cpu")[0].state_dict()
        # two Adam steps from the init weights (a fresh init would be ~0.02-0.1 away everywhere); the
        # checkpoint's weights, since model.safetensors also holds the calibrated shifts (ratio_calibration.py)
        trained = load_file(next((out / "checkpoints").iterdir()) / "model.safetensors")
        drift = max(float((t - fixed[n]).abs().max()) for n, t in trained.items() if n in fixed)
        assert 0 < drift < 0.02
        assert main(["eval", str(out), "--ratio", "3", "--val-tokens", "200", "--device", "cpu"]) == 0
    # a ratio set whose range leaves out the converted run's design R is refused
    assert main(["convert", str(moe), "--out", str(tmp_path / "bad"), "--ratios", "3,4"]) == 2
    assert "design ratio must lie in the trained range" in capsys.readouterr().err


@pytest.mark.slow
def test_export_hf_concept_ratio_default(elastic_run, tmp_path, capsys):
    """``export-hf --concept-ratio R`` writes the default R the exported model runs at; R outside the
    trained range is refused with one line and nothing written."""
    tr = pytest.importorskip("transformers")
    from conceptmoe.cli import main
    from conceptmoe.training.checkpoint import load_run

    out = tmp_path / "hf"
    assert main(["export-hf", str(elastic_run), "--out", str(out), "--concept-ratio", "6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --concept-ratio: R=6 is outside the trained range") and err.count("\n") == 1
    assert "--extrapolate" in err and not out.exists()  # a flag export-hf has
    assert main(["export-hf", str(elastic_run), "--out", str(out), "--concept-ratio", "3"]) == 0
    assert json.loads((out / "config.json").read_text())["concept_ratio"] == 3.0
    hf = tr.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    m = load_run(elastic_run, "cpu")[0].eval()
    ids = torch.tensor([list(range(40, 60))])
    with torch.no_grad():
        got = hf(ids, use_cache=False).logits
    assert torch.allclose(got, m(ids, ratio=3.0).logits, atol=1e-5)
    assert not torch.allclose(got, m(ids).logits, atol=1e-4)  # not the design ratio


def test_export_hf_concept_ratio_needs_an_elastic_run(tmp_path, capsys):
    from conceptmoe.cli import main

    corpus = make_corpus(tmp_path / "c", n_docs=3, chars=3000)
    run = train(TrainConfig(**TINY, data=str(corpus), out=str(tmp_path / "fixed"), max_steps=1, eval_every=0,
                            val_tokens=200, dtype="fp32"))
    assert main(["export-hf", str(run), "--out", str(tmp_path / "hf"), "--concept-ratio", "2"]) == 2
    err = capsys.readouterr().err
    assert "elastic ConceptMoE runs only" in err and err.count("\n") == 1 and not (tmp_path / "hf").exists()
