"""Every parallel mode trains the one-process run (issue 18): DDP, FSDP2 and expert parallelism,
2 processes vs 1 at the default learning rate and loss weights; resume across process counts;
expert parallelism's global gradient norm, replicas and non-finite stop.

All runs go through ``dist_scripts/train_runs.py`` (``training.train._train``, the code path of
``conceptmoe train``), grouped into four launches (one process, two, one, two), gloo with one
thread per process, so the module costs a few launches rather than one per case.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conceptmoe.model.lm import build_model
from conceptmoe.training import checkpoint as ck
from training_helpers import make_corpus, run_cli

STEPS = 30
TOL = 1e-4
# Seed 3 (as the older distributed tests). At seed 5 step 16 the gradient is ill-conditioned: a
# 1e-7 relative perturbation of the weights moves its norm by up to 3e-5 relative (loss unchanged),
# so fp32 rounding alone puts the modes' grad_norm 1e-5..1.5e-4 apart there (issue-18 notes).
SEED = 3
MODES = {"ddp": {"parallel": "ddp"}, "fsdp": {"parallel": "fsdp"}, "ep": {"expert_parallel": 2}}
SCRIPT = Path(__file__).parent / "dist_scripts" / "train_runs.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CONCEPTMOE_DIST_TIMEOUT": "60",
       "CONCEPTMOE_CPU_BF16": "0"}


def _launch(n: int, runs: list[dict], folder: Path, name: str, timeout: float = 600):
    spec = folder / f"{name}.json"
    spec.write_text(json.dumps(runs))
    cmd = [sys.executable, str(SCRIPT), str(spec)] if n == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), str(SCRIPT), str(spec)]
    t0 = time.time()
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    return res, time.time() - t0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module: {name: run dir}, and the launches' stdout."""
    root = tmp_path_factory.mktemp("modes")
    corpus = make_corpus(root / "corpus")
    base = dict(preset="tiny", data=str(corpus), max_steps=STEPS, batch_size=4, seq_len=64, seed=SEED,
                save_every=10, eval_every=0, val_tokens=2000, dtype="fp32")
    out = lambda name: str(root / name)  # noqa: E731

    def run(name, model="conceptmoe", **kw):
        return {**base, "model": model, "out": out(name), **kw}

    def resume(name, **kw):
        return {"out": out(name), "resume": True, **kw}

    one_a, two, one_b = [], [], []
    for model in ("moe", "conceptmoe"):
        one_a.append(run(f"one-{model}", model))
        two += [run(f"{mode}-{model}", model, **flags) for mode, flags in MODES.items()]
    # --chunk-lr-mult 0: the router keeps its initial weights
    one_a.append(run("chunk0-one", max_steps=5, chunk_lr_mult=0.0))
    two += [run(f"chunk0-{mode}", max_steps=5, chunk_lr_mult=0.0, **flags) for mode, flags in MODES.items()]
    # the expert gradients dominate (two big experts, one a token, one per rank) and a small clip
    # value clips every step: a per-rank norm is 1e-3 off and the replicas drift apart
    big = {"overrides": {"expert_hidden": 256, "n_shared_experts": 0, "n_experts": 2, "top_k": 1}}
    one_a.append(run("clip-one", "moe", max_steps=10, grad_clip=0.05, **big))
    two.append(run("clip-ep", "moe", max_steps=10, grad_clip=0.05, **big, **MODES["ep"]))
    # vlm-digits under FSDP: padded rows, token-weighted loss, generation on full weights at the end
    vlm = dict(data="vlm-digits", preset="vlm", max_steps=4, seq_len=96, save_every=10, eval_every=2,
               overrides={"d_model": 32, "n_experts": 4, "expert_hidden": 16, "n_layers": 3})
    one_a.append(run("vlm-one", **vlm))
    two.append(run("vlm-fsdp", parallel="fsdp", **vlm))
    # bf16: FSDP trains with the same policy as DDP (autocast over fp32 parameters)
    two += [run(f"bf16-{mode}", "moe", max_steps=2, dtype="bf16", parallel=mode) for mode in ("ddp", "fsdp")]
    # bf16, one process vs DDP vs expert parallelism (whose experts must run on the bf16 rows too)
    one_a.append(run("bf16-one", "moe", max_steps=2, dtype="bf16"))
    two.append(run("bf16-ep", "moe", max_steps=2, dtype="bf16", **MODES["ep"]))
    # the README's compute-matched ConceptMoE (tiny: 7 concept experts unconstrained) under EP 2
    two.append(run("ep-matched", max_steps=2, strategy="topk", **MODES["ep"]))
    # resume: 2 -> 2, 1 -> 2, 2 -> 1 in every mode (expert parallelism exists only with 2)
    for mode, flags in MODES.items():
        single = {} if mode == "ep" else flags
        two += [run(f"r22-{mode}", stop_after=10, **flags), resume(f"r22-{mode}", **flags)]
        one_a.append(run(f"r12-{mode}", stop_after=10, **single))
        two.append(resume(f"r12-{mode}", **flags))
        two.append(run(f"r21-{mode}", stop_after=20, **flags))
        one_b.append(resume(f"r21-{mode}", **single))
    # runs that must fail: a NaN in rank 1's experts at step 3; a layout refused before writing
    nan = [run("nan-ep", "moe", max_steps=10, nan_at=[1, 3], **MODES["ep"]),
           run("ep3", "moe", max_steps=2, expert_parallel=3)]
    logs, took = {}, {}
    for name, n, batch in (("one_a", 1, one_a), ("two", 2, two), ("one_b", 1, one_b), ("nan", 2, nan)):
        logs[name], took[name] = _launch(n, batch, root, name)  # each test checks its own runs
    print(f"launch seconds: {json.dumps({k: round(v, 1) for k, v in took.items()})}")
    return root, logs, took


def _rows(runs, name: str) -> list[dict]:
    """The metrics of one run, which must have completed in its launch."""
    root, logs, _ = runs
    out = [ln for res in logs.values() for ln in res.stdout.splitlines() if ln.endswith(f"{root / name}")
           or f"{root / name}:" in ln]
    failed = [ln for ln in out if ln.startswith("FAILED")]
    assert not failed, "\n".join(failed)
    assert f"OK {root / name}" in out, "\n".join(f"{k}: {v.stdout}{v.stderr[-2000:]}" for k, v in logs.items())
    return ck.read_metrics(root / name)


def _assert_equal(rows: list[dict], ref: list[dict], tol: float = TOL) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, ref))
    norm = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(rows, ref))
    assert loss <= tol, f"max |loss difference| {loss:.2e} > {tol:g}"
    assert norm <= tol, f"max relative grad_norm difference {norm:.2e} > {tol:g}"


@pytest.mark.parametrize("model", ["moe", "conceptmoe"])
@pytest.mark.parametrize("mode", list(MODES))
def test_two_processes_equal_one_at_default_settings(runs, mode, model):
    rows, ref = _rows(runs, f"{mode}-{model}"), _rows(runs, f"one-{model}")
    assert len(ref) == STEPS
    _assert_equal(rows, ref)
    root = runs[0]
    assert [r["compression"] for r in rows] == pytest.approx([r["compression"] for r in ref], rel=1e-6)
    ev, ev_ref = (json.loads((root / name / "eval.json").read_text()) for name in (f"{mode}-{model}", f"one-{model}"))
    assert ev["val_loss"] == pytest.approx(ev_ref["val_loss"], abs=TOL)
    if (mode, model) == ("fsdp", "conceptmoe"):  # an ordinary run: it loads and evaluates in one process
        res = run_cli("eval", str(root / f"{mode}-{model}"), "--json", "--val-tokens", "2000")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["val_loss"] == pytest.approx(ev["val_loss"], abs=1e-6)


@pytest.mark.parametrize("mode", ["one"] + list(MODES))
def test_chunk_lr_mult_zero_leaves_the_router_bit_identical(runs, mode):
    root, _, _ = runs
    run = root / f"chunk0-{mode}"
    torch.manual_seed(SEED)  # as train() builds it
    start = build_model(ck.model_config_of(ck.read_run_config(run))).state_dict()
    end = load_file(run / "model.safetensors")
    router = [k for k in end if k.startswith("chunk.")]
    assert router and len(_rows(runs, f"chunk0-{mode}")) == 5
    for k in router:
        assert torch.equal(end[k], start[k]), k
    assert any(not torch.equal(end[k], start[k]) for k in end if k.startswith("encoder."))  # the rest trained


@pytest.mark.parametrize("case", ["r22", "r12", "r21"])
@pytest.mark.parametrize("mode", list(MODES))
def test_resume_across_process_counts(runs, mode, case):
    root, _, _ = runs
    _assert_equal(_rows(runs, f"{case}-{mode}"), _rows(runs, "one-conceptmoe"))
    assert json.loads((root / f"{case}-{mode}" / "eval.json").read_text())["step"] == STEPS


def test_expert_parallel_clips_by_the_global_norm(runs):
    # grad_clip 0.05 clips every step, by a factor that the experts' gradients decide
    # (per-rank clipping, measured: grad_norm 1.25e-3 relative off, replicas 2.8e-6 apart)
    ref = _rows(runs, "clip-one")
    assert all(r["grad_norm"] > 0.05 * 5 for r in ref)
    _assert_equal(_rows(runs, "clip-ep"), ref)


def test_expert_parallel_replicas_stay_bit_identical(runs):
    root, logs, _ = runs
    for name in ("ep-moe", "ep-conceptmoe", "clip-ep"):
        assert f"REPLICAS {root / name} identical" in logs["two"].stdout, logs["two"].stdout


def test_a_non_finite_expert_gradient_stops_every_rank(runs):
    root, logs, took = runs
    res = logs["nan"]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("FAILED") and f"{root / 'nan-ep'}:" in ln]
    assert len(lines) == 2, res.stdout + res.stderr[-2000:]
    messages = {ln.split(": ", 1)[1] for ln in lines}
    assert len(messages) == 1 and "training diverged at step 3: gradient norm is nan" in messages.pop()
    assert took["nan"] < 40  # a rank left waiting would sit out the 60 s collective timeout
    assert len(ck.read_metrics(root / "nan-ep")) == 2


def test_a_layout_that_cannot_run_is_refused_before_writing(runs):
    root, logs, _ = runs
    lines = [ln for ln in logs["nan"].stdout.splitlines() if f"{root / 'ep3'}:" in ln]
    assert len(lines) == 2 and all("--expert-parallel 3 must divide the number of processes (2)" in ln
                                   for ln in lines), logs["nan"].stdout
    assert not (root / "ep3").exists()


def test_fsdp_trains_evaluates_and_generates_vlm_digits(runs):
    root, _, _ = runs
    _assert_equal(_rows(runs, "vlm-fsdp"), _rows(runs, "vlm-one"))
    ev, ref = (json.loads((root / name / "eval.json").read_text()) for name in ("vlm-fsdp", "vlm-one"))
    assert {"answer_accuracy", "digits_accuracy", "compression_image", "compression_text"} <= set(ev)
    assert ev["val_loss"] == pytest.approx(ref["val_loss"], abs=TOL)
    assert ev["answer_accuracy"] == ref["answer_accuracy"] and ev["digits_accuracy"] == ref["digits_accuracy"]


def test_fsdp_bf16_is_ddp_bf16(runs):
    # measured before: FSDP's param_dtype=bf16 policy put step 1's loss 4.9e-4 away from DDP's
    ddp, fsdp = _rows(runs, "bf16-ddp"), _rows(runs, "bf16-fsdp")
    assert abs(ddp[0]["loss"] - fsdp[0]["loss"]) <= 1e-6
    _assert_equal(fsdp, ddp, tol=1e-3)


@pytest.mark.parametrize("mode", ["ddp", "ep"])
def test_bf16_two_processes_equal_one(runs, mode):
    # Step 1's forward sees the same rows in the same dtype in every mode: only the order of the
    # fp32 sums differs, so its loss matches one process to fp32 rounding (DDP: 2.4e-7). Experts
    # that ran on the fp32 rows (or scaled their bf16 outputs instead of the hidden activations,
    # as the local path does) put EP 7e-6 (3e-6) away. The gradients are not alike: autocast rounds
    # each weight gradient to bf16 once per process (128 rows' sum vs 256), which moves the norm by
    # ~1e-4 relative (DDP at step 1: 1.0e-4), hence the bf16 tolerance of the FSDP test.
    rows, ref = _rows(runs, f"bf16-{mode}"), _rows(runs, "bf16-one")
    assert len(ref) == 2
    assert abs(rows[0]["loss"] - ref[0]["loss"]) <= 1e-6, (rows[0]["loss"], ref[0]["loss"])
    _assert_equal(rows, ref, tol=1e-3)
    if mode == "ep":  # EP and DDP reduce the same bf16 products: grad norms 1.2e-7 apart (fp32 rows: 2.2e-5)
        ddp = _rows(runs, "bf16-ddp")
        assert abs(rows[0]["grad_norm"] - ddp[0]["grad_norm"]) / ddp[0]["grad_norm"] <= 2e-6


def test_expert_parallelism_trains_the_compute_matched_conceptmoe(runs):
    # under --expert-parallel 2 the match takes a concept-expert count 2 divides (default of
    # --experts-multiple-of); before, the solver's 7 experts were refused
    root = runs[0]
    assert len(_rows(runs, "ep-matched")) == 2
    stored = ck.read_run_config(root / "ep-matched")
    assert stored["model"]["concept_n_experts"] % 2 == 0 and stored["train"]["experts_multiple_of"] == 2
