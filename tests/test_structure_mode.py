"""Contract: the mode knob has one type, :class:`weightsync.plan.records.Mode`, from the CLI down.

It used to be three (a plan ``Mode``, a launcher ``RunMode`` and a ``MODES`` string tuple in the
updater), and a mode went from string to enum and back four times on its way from ``--mode`` to
an update. This test reads every module of the package and fails on

* another enum with a member valued ``p2p``, ``broadcast`` or ``both``;
* a tuple, list, set or dict literal holding two or more of those strings (a second list of the
  modes: ``choices=("p2p", "broadcast")``, ``m in ("p2p", "broadcast", ...)``) -- take them from
  ``Mode`` (``Mode.BOTH.transfers``, ``[m.value for m in Mode]``) instead.

Strings become a ``Mode`` at the edges only (``Mode.parse`` in the CLI, ``UpdaterConfig``'s
coercion); the last tests pin what the edges accept and refuse.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import weightsync
from weightsync.plan.records import Mode

ROOT = Path(weightsync.__file__).parent
WORDS = {"p2p", "broadcast", "both"}
HOME = ("plan/records.py", "Mode")
"""Where the one mode type lives."""


def _strings(nodes: list[ast.expr | None]) -> set[str]:
    return {n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)} & WORDS


def _is_enum(cls: ast.ClassDef) -> bool:
    names = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases}
    return any(n.endswith("Enum") for n in names)


def _findings(source: str, rel: str) -> list[str]:
    """What in ``source`` (the module at ``rel``, relative to the package) is a second mode type or list."""
    out = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.ClassDef) and _is_enum(node) and (rel, node.name) != HOME:
            values = _strings([s.value for s in node.body if isinstance(s, ast.Assign)])
            if values:
                out.append(f"{rel}:{node.lineno}: enum {node.name} has mode values {sorted(values)}")
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and rel != HOME[0]:
            if len(_strings(list(node.elts))) >= 2:
                out.append(f"{rel}:{node.lineno}: a literal list of modes {sorted(_strings(list(node.elts)))}")
        elif isinstance(node, ast.Dict) and len(_strings(list(node.keys))) >= 2:
            out.append(f"{rel}:{node.lineno}: a dict keyed by modes {sorted(_strings(list(node.keys)))}")
    return out


def test_one_mode_type_and_no_second_list_of_modes():
    found = [f for p in sorted(ROOT.rglob("*.py")) for f in _findings(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert not found, ("a second mode type or list of mode strings (use weightsync.plan.records.Mode):\n"
                       + "\n".join(found))


def test_the_check_sees_what_it_looks_for():
    """The check itself: each kind of second mode list is found (so a pass above means something)."""
    cases = {
        "class RunMode(StrEnum):\n    P2P = 'p2p'\n": "enum RunMode",
        "MODES = ('p2p', 'broadcast', 'both')\n": "a literal list of modes",
        "ok = m in ['broadcast', 'p2p']\n": "a literal list of modes",
        "x = {'p2p': 1, 'broadcast': 2}\n": "a dict keyed by modes",
    }
    for source, what in cases.items():
        assert any(what in f for f in _findings(source, "launch/probe.py")), source
    assert _findings("class Mode(StrEnum):\n    P2P = 'p2p'\n    BOTH = 'both'\n", HOME[0]) == []


def test_the_edges_parse_strings_and_the_plan_takes_transfers_only():
    from weightsync.sync.updater_config import UpdaterConfig

    assert [m.value for m in Mode] == ["p2p", "broadcast", "both"]
    assert Mode.BOTH.transfers == (Mode.P2P, Mode.BROADCAST)
    assert Mode.parse("broadcast").transfers == (Mode.BROADCAST,)
    assert UpdaterConfig(mode="both").mode is Mode.BOTH
    assert UpdaterConfig(mode="both").modes == (Mode.P2P, Mode.BROADCAST)
    assert UpdaterConfig().mode is Mode.P2P
    with pytest.raises(ValueError, match="unknown mode 'p3p': use p2p, broadcast, both"):
        UpdaterConfig(mode="p3p")
    with pytest.raises(ValueError, match="unknown transfer mode 'both': a plan or one update is p2p or broadcast"):
        Mode.transfer("both")
    assert Mode.transfer("p2p") is Mode.P2P
