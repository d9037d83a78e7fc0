"""Mutation check: break one line of the method at a time and make sure the tests notice.

    python tests/mutation/run_mutants.py              # every mutant, 2-3 min on one core
    python tests/mutation/run_mutants.py --only router-swap-forward ste-no-gradient
    python tests/mutation/run_mutants.py --list

The package and the tests are copied to a temporary directory once. For each mutant the
script puts back the original files, replaces one exact line fragment in the copy (the
fragment must occur exactly once), and runs only the test files named for that mutant, with
the copy first on the import path (the script checks that ``import conceptmoe`` resolves to
the copy, never to the working tree or an installed package). A mutant is *killed* when
pytest reports a failing test. The unmutated copy must pass those same tests first.

Prints a table mutant -> killed / SURVIVED (with the first test that failed) and exits 1 if
any mutant survived. ``--tests FILE ...`` runs the given test files against every mutant
instead, e.g. the suite without the method-path tests, to see what they add.
Run with ``OMP_NUM_THREADS=1`` on a shared machine (the script sets it for pytest).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # exact fragment, must occur once
    new: str
    tests: tuple[str, ...]  # test files that should kill it
    why: str = ""


CHUNK, LM, STEPS = "conceptmoe/model/chunking.py", "conceptmoe/model/lm.py", "conceptmoe/inference/steps.py"
GRAD = ("tests/test_gradient_paths.py", "tests/test_model.py")
CACHE = ("tests/test_cached_trained.py", "tests/test_generate.py")

MUTANTS = [
    # --- issue 8 part D: each of these survived the suite before ---
    Mutant("router-swap-forward", CHUNK, "q, k = _fp32_linear(self.wq, h), _fp32_linear(self.wk, h)",
           "q, k = _fp32_linear(self.wk, h), _fp32_linear(self.wq, h)",
           ("tests/test_router_paths.py",), "W_q and W_k swapped in the full router"),
    Mutant("router-swap-step", CHUNK, "q, key = _fp32_linear(self.wq, h), _fp32_linear(self.wk, h)",
           "q, key = _fp32_linear(self.wk, h), _fp32_linear(self.wq, h)",
           ("tests/test_router_paths.py", *CACHE), "W_q and W_k swapped in ChunkRouter.step"),
    Mutant("prefill-key-uses-wq", STEPS, "chunk.last_key = model.chunk.key(", "chunk.last_key = model.chunk.wq(",
           ("tests/test_router_paths.py", *CACHE), "prefill caches W_q h instead of W_k h"),
    Mutant("decode-drops-joint-z", STEPS, "model.dispatch, z=zq)", "model.dispatch, z=None)",
           CACHE, "decoder decode step without the concept (joint decoding)"),
    Mutant("ste-no-gradient", CHUNK, "return 1 + x - x.detach()", "return torch.ones_like(x)",
           GRAD, "straight-through estimator passes no gradient"),
    Mutant("ema-detach-p", CHUNK, "fp32_island(ema_scan)(chunks.concept_p, ",
           "fp32_island(ema_scan)(chunks.concept_p.detach(), ",
           GRAD, "no gradient through the EMA weights"),
    Mutant("drop-ratio-loss", LM, "router_loss = cfg.ratio_loss_weight * rl if use_ratio else None",
           "router_loss = None",
           GRAD, "ratio loss left out of the total loss"),
    # --- more of the method ---
    Mutant("ste-on-p-not-P", CHUNK, "P = torch.where(chunks.b, chunks.p, 1 - chunks.p)", "P = chunks.p",
           GRAD, "STE on p instead of the probability of the decision taken"),
    Mutant("sharpen-exponent", CHUNK, "p.pow(1 / s), 1 - (1 - p).pow(1 / s)", "p.pow(s), 1 - (1 - p).pow(s)",
           ("tests/test_chunking.py", "tests/test_review_fixes.py"), "sharpen flattens instead of sharpening"),
    Mutant("noise-without-sharpen", CHUNK, "sharpen(p.detach(), sharpness)", "(p.detach())",
           ("tests/test_chunking.py", "tests/test_review_fixes.py"),
           "boundary noise samples from p itself"),
    Mutant("eval-threshold-strict", CHUNK, "b = p >= 0.5", "b = p > 0.5",
           ("tests/test_chunking.py", "tests/test_review_fixes.py"), "p = 0.5 is not a boundary in eval"),
    Mutant("decode-threshold-strict", STEPS, "b = p >= 0.5  # (B,)", "b = p > 0.5  # (B,)",
           CACHE, "p = 0.5 is not a boundary in the decode step"),
    Mutant("ema-weights-swapped", "conceptmoe/model/scan.py", "return linear_scan(c, ema_log_decay(p), block, scale=p)",
           "return linear_scan(c, ema_log_decay(1 - p), block, scale=1 - p)",
           ("tests/test_scan.py", *GRAD), "EMA recurrence z = (1-p)c + p z_prev"),
    Mutant("decode-ema-weights", STEPS, "pr = p[rows, None].to(z.dtype)", "pr = (1 - p[rows, None]).to(z.dtype)",
           CACHE, "EMA weights p and 1 - p swapped in the decode step"),
    Mutant("dechunk-reads-next-concept", CHUNK,
           "idx = chunks.concept_index.unsqueeze(-1)",
           "idx = (chunks.concept_index + 1).clamp(max=z.shape[1] - 1).unsqueeze(-1)",
           ("tests/test_model.py",), "a token reads the next concept (not causal)"),
    Mutant("mean-pool-not-causal", CHUNK, "seg = cidx + 1 - b.long()", "seg = cidx",
           ("tests/test_chunking.py", "tests/test_model.py"), "mean pooling merges tokens after the boundary"),
    Mutant("joint-drops-wv", "conceptmoe/model/attention.py",
           "q, k, v = q + self.jq(z), k + self.jk(z), v + self.jv(z)",
           "q, k, v = q + self.jq(z), k + self.jk(z), v", ("tests/test_model.py",),
           "joint decoding leaves the values alone"),
    Mutant("balance-loss-sign", "conceptmoe/model/moe.py", "balance = E * (f * P).sum()",
           "balance = -E * (f * P).sum()", ("tests/test_moe.py", "tests/test_gradient_paths.py"),
           "load-balancing loss rewards imbalance"),
    Mutant("stats-balance-sign", "conceptmoe/model/stats.py",
           "balance.append(E * (f * _mean(", "balance.append(-E * (f * _mean(",
           ("tests/test_stats.py",), "the model's reported/trained balance loss rewards imbalance"),
    Mutant("stats-no-world-scale", "conceptmoe/model/stats.py",
           "scaled = local_sum * (world / n)", "scaled = local_sum / n",
           ("tests/test_stats.py",), "data-parallel gradients of global means W times too small"),
    Mutant("ratio-loss-G-term", CHUNK, "(1 - Fm) * (1 - G))", "(1 - Fm) * G)",
           ("tests/test_chunking.py",), "ratio loss with the wrong G term"),
    Mutant("flops-concept-not-scaled", "conceptmoe/model/flops.py",
           "concept_macs = sum(c.macs for c in concept_layers) * loops / R",
           "concept_macs = sum(c.macs for c in concept_layers) * loops",
           ("tests/test_flops.py",), "concept layers counted at token rate"),
    # --- issue 21: elastic compression (the model told its R) ---
    Mutant("elastic-router-drops-embedding", LM,
           "return self.chunk(h if terms.router is None else h + terms.router[:, None].to(h.dtype), offset, terms.shift)",
           "return self.chunk(h, offset, terms.shift)",
           ("tests/test_elastic.py",), "the ratio embedding never reaches the chunk router"),
    Mutant("elastic-step-drops-embedding", STEPS,
           "    return h if terms is None or terms.router is None else h + terms.router.to(h.dtype)",
           "    return h", ("tests/test_elastic.py",), "the cached router step ignores the row's ratio vector"),
    Mutant("elastic-batch-ratio-loss", LM, "            rl = per_sequence_ratio_loss(p, b, terms.ratio, real)[0]",
           "            rl = ratio_loss_fg(F_, G, terms.ratio.mean())",
           ("tests/test_elastic.py",), "one batch-level ratio loss instead of one per sequence"),
    Mutant("elastic-concept-vector-carried", LM, "            z_tok, z_res = dechunk(ch, c - (c_in - ch.concepts))",
           "            z_tok, z_res = dechunk(ch, c)", ("tests/test_elastic.py",),
           "the ratio's concept vector carried past the concept model into the token stream"),
    # --- issue 22: decisive-router options ---
    Mutant("anneal-never-applied", "conceptmoe/training/loop.py",
           "                lp.raw.sharpness_now = sharpness_at(cfg, step, plan)",
           "                lp.raw.sharpness_now = None", ("tests/test_train.py",),
           "the trainer never sets the annealed sharpness (boundary_sharpness_final ignored)"),
    Mutant("late-confidence-ignored", LM,
           "        conf = cfg.router_confidence_weight if self.confidence_now is None else self.confidence_now",
           "        conf = cfg.router_confidence_weight", ("tests/test_router_paths.py",),
           "the model ignores the trainer's scheduled confidence weight (router_confidence_start)"),
    Mutant("late-confidence-off-by-one", CHUNK, "    on = step >= cfg.router_confidence_start * total",
           "    on = step > cfg.router_confidence_start * total", ("tests/test_router_paths.py",),
           "the confidence term switches on one step late"),
    Mutant("temperature-skipped-in-step", CHUNK, "            p = self._temper(self._cosine_p(q, last_key))",
           "            p = self._cosine_p(q, last_key)", ("tests/test_router_paths.py", "tests/test_generate.py"),
           "the cached router step ignores the learned temperature"),
    Mutant("compression-warning-sign", "conceptmoe/model/health.py", "    return off if abs(off) > COMPRESSION_BAND else None",
           "    return off if off > COMPRESSION_BAND else None", ("tests/test_compression_warning.py",),
           "too few concepts (compression below R) never warned"),
    # --- issue 41: bf16 expert parallelism, fp32 islands, groups, counts, schedules ---
    Mutant("ep-dispatch-fp32-rows", "conceptmoe/model/moe.py",
           "out = self.expert_dispatch(self, _GatherRows.apply(xc, tok), counts, grouped, ws)",
           "out = self.expert_dispatch(self, _GatherRows.apply(x, tok), counts, grouped, ws)",
           ("tests/test_bf16_paths.py",), "expert parallelism sends the fp32 rows to the experts under bf16"),
    Mutant("prefill-key-outside-island", STEPS, "chunk.last_key = model.chunk.key(", "chunk.last_key = model.chunk.wk(",
           ("tests/test_fp32_islands.py",), "prefill caches W_k h in the model's dtype (bf16), not fp32"),
    Mutant("island-without-upcast", "conceptmoe/model/fp32.py",
           "return fn(*map(_up, args), **{k: _up(v) for k, v in kw.items()})", "return fn(*args, **kw)",
           ("tests/test_fp32_islands.py",), "an fp32 island turns autocast off but leaves bf16 operands"),
    Mutant("ratio-embedding-decayed", "conceptmoe/training/train.py",
           'for name in ("chunk", "ratio_embed") if getattr(raw, name, None) is not None',
           'for name in ("chunk",) if getattr(raw, name, None) is not None',
           ("tests/test_optimizer_groups.py",), "the ratio embedding outside the chunk router's group"),
    Mutant("flops-without-ratio-embedding", "conceptmoe/model/flops.py",
           "        chunk_params += _ratio_embedding_params(cfg)", "        chunk_params += 0",
           ("tests/test_flops.py",), "count_flops leaves out the ratio embedding's tables"),
    Mutant("confidence-over-padding", LM,
           "c = c.mean() if real is None else (c * real[:, 1:]).sum() / real[:, 1:].sum().clamp_min(1)",
           "c = c.mean()", ("tests/test_vlm_padding.py",), "the confidence term averages over padding"),
    Mutant("skipped-step-lends-its-draws", "conceptmoe/training/loop.py",
           "            drawn = step + skipped", "            drawn = step", ("tests/test_skipped_steps.py",),
           "noise and ratios keyed by the optimizer step: a skipped step's draws reused"),
    Mutant("skip-count-reset-on-resume", "conceptmoe/training/train.py",
           'step, skipped = int(state["step"]), int(state.get("skipped", 0))', 'step, skipped = int(state["step"]), 0',
           ("tests/test_skipped_steps.py",), "the count of skipped steps starts over on resume"),
    Mutant("resume-total-unchecked", "conceptmoe/training/train.py", "    if want == end or (want > step >= end):",
           "    if True:", ("tests/test_resume_schedule.py",), "a resume may change the schedule's total"),
    Mutant("resume-lr-unchecked", "conceptmoe/training/train.py",
           "        if (k in old or k == \"stage_lr_mults\") and old.get(k) != getattr(tc, k):", "        if False:",
           ("tests/test_resume_schedule.py",), "a resume may change the lr schedule"),
    Mutant("match-ignores-expert-multiple", "conceptmoe/model/match.py",
           "    for over in _candidates(base, strategy, multiple):", "    for over in _candidates(base, strategy, 1):",
           ("tests/test_flops.py", "tests/test_shardable_match.py"), "--experts-multiple-of ignored by the solver"),
    # --- issues 41 / 42 (this round): calibration, reruns, recipes, health ---
    Mutant("calibration-wrong-direction", "conceptmoe/training/ratio_calibration.py",
           "            lo = mid  # too few boundaries: raise p", "            hi = mid  # too few boundaries: raise p",
           ("tests/test_ratio_calibration.py",), "the bisection moves the shift the wrong way"),
    Mutant("calibration-weights-sign", "conceptmoe/training/ratio_calibration.py",
           "tensors[SHIFT_KEY] = tensors[SHIFT_KEY] + torch", "tensors[SHIFT_KEY] = tensors[SHIFT_KEY] - torch",
           ("tests/test_ratio_calibration.py",), "model.safetensors gets the opposite moves"),
    Mutant("calibration-loses-position", "conceptmoe/training/ratio_calibration.py",
           "        sampler.set_position(keep)", "        pass",
           ("tests/test_ratio_calibration.py",), "drawing the calibration slice moves the data position"),
    Mutant("resume-environment-unnamed", "conceptmoe/training/reproducible.py",
           "        if before.get(key) != now.get(key):", "        if False:",
           ("tests/test_reproducible.py",), "a resume on another thread count is not named"),
    Mutant("recipe-file-beats-flags", "conceptmoe/cli/recipe.py",
           "    return {**file, **cli} if file", "    return {**cli, **file} if file",
           ("tests/test_recipe_files.py",), "the file's [set] beats the command line's --set"),
    Mutant("dead-expert-never-warned", "conceptmoe/training/health.py",
           "            dead = [i for i, c in enumerate(e[\"tokens\"]) if c == 0]",
           "            dead = []", ("tests/test_watch.py",), "an expert with no token is not reported"),
]


def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    shutil.copytree(ROOT / "conceptmoe", dest / "conceptmoe", ignore=ignore)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=ignore)
    for folder in ("recipes", "docs"):  # tests/test_recipe_files.py reads the recipes and their study records
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(copy), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def check_imports_copy(copy: Path, env: dict[str, str]) -> None:
    out = subprocess.run([sys.executable, "-c", "import conceptmoe; print(conceptmoe.__file__)"],
                         cwd=copy, env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"import conceptmoe resolves to {out}, not to the copy in {copy}")


def run_tests(copy: Path, env: dict[str, str], tests: tuple[str, ...],
              timeout: float) -> tuple[str, str, float]:
    """(status, first failing test, seconds); status 'pass', 'fail' (a test failed), 'error'
    (pytest could not run, e.g. the mutant does not import) or 'timeout'."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", time.perf_counter() - t0
    failed = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("FAILED ")]
    status = {0: "pass", 1: "fail"}.get(res.returncode, "error")
    return status, (failed[0].split(" - ")[0] if failed else ""), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run just these mutants")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per pytest run (default 300)")
    ap.add_argument("--tests", nargs="+", metavar="FILE",
                    help="run these test files against every mutant instead of each mutant's own list")
    args = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.only and len(mutants) != len(set(args.only)):
        raise SystemExit(f"unknown mutant in {args.only}; see --list")
    if args.list:
        for m in mutants:
            print(f"{m.name:28} {m.path}: {m.why}")
        return 0
    with tempfile.TemporaryDirectory(prefix="conceptmoe-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        env = environment(copy)
        check_imports_copy(copy, env)
        originals = {m.path: (copy / m.path).read_text() for m in mutants}
        for m in mutants:
            if originals[m.path].count(m.old) != 1:
                raise SystemExit(f"{m.name}: fragment {m.old!r} must occur once in {m.path}")
        tests_of = {m.name: tuple(args.tests) if args.tests else m.tests for m in mutants}
        needed = tuple(sorted({t for m in mutants for t in tests_of[m.name]}))
        status, _, secs = run_tests(copy, env, needed, args.timeout)
        if status != "pass":
            raise SystemExit(f"the unmutated copy does not pass {needed} ({status}); fix that first")
        print(f"unmutated: {len(needed)} test files pass ({secs:.0f} s)")
        rows = []
        for m in mutants:
            for path, text in originals.items():
                (copy / path).write_text(text)
            (copy / m.path).write_text(originals[m.path].replace(m.old, m.new))
            status, by, secs = run_tests(copy, env, tests_of[m.name], args.timeout)
            verdict = "SURVIVED" if status == "pass" else f"killed ({status})" if status != "fail" else "killed"
            rows.append((m, verdict, secs))
            print(f"{m.name:28} {verdict:16} {secs:5.1f} s  {by or m.why}", flush=True)
    survivors = [m.name for m, v, _ in rows if v == "SURVIVED"]
    print(f"\n{len(rows) - len(survivors)}/{len(rows)} mutants killed"
          + (f"; survived: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
