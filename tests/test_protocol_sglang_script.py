"""scripts/gpu_sglang_real.py (the real-sglang GPU run) debugged on CPU: the stand-in sglang
(0.5.16: no sessions, sglang's checksums) in the real server's place, then weightsync's engine."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from weightsync.proc import free_port
from weightsync.transport.mooncake import mooncake_available


@pytest.mark.skipif(not mooncake_available(), reason="mooncake.engine is not importable")
@pytest.mark.timeout(400)
def test_the_real_sglang_script_runs_end_to_end_on_cpu(repo_root: Any, tmp_path: Any) -> None:
    """Every path of every engine updated, verified before publication and served at the new
    version; 0.5.16's missing sessions said; the table printed last; JSON under --out."""
    argv = [sys.executable, str(repo_root / "scripts" / "gpu_sglang_real.py"), "--fake-sglang", "0.5.16",
            "--device", "cpu", "--scale", "tiny", "--updates", "1", "--timeout-s", "60", "--total-timeout-s", "300",
            "--sglang-port", str(free_port()), "--ws-port", str(free_port()), "--out", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=360, check=False, cwd=repo_root)
    results = json.loads((tmp_path / "results.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert results["ok"] is True
    assert results["errors"] == []
    runs = {(r["engine"], r["path"], r["pause_free"]): r for r in results["runs"]}
    assert set(runs) == {("fake-0.5.16", "p2p", "off"), ("weightsync", "p2p", "off"), ("weightsync", "p2p", "auto"),
                         ("weightsync", "tensor", "off"), ("weightsync", "tensor", "auto")}
    for r in runs.values():
        assert [u["verified"] for u in r["updates"]] == [True]
        assert r["generate"]["served"] == r["generate"]["expected_version"]
    assert runs[("weightsync", "p2p", "off")]["updates"][0]["pause_reason"] is not None
    assert runs[("weightsync", "p2p", "auto")]["updates"][0]["pause_reason"] is None
    assert results["engines"]["fake-0.5.16"]["builtin"] is False
    assert results["engines"]["fake-0.5.16"]["publishes_table"] is True
    assert any("has no weight-update sessions" in line for line in results["log"])
    lines = proc.stdout.strip().splitlines()  # last: the table's header, a row per run, where the JSON is
    assert lines[-len(runs) - 2].split()[:3] == ["engine", "path", "pause"]
    assert lines[-1].startswith("results: ")
