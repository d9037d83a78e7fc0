"""Claims held to their records (issue 42): the README's headline tables are rebuilt from the
committed JSON under docs/ by docs/headline.py and must match; every other figure in the README's
prose is a setting traced to its source here; the README stays short."""

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _headline():
    spec = importlib.util.spec_from_file_location("headline", ROOT / "docs/headline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


headline = _headline()
FIGURE = re.compile(r"(?<![\w.])[-+−]?\d+(?:\.\d+)?(?:\s?%|×)|(?<![\w.])[-+−]?\d+\.\d+(?![\w.])")


def _prose(text: str) -> str:
    """The README without code (blocks and inline), headline blocks, section numbers and link targets."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!-- headline:(\w+) -->.*?<!-- /headline:\1 -->", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"§[\d.–]+", "§", text)  # section numbers of CONCEPTMOE.md
    return re.sub(r"\]\([^)]*\)", "]", text)


def _traced() -> dict[str, bool]:
    """Figures the README's prose may state, each checked against the file it comes from."""
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    return {
        "3.11": py == ">=3.11",  # Python >= 3.11
        "0.01": headline._interval_module().LEVEL == 0.01,  # "level" means an interval within ±0.01
        "2601.21420": "2601.21420" in (ROOT / "CITATION.cff").read_text(),  # the paper's arXiv id
    }


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.parametrize("name", sorted(headline.TABLES))
def test_headline_table_matches_its_records(name):
    text = README.read_text()
    m = headline.block(name).search(text)
    assert m, f"README.md lacks the {name} table"
    assert m.group(2).strip() == headline.TABLES[name]().strip(), (
        f"the README's {name} table differs from its records: run python docs/headline.py --write")


def test_every_figure_in_the_prose_is_traced():
    traced = _traced()
    assert all(traced.values()), {k: v for k, v in traced.items() if not v}
    tables = "\n".join(build() for build in headline.TABLES.values())
    loose = [f for f in FIGURE.findall(_prose(README.read_text()))
             if f.strip("+-−") not in traced and f not in tables]
    assert not loose, f"figures in the README with no record: {loose}"


def test_the_check_catches_a_stray_figure(monkeypatch, tmp_path):
    fake = tmp_path / "README.md"
    fake.write_text(README.read_text() + "\nThe ConceptMoE is 12.5% faster.\n")
    monkeypatch.setattr(headline, "README", fake)
    tables = "\n".join(build() for build in headline.TABLES.values())
    loose = [f for f in FIGURE.findall(_prose(fake.read_text())) if f.strip("+-−") not in _traced() and f not in tables]
    assert loose == ["12.5%"]


def test_a_changed_record_fails_the_table(monkeypatch):
    real = headline._load

    def shifted(rel):
        rec = real(rel)
        if rel == "study/round3/d1.2M-8seeds.json":
            rec["cm"] = [v + 0.01 for v in rec["cm"]]
        return rec

    monkeypatch.setattr(headline, "_load", shifted)
    m = headline.block("quality").search(README.read_text())
    assert m.group(2).strip() != headline.quality().strip()


# --- the words (issue 53): verdicts, seed counts and labels come from the records ----------------

def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


@pytest.mark.parametrize("rel,name", [(rel, name) for rel, blocks in sorted(headline.DOC_BLOCKS.items())
                                      for name in sorted(blocks)])
def test_study_readme_blocks_match_their_records(rel, name):
    m = headline.block(name).search((ROOT / "docs" / rel).read_text())
    assert m, f"docs/{rel} lacks the {name} block"
    assert m.group(2).strip() == headline.DOC_BLOCKS[rel][name]().strip(), (
        f"docs/{rel}'s {name} block differs from its records: run python docs/headline.py --write")


def test_a_changed_verdict_word_fails():
    """The issue's first mutation: the bullet says the MoE is ahead while the record says the ConceptMoE."""
    m = headline.block("answers").search(README.read_text())
    assert "the ConceptMoE is ahead" in m.group(2)
    assert m.group(2).replace("the ConceptMoE is ahead", "the MoE is ahead", 1).strip() != headline.verdicts.answers().strip()


def test_a_ninth_seed_that_spans_zero_changes_the_words(monkeypatch):
    """The issue's second mutation: a 9th seed turns the interval to span 0; the generated bullet
    must then say "unresolved" and the seed count, and no longer match the README."""
    real = headline.verdicts._load

    def nine(rel):
        rec = real(rel)
        if rel == headline.verdicts.D12:
            rec = {**rec, "seeds": rec["seeds"] + [8], "gaps": rec["gaps"] + [0.09]}
            rec.update(headline.verdicts.interval(rec["gaps"]))
        return rec

    monkeypatch.setattr(headline.verdicts, "_load", nine)
    text = headline.verdicts.answers()
    assert "1.2M tokens (9 seeds): unresolved" in text and "ahead on 7 of 9 seeds" in text
    assert headline.block("answers").search(README.read_text()).group(2).strip() != text.strip()


def test_verdict_words_only_in_generated_blocks():
    """Outside the generated blocks, the README's answer section states no verdict or seed count."""
    prose = re.sub(r"<!-- headline:(\S+) -->.*?<!-- /headline:\1 -->", "",
                   _section(README.read_text(), "Does ConceptMoE beat MoE here?"), flags=re.S)
    words = re.findall(r"\b(?:ahead|behind|unresolved|not shown|not reproduced|level with|every seed|"
                       r"\d+ of \d+ seeds)\b", prose)
    assert not words, f"verdict words outside the generated blocks: {words}"


def test_labels_come_from_the_records(monkeypatch):
    """"fp32", "each seed its own pretrained MoE" and "2-core CPU" are read from the records."""
    real = headline._load

    def other(rel):
        rec = real(rel)
        if rel == "study/round3/conversion.json":
            rec["pretrained"] = {s: "one/moe" for s in rec["pretrained"]}
        if rel.startswith("serving/fp32-512mb"):
            rec["machine"]["cpu_count"] = 16
        if rel == "study/round3/d1.2M-8seeds.json":
            rec["provenance"]["3"]["cm"]["precision"] = "bf16"
        return rec

    monkeypatch.setattr(headline, "_load", other)
    table = headline.quality()
    assert "one pretrained MoE for every seed" in table and "| 8 | not recorded |" in table
    assert "CPUs of different sizes" in headline.serving()


def test_serving_per_step_claim_matches_its_record():
    """docs/serving.md: "N% slower per step (TPOT a vs b ms" against the 512 MiB record's medians."""
    text = (ROOT / "docs/serving.md").read_text()
    m = re.search(r"(\d+)% slower per step\*\* \(TPOT (\d+) vs (\d+) ms", text)
    assert m, "docs/serving.md no longer states the per-step figure this test checks"
    rec = headline._load("serving/fp32-512mb.json")
    tpot = {r["kind"]: r["tpot_s"]["p50"] * 1000 for r in rec["rows"]}
    assert (int(m[2]), int(m[3])) == (round(tpot["conceptmoe"]), round(tpot["moe"]))
    assert int(m[1]) == round(100 * (tpot["conceptmoe"] / tpot["moe"] - 1))
