"""Contract: the package's layering holds, in every import the source contains.

Each sub-package of ``weightsync`` has a level; a module may import only from its own package or
from packages of a lower level, and no set of modules imports itself round a circle. Module-level
and function-level imports count alike (a function-level import is still a dependency), and so do
imports under ``TYPE_CHECKING``. docs/architecture.md describes the same table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "weightsync"

LEVELS: dict[str, int] = {
    "data": 0,  # bundled prompt data (no weightsync imports)
    "quant": 0,  # fp8 blocks, MLA derivation (torch only)
    "proc": 0,  # process plumbing: a free port, dying with the launcher
    "transport": 0,  # byte movers (knows no model)
    "fingerprint": 0,  # the fingerprint of written bytes (torch; Triton where its kernel runs)
    "models": 1,  # specs, registry, profiles, parallel sizes, checkpoints
    "layout": 2,  # pieces of global tensors
    "plan": 3,  # the static plan
    "sync": 4,  # the weight-update library: senders, receivers, the engine's parameter arena
    "engine": 5,  # the built-in inference engine
    "sources": 5,  # weight sources: synthetic trainer, Megatron adapter, prepare
    "launch": 6,  # placement, the run loop, the benchmark
    "cli": 8,  # commands: argparse + main
}
"""Package -> level. Packages of one level must not import each other (``engine`` / ``sources``)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported weightsync module) for every import in ``path``, at any depth."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from weightsync.x import y`` may name a module y: count it as x.y when it exists.
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((node.lineno, sub if _exists(sub) else target))
    return [(line, name) for line, name in out if name == "weightsync" or name.startswith("weightsync.")]


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (ROOT.parent / rel).with_suffix(".py").exists() or (ROOT.parent / rel / "__init__.py").exists()


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _graph() -> dict[str, list[tuple[int, str]]]:
    return {_module_name(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}


def test_every_package_has_a_level():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LEVELS), f"packages without a level in this test: {sorted(packages - set(LEVELS))}"


def test_imports_only_go_downward():
    bad: list[str] = []
    for mod, imports in _graph().items():
        src = _package(mod)
        for line, target in imports:
            dst = _package(target)
            if src is None:  # weightsync/__init__.py: the facade's re-exports may name any layer
                continue
            if dst is None:
                bad.append(f"{mod}:{line} imports the top-level package")
            elif dst != src and LEVELS[dst] >= LEVELS[src]:
                bad.append(f"{mod}:{line} ({src}, level {LEVELS[src]}) imports {target} ({dst}, level {LEVELS[dst]})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(set(bad)))


def test_no_import_cycles():
    graph = {mod: sorted({t for _, t in imports if t != mod}) for mod, imports in _graph().items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(mod: str) -> None:
        state[mod] = 1
        stack.append(mod)
        for nxt in graph.get(mod, []):
            # a package's __init__ importing its own submodules is not a circle through the package
            if nxt not in graph or mod.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[mod] = 2

    for mod in graph:
        if mod not in state:
            visit(mod)
    assert not cycles, "import circles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("package", ["transport", "quant", "data", "proc"])
def test_ground_floor_knows_no_model(package):
    """transport, quant, data and proc import nothing else of weightsync (transport knows no model)."""
    for path in (ROOT / package).rglob("*.py"):
        foreign = [t for _, t in _imports(path) if _package(t) != package]
        assert not foreign, f"{_module_name(path)} imports {foreign}"


def test_the_benchmark_is_a_leaf_of_the_harness():
    """``launch/bench/`` stands on the library and the run loop's records, never the other way: no
    module outside it imports it but the ``bench`` command (the run loop does not depend on the
    benchmark)."""
    bench = "weightsync.launch.bench"
    assert (ROOT / "launch" / "bench" / "__init__.py").is_file()
    bad = [f"{mod}:{line} imports {target}" for mod, imports in _graph().items()
           if not (mod == bench or mod.startswith(bench + ".") or mod == "weightsync.cli.bench")
           for line, target in imports if target == bench or target.startswith(bench + ".")]
    assert not bad, "imports of the benchmark from outside it:\n" + "\n".join(bad)
