"""Study records carry each run's provenance (issue 53): docs/study/round3/interval.py reads it from a
run directory, "unknown" where the run says nothing, and rerun.py sets a rerun beside its record."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _mod(rel, name):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


interval = _mod("docs/study/round3/interval.py", "t_interval")
rerun = _mod("docs/study/round3/rerun.py", "t_rerun")


def _run(d: Path, bpb: float, comp: float, env: dict | None):
    d.mkdir(parents=True)
    cfg = {"precision": "fp32", **({"environment": {"start": env, "resumed_on": []}} if env else {})}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "eval.json").write_text(json.dumps({"val_bpb": bpb, "compression": comp}))
    steps = [{"step": 1, "tokens": 2048, "tokens_per_s": 1024.0}, {"step": 2, "tokens": 4096, "tokens_per_s": 512.0}]
    (d / "metrics.jsonl").write_text("\n".join(map(json.dumps, steps)) + "\n{\"val_bpb\": 2.0}\n")
    (d / "recipe.toml").write_text('preset = "small"\n')


ENV = {"cpu_model": "Some CPU", "cpu_flags": ["avx2", "avx512f"], "threads": 1, "world": 1, "torch": "2.13.0",
       "commit": "a" * 40}


def test_provenance_of_a_run_and_unknowns(tmp_path):
    _run(tmp_path / "moe/seed0", 1.9, 1.0, ENV)
    p = interval.provenance_of_run(tmp_path / "moe/seed0", jobs=2)
    assert p["machine"]["cpu_model"] == "Some CPU" and p["commit"] == "a" * 40
    assert p["threads"] == 1 and p["processes"] == {"world": 1, "jobs": 2} and p["precision"] == "fp32"
    assert p["train_s"] == 6.0  # 2048 tokens at 1024/s, then 2048 more at 512/s
    assert p["recipe"] == 'preset = "small"\n' and p["compression"] == 1.0
    _run(tmp_path / "old/seed0", 1.9, 1.0, None)  # a run from before environments were recorded
    old = interval.provenance_of_run(tmp_path / "old/seed0")
    assert old["commit"] == old["threads"] == old["machine"]["cpu_model"] == old["processes"]["jobs"] == "unknown"
    json.dumps(p, allow_nan=False)


def test_a_rerun_is_set_beside_its_record(tmp_path):
    _run(tmp_path / "cmp/moe/seed0", 1.90, 1.0, ENV)
    _run(tmp_path / "cmp/topk-R2/seed0", 1.88, 2.05, ENV)
    machine = {"name": "Old CPU, AVX2"}
    rec = {"per_seed": {"moe": {"0": 1.91}, "cm": {"0": 1.87}},
           "provenance": {"0": {"moe": {"round": 2, "machine": machine}, "cm": {"round": 2, "machine": machine}}}}
    (tmp_path / "rec.json").write_text(json.dumps(rec))
    r = rerun.build(tmp_path / "cmp", 0, "topk-R2", 1, 123.0, tmp_path / "rec.json")
    assert abs(r["difference"]["moe"] - (1.90 - 1.91)) < 1e-12 and abs(r["difference"]["cm"] - (1.88 - 1.87)) < 1e-12
    assert abs(r["gap"] - (-0.02)) < 1e-12 and abs(r["recorded_gap"] - (-0.04)) < 1e-12
    assert r["machine"]["name"] == "Some CPU, AVX-512" and r["recorded_machine"] == "Old CPU, AVX2"
    assert r["provenance"]["cm"]["compression"] == 2.05 and r["wall_s"] == 123.0


KEYS = {"round", "machine", "commit", "recipe", "precision", "threads", "processes", "compression", "train_s", "wall_s"}


def test_every_seed_of_the_round3_records_has_its_provenance():
    """Each run behind d1.2M-8seeds.json, long-context.json and conversion.json has every field
    (a value or "unknown"); a seed added without one fails here."""
    r3 = ROOT / "docs/study/round3"
    d12 = json.loads((r3 / "d1.2M-8seeds.json").read_text())
    for s in d12["seeds"]:
        for kind in ("moe", "cm"):
            assert KEYS <= set(d12["provenance"][str(s)][kind]), (s, kind)
    prov = json.loads((r3 / "provenance.json").read_text())
    for L, by in json.loads((r3 / "long-context.json").read_text())["runs"].items():
        for seed, runs in by.items():
            for lab in runs:
                assert KEYS <= set(prov["long-context"][L][seed][lab]), (L, seed, lab)
    conv = json.loads((r3 / "conversion.json").read_text())
    for seed in map(str, conv["seeds"]):
        for lab in ["moe", "scratch", *(r["label"] for r in conv["rows"])]:
            assert KEYS <= set(prov["conversion"][seed][lab]), (seed, lab)


def test_code_check_names_the_first_step_that_differs():
    check = _mod("docs/study/round3/code_check.py", "t_code_check")
    a = [{"step": i, "loss": 5.0 - i / 10, "grad_norm": 1.0} for i in range(1, 4)]
    assert check.compare(a, [dict(x) for x in a]) == {"steps": [3, 3], "identical": True, "first_difference": None,
                                                      "largest_difference": 0.0}
    b = [dict(x) for x in a]
    b[1]["loss"] += 1e-7
    r = check.compare(a, b)
    assert not r["identical"] and r["first_difference"]["step"] == 2 and abs(r["largest_difference"] - 1e-7) < 1e-12
    assert not check.compare(a, b[:2])["identical"]  # a run that stopped early differs
