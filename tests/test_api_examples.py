"""Contract: the README's API example and ``examples/api/update_engines.py`` run as they are on CPU
and update an engine started by ``weightsync serve`` bit-exactly in both modes.

Both run in a subprocess, exactly as a user runs them, against one engine (Qwen3-4B tiny, TP 2,
shm, dummy weights). Bit-exactness is what each update's verification proves: every engine
parameter's fingerprint equals the sum of the fingerprints of what the trainer ranks wrote into it
(``stats.verified``; a mismatch fails the update). The README snippet asserts it itself; the
example prints it, and the test checks the printed lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e_helpers import REPO_ROOT, serve_engine

ENGINE_ARGV = ["Qwen3-4B", "--scale", "tiny", "--tp", "2", "--transport", "shm", "--load-format", "dummy"]


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_engine(ENGINE_ARGV, tmp_path_factory.mktemp("engine") / "engine.log") as url:
        yield url


def readme_api_example() -> str:
    """The Python block of the README's API section."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## API: updating engines from your own training loop"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the README's API section has one Python example"
    return blocks[0]


def _run(argv: list[str], url: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ENGINE_URL": url, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)


def test_readme_api_example_runs_as_is(engine_url: str, tmp_path: Path):
    """The snippet is complete (imports, process group, updater, updates): it exits 0, and its own
    ``assert stats.verified`` held for a p2p and a broadcast update."""
    script = tmp_path / "readme_example.py"
    script.write_text(readme_api_example())
    proc = _run([sys.executable, str(script)], engine_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modes = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert modes == ["p2p", "broadcast"], proc.stdout


def test_example_script_updates_the_engine_in_both_modes(engine_url: str):
    proc = _run([sys.executable, "examples/api/update_engines.py", "--engine-url", engine_url, "--steps", "2"],
                engine_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2, proc.stdout
    assert lines[0].startswith("step 1: p2p ("), proc.stdout
    assert lines[1].startswith("step 2: broadcast ("), proc.stdout
    assert all(line.endswith("verified=True") for line in lines), proc.stdout
