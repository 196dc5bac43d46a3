"""Contract: backend knowledge lives in ``weightsync/transport/`` alone.

Adding a backend is a module in ``weightsync/transport/`` and one line of
``weightsync/transport/registry.py``; everything outside the package asks the backend's class what it
can do (its capability attributes) and takes its choices from the registry. So no code outside
``weightsync/transport/`` names a backend: no string literal equal to a registered kind, no
``TransportKind.<MEMBER>``, no import of a backend's module. Docstrings and comments may name
backends (they explain); tests, scripts and examples are not scanned (they exercise named backends
on purpose). The exceptions are listed in :data:`ALLOWED`, each with its reason.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.cli import build_parser
from weightsync.transport import AUTO, TransportKind, receiver_kinds, run_choices, transport_class
from weightsync.transport.config import NONE
from weightsync.transport.registry import _BACKENDS

ROOT = Path(__file__).resolve().parent.parent / "weightsync"

ALLOWED: dict[tuple[str, str], str] = {
    ("plan/cost.py", "local"): "a link class of the cost model (bytes that stay on one device), not a transport",
    ("launch/placement.py", "local"): "the kind of placement (every process on this host), not a transport",
}
"""(file under weightsync/, literal) -> why the word there is not a backend's name."""


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of string constants that are statements of their own (module, class, function and
    attribute docstrings): text for readers, not values the code branches on."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def _offences(source: str) -> list[tuple[int, str]]:
    """(line, what) for every backend name in ``source``'s code."""
    kinds = {k.value for k in TransportKind}
    members = {k.name for k in TransportKind}
    modules = {module for module, _, _ in _BACKENDS.values()}
    tree = ast.parse(source)
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in kinds and id(node) not in docs:
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.Attribute) and node.attr in members and _name(node.value) == "TransportKind":
            out.append((node.lineno, f"TransportKind.{node.attr}"))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names if a.name in modules]
        elif (isinstance(node, ast.ImportFrom) and node.module
              and {node.module, *(f"{node.module}.{a.name}" for a in node.names)} & modules):
            out.append((node.lineno, f"from {node.module} import ..."))
    return out


def _name(node: ast.AST) -> str | None:
    """The last name of ``x`` or ``a.b.x``."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _scanned() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] != "transport"]


def test_no_backend_name_outside_transport() -> None:
    found = []
    for path in _scanned():
        rel = path.relative_to(ROOT).as_posix()
        found += [f"weightsync/{rel}:{line}: {what}" for line, what in _offences(path.read_text())
                  if (rel, what) not in ALLOWED]
    assert not found, ("backend names outside weightsync/transport/ (ask the backend's capabilities or the "
                       "registry instead):\n" + "\n".join(found))


def test_every_allowed_exception_is_still_needed() -> None:
    for (rel, what), why in ALLOWED.items():
        assert any(w == what for _, w in _offences((ROOT / rel).read_text())), f"{rel}: {what!r} is gone ({why})"


@pytest.mark.parametrize(("source", "expected"), [
    pytest.param('x = "shm"', [(1, "shm")], id="literal"),
    pytest.param('if kind == "cuda_ipc":\n    pass', [(1, "cuda_ipc")], id="comparison"),
    pytest.param("k = TransportKind.MOONCAKE", [(1, "TransportKind.MOONCAKE")], id="enum-member"),
    pytest.param("k = transport.TransportKind.SHM", [(1, "TransportKind.SHM")], id="qualified-enum-member"),
    pytest.param("from weightsync.transport.shm import remove_segments",
                 [(1, "from weightsync.transport.shm import ...")], id="backend-module"),
    pytest.param("from weightsync.transport import shm", [(1, "from weightsync.transport import ...")],
                 id="backend-module-by-name"),
    pytest.param('"""Receives through shm."""\nx = 1\n"""The attribute: "shm"."""', [], id="docstrings"),
    pytest.param('x = "shm_threads"  # shm', [], id="longer-word-and-comment"),
])
def test_the_scan_finds_backend_names(source: str, expected: list[tuple[int, str]]) -> None:
    """The check itself: it finds each form of a backend name and passes docstrings and comments."""
    assert _offences(source) == expected


def test_each_registry_line_names_its_class() -> None:
    """A registry line's kind is its class's ``kind`` (descriptors carry it) and its module is in the package."""
    for kind in TransportKind:
        cls = transport_class(kind)
        assert cls.kind == kind.value
        assert cls.__module__.startswith("weightsync.transport.")


def _choices(command: str) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return list(next(a for a in sub._actions if "--transport" in a.option_strings).choices)


def test_transport_choices_come_from_the_registry() -> None:
    """``--transport`` of run and bench is auto or a kind an engine receives through, serve's is none
    or one of those; the kinds are the registry's, selected by capability (one-sided, reaches other
    processes): today shm, cuda_ipc and mooncake, not dist (two-sided) nor local (same process)."""
    receivers = [k.value for k in receiver_kinds()]
    assert receivers == [k.value for k in TransportKind
                         if transport_class(k).one_sided and not transport_class(k).same_process_only]
    assert set(receivers) == {"shm", "cuda_ipc", "mooncake"}
    assert _choices("run") == _choices("bench") == list(run_choices()) == [AUTO, *receivers]
    assert _choices("serve") == [NONE, *receivers]


def test_building_the_command_line_imports_no_backend() -> None:
    """The choices are read from the backends' classes only when argparse needs them, so that
    ``weightsync list`` (and a parse) does not import torch (``weightsync/cli/__init__.py``)."""
    code = ("import sys; from weightsync.cli import build_parser; build_parser().parse_args(['serve', 'M']); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m in BACKENDS))")
    backends = repr({module for module, _, _ in _BACKENDS.values()})
    out = subprocess.run([sys.executable, "-c", f"BACKENDS = {backends}; {code}"], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
