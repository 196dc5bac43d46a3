"""Contract: the facade is the one implementation of an update.

``weightsync`` exports it, and ``launch/`` (``run``'s session and trainer ranks, the benchmark)
builds every update from it: no module there constructs a sender of the library itself or
replays one (``P2PSender``, ``BroadcastSender``, ``TensorSender``, ``send_bucket``), which is how a
second implementation of an update would show.
"""

from __future__ import annotations

import ast
from pathlib import Path

import weightsync

LAUNCH = Path(weightsync.__file__).parent / "launch"
SENDERS = {"P2PSender", "BroadcastSender", "TensorSender"}
REPLAYS = {"send_bucket", "wire_bucket"}


def test_the_facade_is_exported():
    from weightsync.sync import update_result, updater, updater_config

    homes = {"WeightUpdater": updater, "UpdaterConfig": updater_config, "UpdateStats": update_result,
             "UpdateError": update_result}
    for name, module in homes.items():
        assert getattr(weightsync, name) is getattr(module, name)
        assert name in weightsync.__all__


def _uses(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in SENDERS:
                out.add(f.id)
            elif isinstance(f, ast.Attribute) and (f.attr in SENDERS or f.attr in REPLAYS):
                out.add(f.attr)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("weightsync.sync."):
            out.update(a.name for a in node.names if a.name in SENDERS)
    return out


def test_launch_builds_every_update_from_the_facade():
    found = {str(p.relative_to(LAUNCH)): _uses(p) for p in sorted(LAUNCH.rglob("*.py"))}
    assert "bench/worker.py" in found
    assert {k: v for k, v in found.items() if v} == {}
    for module in ("session.py", "trainer_worker.py", "bench/worker.py"):
        text = (LAUNCH / module).read_text()
        assert "WeightUpdater" in text or "UpdaterConfig" in text, module
