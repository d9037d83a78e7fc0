"""Recipe files (training/recipe.py, cli/recipe.py): ``--config FILE.toml``, ``--print-config``,
``recipe.toml`` in every run, and the repository's recipes/ held to the study records they name.

(tests/test_recipes.py is about the named corpora of data/recipes.py.)"""

import json
import math
import tomllib
from pathlib import Path

import pytest

from conceptmoe.cli import build_parser, main
from conceptmoe.cli.recipe import compare_file
from conceptmoe.cli.training import train_config_from_args
from conceptmoe.evaluation.compare import CompareConfig, plan
from conceptmoe.training.config import comparable_model, model_config
from conceptmoe.training.recipe import render
from training_helpers import make_corpus

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
STUDY_TRAIN = sorted(p for p in (RECIPES / "study").glob("*.toml") if not p.name.startswith("compare-"))
STUDY_COMPARE = sorted((RECIPES / "study").glob("compare-*.toml"))
# A few steps of each recipe's own model on a small corpus (the check against the record is made on
# the recipe as written, through --print-config).
FEW_STEPS = ["--batch-size", "2", "--seq-len", "32", "--device", "cpu"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus") / "plays", n_docs=3, chars=3000)


def printed(capsys, *argv) -> str:
    capsys.readouterr()
    assert main([*argv, "--print-config"]) == 0
    return capsys.readouterr().out


def resolved_train(capsys, tmp_path, *argv):
    """The TrainConfig that ``train ARGV --print-config`` prints, read back as a recipe."""
    path = tmp_path / "printed.toml"
    path.write_text(printed(capsys, "train", *argv))
    return train_config_from_args(build_parser().parse_args(["train", "--config", str(path)])), path


def about(recipe: Path) -> dict:
    return tomllib.loads(recipe.read_text())["about"]


def test_the_default_recipe_is_what_train_does_with_no_flags(capsys):
    plain = printed(capsys, "train")
    assert printed(capsys, "train", "--config", str(RECIPES / "default.toml")) == plain
    assert 'strategy = "topk"' in plain and "tokens = 1600000" in plain and "warmup_steps = 39" in plain


@pytest.mark.parametrize("recipe", STUDY_TRAIN, ids=lambda p: p.stem)
def test_study_recipes_match_their_records(recipe, capsys, tmp_path):
    """The resolved model (every field), lr, budget, data and precision of each study recipe are
    those of the study record it names; a moved default would show here."""
    note = about(recipe)
    report = json.loads((ROOT / note["record"]).read_text())
    row = next(m for m in report["models"] if m["label"] == note["label"])
    tc, _ = resolved_train(capsys, tmp_path, "--config", str(recipe))
    assert comparable_model(model_config(tc).to_dict()) == comparable_model(row["config"])
    assert model_config(tc).name == row["name"] and tc.lr == row["lr"] and tc.chunk_lr_mult == row["chunk_lr_mult"]
    settings = report["settings"]
    assert (tc.tokens, tc.data, tc.batch_size, tc.seq_len, tc.preset) == (
        settings["tokens"], settings["data"], settings["batch_size"], settings["seq_len"], settings["preset"])
    assert {tc.dtype} == set(row["precision"]) == {settings["dtype"]}


@pytest.mark.parametrize("recipe", STUDY_COMPARE, ids=lambda p: p.stem)
def test_study_compare_recipes_match_their_records(recipe, capsys, tmp_path):
    report = json.loads((ROOT / about(recipe)["record"]).read_text())
    path = tmp_path / "printed.toml"
    path.write_text(printed(capsys, "compare", "--config", str(recipe)))
    text = tomllib.loads(path.read_text())
    cc = CompareConfig(**{k: v for k, v in text.items()})
    want = {k: v for k, v in report["settings"].items() if k not in ("out", "variants", "overrides", "seeds")}
    assert {k: getattr(cc, k) for k in want} == want and not report["settings"]["overrides"]
    models = dict(plan(cc))
    rows = [m for m in report["models"] if m["label"] in models]
    assert {m["label"] for m in rows} >= {"moe", "topk-R2"}
    for row in rows:
        tc = models[row["label"]]
        assert comparable_model(model_config(tc).to_dict()) == comparable_model(row["config"]), row["label"]
        assert tc.lr == row["lr"], row["label"]


@pytest.mark.parametrize("recipe", [RECIPES / "default.toml"] + STUDY_TRAIN, ids=lambda p: p.stem)
def test_every_train_recipe_trains(recipe, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", str(recipe), "--data", str(corpus), "--max-steps", "2", "--eval-every", "0",
                 "--val-tokens", "64", *FEW_STEPS, "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    full, _ = resolved_train(capsys, tmp_path, "--config", str(recipe))
    assert cfg["model"] == model_config(full).to_dict()  # the recipe's own model, not a stand-in
    assert cfg["train"]["lr"] == full.lr and cfg["train"]["max_steps"] == 2 and "tokens" not in tomllib.loads(
        (out / "recipe.toml").read_text())
    assert (out / "eval.json").is_file()


@pytest.mark.parametrize("recipe", STUDY_COMPARE[:1], ids=lambda p: p.stem)
def test_the_compare_recipe_trains_and_records_itself(recipe, corpus, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--config", str(recipe), "--data", str(corpus), "--tokens", "128", "--seeds", "1",
                 *FEW_STEPS, "--out", str(out)]) == 0
    written = (out / "recipe.toml").read_text()
    assert "seeds = [1]" in written and "tokens = 128" in written and 'dtype = "fp32"' in written
    assert "moe: MoE-top4, peak lr 0.002" in written and "topk-R2: ConceptMoE-1L-top10-R2, peak lr 0.001" in written
    # the written recipe resolves to the comparison it records
    again = tomllib.loads(printed(capsys, "compare", "--config", str(out / "recipe.toml"), "--out", str(out)))
    assert again == tomllib.loads(written)
    stored = json.loads((out / "compare.json").read_text())
    assert CompareConfig(**again, out=str(out)).to_dict() == {k: v for k, v in stored.items() if k != "tokenizer"}
    for label in ("moe", "topk-R2"):  # and each run it trained has its own
        run = tomllib.loads((out / label / "seed1" / "recipe.toml").read_text())
        assert run["seed"] == 1 and run["lr"] == {"moe": 0.002, "topk-R2": 0.001}[label]


def test_a_run_reruns_exactly_from_its_recipe(corpus, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train", "--preset", "tiny", "--data", str(corpus), "--tokens", "300", "--batch-size", "2",
                 "--seq-len", "32", "--lr", "3e-3", "--seed", "7", "--set", "ratio_loss_weight=0.25",
                 "--set", "boundary_sharpness_final=none", "--val-tokens", "64", "--device", "cpu",
                 "--out", str(first)]) == 0
    recipe = tomllib.loads((first / "recipe.toml").read_text())
    # defaults frozen: the budget, warmup, validation interval, precision; the overrides as [set]
    assert recipe["tokens"] == 300 and recipe["warmup_steps"] == 1 and recipe["eval_every"] == 1
    assert recipe["dtype"] == "fp32" and recipe["set"] == {"ratio_loss_weight": 0.25, "boundary_sharpness_final": "none"}
    assert "out" not in recipe and "resume" not in recipe
    assert main(["train", "--config", str(first / "recipe.toml"), "--out", str(second)]) == 0
    a, b = (json.loads((d / "config.json").read_text()) for d in (first, second))
    assert a["train"].pop("out") == str(first) and b["train"].pop("out") == str(second)
    assert a == b and a["train"]["seed"] == 7 and a["train"]["overrides"] == {"ratio_loss_weight": 0.25,
                                                                      "boundary_sharpness_final": None}
    assert (second / "recipe.toml").read_text() == (first / "recipe.toml").read_text()


def test_command_line_flags_beat_the_file(tmp_path, capsys):
    f = tmp_path / "r.toml"
    f.write_text('preset = "tiny"\nlr = 0.005\ntokens = 5000\nseed = 3\n[set]\nratio_loss_weight = 0.3\n'
                 "boundary_noise = false\n")
    tc, _ = resolved_train(capsys, tmp_path, "--config", str(f), "--lr", "0.002", "--max-steps", "9",
                           "--set", "ratio_loss_weight=0.1")
    assert (tc.lr, tc.max_steps, tc.tokens, tc.seed, tc.preset) == (0.002, 9, None, 3, "tiny")
    assert tc.overrides == {"ratio_loss_weight": 0.1, "boundary_noise": False}
    moe, _ = resolved_train(capsys, tmp_path, "--config", str(RECIPES / "study" / "conceptmoe-1.2M.toml"),
                            "--model", "moe")
    assert moe.model == "moe" and moe.strategy is None and moe.tokens == 1200000
    c = tmp_path / "c.toml"
    c.write_text('seeds = [0, 1, 2]\ntokens = 1000\nstrategies = ["topk", "loop"]\n'
                 '[variants.fixed]\nset = {chunk_router = "fixed"}\n')
    text = tomllib.loads(printed(capsys, "compare", "--config", str(c), "--seeds", "4", "--strategies", "topk"))
    assert (text["seeds"], text["tokens"], text["strategies"]) == ([4], 1000, ["topk"])
    assert text["variants"] == {"fixed": {"set": {"chunk_router": "fixed"}}}


def test_compare_variants_as_tables_or_a_json_file(tmp_path, capsys):
    spec = {"late": {"set": {"router_confidence_weight": 0.1, "boundary_sharpness_final": None}, "seeds": [0]}}
    (tmp_path / "v.json").write_text(json.dumps(spec))
    (tmp_path / "file.toml").write_text(f'seeds = [0, 1]\nvariants = "{tmp_path / "v.json"}"\n')
    (tmp_path / "tables.toml").write_text('seeds = [0, 1]\n[variants.late]\nseeds = [0]\n'
                                          '[variants.late.set]\nrouter_confidence_weight = 0.1\n'
                                          'boundary_sharpness_final = "none"\n')
    args = build_parser().parse_args(["compare", "--config", str(tmp_path / "tables.toml")])
    compare_file(args)
    assert args.variants == spec  # typed as the JSON file gives it: "none" is unset
    texts = [printed(capsys, "compare", "--config", str(tmp_path / name)) for name in ("file.toml", "tables.toml")]
    assert texts[0] == texts[1] and "late: ConceptMoE-1L-top10-R2" in texts[0]
    assert tomllib.loads(texts[0])["variants"]["late"]["set"]["boundary_sharpness_final"] == "none"


def test_print_config_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    printed(capsys, "train", "--preset", "tiny", "--out", "somewhere")
    printed(capsys, "compare", "--preset", "tiny", "--out", "elsewhere")
    assert list(tmp_path.iterdir()) == []


BAD = [  # (file content, or None for a missing file; what the one line must say)
    (None, "cannot read"),
    (b"lr = \n", "not valid TOML"),
    (b"lr = 0.001\nlr = 0.002\n", "not valid TOML"),
    (b'data = "\xff\xfe"\n', "not UTF-8"),
    (b"learning_rate = 0.001\n", "unknown key 'learning_rate'"),
    (b"batch-size = 3\n", "write it as batch_size"),
    (b'batch_size = "8"\n', "batch_size must be an integer"),
    (b"batch_size = 8.0\n", "batch_size must be an integer"),
    (b"lr = nan\n", "lr must be a finite number"),
    (b"compile = 1\n", "compile must be true or false"),
    (b'data = 5\n', "data must be a string"),
    (b"set = 3\n", "set must be a table"),
    (b"[set]\nd_modle = 64\n", "unknown model field 'd_modle'"),
    (b'[set]\nd_model = "64"\n', "d_model must be a int"),
    (b"[set]\nboundary_noise = 1\n", "boundary_noise must be true or false"),
    (b"[set]\nn_layers = 2.5\n", "n_layers must be an integer"),
    (b"[set]\nchunk_router = 5\n", "chunk_router must be a string"),
    (b"[about]\nrecord = 3\n", "[about] is a table of strings"),
]


@pytest.mark.parametrize("command,content,why", [("train", c, w) for c, w in BAD] +
                         [("compare", c, w) for c, w in BAD if "compile" not in w])  # compile: not a compare flag
def test_bad_recipe_files_are_one_line_errors(command, content, why, tmp_path, capsys, monkeypatch):
    """Each problem is one line naming the file and the key, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "bad.toml"
    if content is not None:
        f.write_bytes(content)
    capsys.readouterr()
    assert main([command, "--config", str(f), "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config {f}: ") and why in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_the_writer_round_trips_through_tomllib():
    d = {"s": 'a "quoted"\\ line\nnext\ttab \x7f \x01 ünï 😀', "f": [1e-05, 2.0, 0.1 + 0.2, 1e300, math.inf],
         "i": -3, "b": [True, False], "nested": [[1.5, 1.0], [2.0, 2.0]], "empty": [],
         "t": {"x.y": 1, "inner": {"z": "w", "deep": {"q": 0.5}}, "inline": [{"a": 1}]}}
    assert tomllib.loads(render(d, ["a comment"])) == d
