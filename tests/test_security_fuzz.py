"""Contract: fuzzed requests on every route never get a 5xx but the documented 503s, never take the
engine down, and never leave it serving other weights -- ``scripts/fuzz_engine.py`` (one engine of
tiny Qwen3-4B, TP 2, with a token) on a short, seeded run: ``/health`` answers 200 after every
request, and every restore serves the engine's first greedy answer again. Longer runs and their
figures: BENCHMARKS.md, "Reliability"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fuzzed_requests_get_no_5xx_and_leave_the_engine_serving(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    done = subprocess.run([sys.executable, "scripts/fuzz_engine.py", "--requests", "150", "--seed", "3",
                           "--restore-every", "50", "--out", str(out), "--log", str(tmp_path / "engine.log")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert out.exists(), done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failures"] == [], json.dumps(result["failures"], indent=1)[:3000]
    assert result["requests"] == 150
    assert result["restores"] == 3
    assert result["engine_alive_at_end"]
    assert done.returncode == 0, done.stdout[-2000:]
    assert {"200", "400", "401"} <= set(result["by_status"]), result["by_status"]
