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
