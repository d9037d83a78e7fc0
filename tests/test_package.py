"""A clean package: no large or binary files under conceptmoe/, and requirements that do not
force one torch build on users."""

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "conceptmoe"
MAX_BYTES = 1 << 20


def _package_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "conceptmoe"], cwd=ROOT, capture_output=True, text=True, check=True)
        return [ROOT / f for f in out.stdout.splitlines() if (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file but caches
        return [p for p in PKG.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def _is_binary(path: Path) -> bool:
    return b"\0" in path.read_bytes()[:8192]


def test_no_large_or_binary_file_in_the_package():
    files = _package_files()
    assert any(p.name == "__init__.py" for p in files)
    bad = [f"{p.relative_to(ROOT)} ({p.stat().st_size:,} bytes)" for p in files
           if p.stat().st_size > MAX_BYTES or _is_binary(p)]
    assert not bad, f"large or binary files under conceptmoe/: {bad}"


def test_the_binary_check_sees_a_binary(tmp_path):
    f = tmp_path / "x.whl"
    f.write_bytes(b"PK\x03\x04\0\0payload")
    assert _is_binary(f)


def test_requirements_are_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    pinned = [r for r in reqs if "==" in r]
    assert not pinned, f"exact pins belong in the README's set-up command, not the library: {pinned}"
    for r in reqs:
        if r.startswith("transformers"):
            assert "<6" in r, f"transformers is used through v5 internals: bound it ({r})"
