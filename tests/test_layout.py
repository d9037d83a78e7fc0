"""The package layout: one public API, dependencies one way, no cycles (lazy imports included)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import conceptmoe

PKG = Path(conceptmoe.__file__).parent

# Which top-level parts each part may import (besides itself and the shared modules).
SHARED = {"errors", "files", "device", "lock"}
ALLOWED = {
    "model": set(),
    "data": set(),
    "parallel": {"model"},
    "inference": {"model"},
    "training": {"model", "data", "parallel"},
    "evaluation": {"model", "data", "parallel", "training", "interop"},  # interop: convert (continual training)
    "bench": {"model", "inference", "interop", "data", "training", "parallel"},  # data: prepare benchmark
    "interop": {"model", "inference", "data", "training"},
    "harness": {"model", "inference", "data", "training"},  # lm-evaluation-harness: tasks and our LM
    "serve": {"model", "inference", "training"},  # conceptmoe serve: the engine drives inference/
    "vllm_plugin": {"model", "interop"},  # vLLM's model class over ours; exports a run to serve it
    "cli": {"model", "inference", "data", "training", "evaluation", "bench", "interop", "harness", "parallel",
            "serve", "vllm_plugin"},
}


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PKG.rglob("*.py")}


def _imports(mod: str, path: Path, known: set[str]) -> set[str]:
    """Package modules that ``mod`` imports anywhere in its source (function bodies included)."""
    out, is_pkg = set(), path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = mod.split(".")
            if node.level:
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known and n != mod and not mod.startswith(n + ".")}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _part(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def test_public_api():
    from conceptmoe import (ConceptMoELM, ModelConfig, ModelOutput, MoELM, build_model, count_flops,  # noqa: F401
                            load_run, match_config)

    assert set(conceptmoe.__all__) >= {"ModelConfig", "build_model", "ModelOutput", "MoELM", "ConceptMoELM",
                                       "load_run", "count_flops", "match_config"}


def test_no_import_cycles():
    graph, state, stack = _graph(), {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(v):] + [v]))
            if v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_dependencies_run_one_way():
    bad = []
    for mod, targets in _graph().items():
        src = _part(mod)
        if src is None or src == "__main__":  # the package root: its public API
            continue
        if src in SHARED:
            assert not (targets - {f"conceptmoe.{s}" for s in SHARED}), f"{mod} is shared: it imports {targets}"
            continue
        assert src in ALLOWED, f"{mod}: a new top-level part needs its place in ALLOWED"
        for t in targets:
            dst = _part(t)
            if dst not in (None, src) and dst not in SHARED and dst not in ALLOWED[src]:
                bad.append(f"{mod} imports {t}")
    assert not bad, bad


def test_every_model_has_generate_in_a_fresh_process():
    code = ("from conceptmoe.model.lm import ConceptMoELM, MoELM; "
            "import inspect; assert 'attention_mask' in inspect.signature(MoELM.generate).parameters; "
            "assert ConceptMoELM.generate is MoELM.generate")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_modules_stay_small_and_documented():
    for mod, path in _modules().items():
        lines = path.read_text().splitlines()
        assert len(lines) <= 400, f"{mod} has {len(lines)} lines"
        if path.name == "__init__.py" and mod != "conceptmoe":
            assert ast.get_docstring(ast.parse(path.read_text())), f"{mod} needs a docstring"
