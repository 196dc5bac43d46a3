"""The per-model wrappers (``examples/infra_features/p2p_weight_transfer/*.sh``) as a user meets them.

Contracts, for every wrapper:

* ``-h`` / ``--help`` prints the wrapper's own usage (its arguments, the environment variables it
  reads, an example), exits 0 at once and does nothing else: no prepare, no checkpoint, no log.
* Bad arguments (mode, node rank, a worker without the head's address) are refused in one line,
  exit 2, before anything is prepared.
* Arguments after the positional ones reach ``run.py run`` unchanged; the Python the wrapper calls
  is ``PY`` (here a recorder, so no run starts).

``run.py`` started by a Python without weightsync's dependencies (the system ``python3``, an
empty environment) runs itself again with the repository's ``.venv``, or, without one, says in one
line what to do (exit 2).

A real run through a wrapper, with an extra argument, is in ``tests/test_e2e_cli.py``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e_helpers import REPO_ROOT
from weightsync.models.profiles import get_profile

EXAMPLES = REPO_ROOT / "examples" / "infra_features" / "p2p_weight_transfer"
WRAPPERS = sorted(p.name for p in EXAMPLES.glob("*.sh") if p.name != "common.sh")
ENV_VARS = ("CKPT_SAVE_DIR", "SKIP_VALIDATION", "BUCKET_SIZE_GB", "MILES_LOG_DIR")
PREFIX = {"GLM-5.sh": ["GLM-5_4layer"]}
"""Arguments a wrapper takes before MODE (GLM-5.sh: the variant)."""


def _model(wrapper: str) -> str:
    return PREFIX.get(wrapper, [wrapper.removesuffix(".sh")])[0]


def _wrapper(wrapper: str, args: list[str], tmp_path: Path, py: str | None = None
             ) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run a wrapper from ``tmp_path`` with the run's variables pointing into it; (result, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SKIP_VALIDATION", "BUCKET_SIZE_GB", "PY")}
    env.update({"CKPT_SAVE_DIR": str(tmp_path / "ckpt"), "MILES_LOG_DIR": str(tmp_path / "logs")})
    if py is not None:
        env["PY"] = py
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", str(EXAMPLES / wrapper), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    return proc, time.perf_counter() - t0


def _recorder(tmp_path: Path) -> tuple[str, Path]:
    """A stand-in for the wrapper's Python: records each call's arguments (one line each, fields
    separated by the unit separator) and succeeds."""
    log = tmp_path / "calls"
    py = tmp_path / "fake-python"
    py.write_text(f"#!/bin/bash\n(IFS=$'\\x1f'; printf '%s\\n' \"$*\") >> '{log}'\n")
    py.chmod(0o755)
    return str(py), log


def _calls(log: Path) -> list[list[str]]:
    return [line.split("\x1f") for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.parametrize("flag", ["-h", "--help"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_help_is_the_wrappers_own_and_does_nothing_else(wrapper: str, flag: str, tmp_path: Path):
    py, log = _recorder(tmp_path)
    for args in ([flag], [*PREFIX.get(wrapper, []), "p2p", flag]):
        proc, seconds = _wrapper(wrapper, args, tmp_path, py=py)
        assert proc.returncode == 0, proc.stderr
        assert seconds < 2, f"{wrapper} {flag} took {seconds:.1f} s"
        out = proc.stdout
        assert f"Usage: bash {wrapper} " in out, out
        assert all(w in out for w in ("MODE", "RUN_ARGS", "Example", *ENV_VARS)), out
        assert "usage: weightsync" not in out + proc.stderr, "not run's usage: the wrapper's own"
    assert _calls(log) == [], "help ran Python"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake-python"], "help wrote something"


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_extra_arguments_reach_run(wrapper: str, tmp_path: Path):
    py, log = _recorder(tmp_path)
    model = _model(wrapper)
    multi = get_profile(model).num_nodes > 1
    extra = ["--num-rollout", "1", "--max-new-tokens", "2"]
    cases = [(["broadcast", *extra], "broadcast")]
    if multi:  # the positional arguments may stop at any point
        cases.append((["p2p", "0", "", *extra], "p2p"))
    cases.append((extra, "p2p"))
    for args, mode in cases:
        log.unlink(missing_ok=True)
        proc, _ = _wrapper(wrapper, [*PREFIX.get(wrapper, []), *args], tmp_path, py=py)
        assert proc.returncode == 0, proc.stderr
        prepare, run = _calls(log)
        assert prepare[1:] == ["prepare", model], prepare
        assert run[1:] == ["run", model, "--mode", mode, "--node-rank", "0", "--head-ip", "", *extra], run


@pytest.mark.parametrize(("wrapper", "args", "named"), [
    pytest.param("Qwen3-4B.sh", ["p3p"], "unknown mode 'p3p'", id="mode"),
    pytest.param("GLM-4.7-Flash.sh", ["p2p", "1"], "NODE_RANK 1 needs HEAD_NODE_IP", id="worker-without-head"),
    pytest.param("Kimi-K2.sh", ["p2p", "64", "10.0.0.1"], "Kimi-K2's profile runs on 64 nodes, ranks 0 .. 63",
                 id="rank-beyond-the-nodes"),
    pytest.param("Qwen3-30B-A3B.sh", ["p2p", "one", "10.0.0.1"], "NODE_RANK 'one' is not a node rank",
                 id="rank-not-a-number"),
    pytest.param("GLM-5.sh", ["GLM-5_20layer", "broadcast", "12", "10.0.0.1"], "runs on 12 nodes",
                 id="glm5-variant-nodes"),
    pytest.param("GLM-5.sh", ["GLM-5_3layer", "p2p"], "unknown variant 'GLM-5_3layer'", id="glm5-variant"),
    pytest.param("GLM-5.sh", [], "Usage: bash GLM-5.sh <VARIANT>", id="glm5-no-variant"),
])
def test_bad_arguments_are_refused_before_anything_is_prepared(wrapper: str, args: list[str], named: str,
                                                               tmp_path: Path):
    proc, seconds = _wrapper(wrapper, args, tmp_path)  # the real Python: nothing may reach it
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert seconds < 2, f"{seconds:.1f} s: something ran before the check"
    assert list(tmp_path.iterdir()) == [], "a refused call wrote something"


@pytest.mark.parametrize("wrapper", [w for w in WRAPPERS if w not in PREFIX])
def test_the_node_count_a_wrapper_checks_is_its_profiles(wrapper: str):
    text = (EXAMPLES / wrapper).read_text()
    model = _model(wrapper)
    assert f"wrapper_main \"${{BASH_SOURCE[0]}}\" {model} {get_profile(model).num_nodes} \"$@\"" in text


@pytest.mark.parametrize("variant", ["GLM-5_4layer", "GLM-5_20layer", "GLM-5"])
def test_glm5_node_counts_are_the_profiles(variant: str):
    assert f"    {variant}) NODES={get_profile(variant).num_nodes} ;;" in (EXAMPLES / "GLM-5.sh").read_text()


# -- run.py with a Python that lacks the dependencies ---------------------------------------------


def _bare_python() -> str:
    """The system Python without weightsync's dependencies (what ``python3`` is outside the venv)."""
    for candidate in ("/usr/bin/python3", "/bin/python3"):
        if not Path(candidate).is_file():
            continue
        has = subprocess.run(["/usr/bin/env", "-i", candidate, "-c", "import httpx"], capture_output=True, check=False)
        if has.returncode != 0:
            return candidate
    pytest.skip("no system Python without httpx here")


def test_run_py_with_a_bare_python_runs_in_the_repos_venv():
    if not (REPO_ROOT / ".venv" / "bin" / "python").is_file():
        pytest.skip("no .venv at the repository root (scripts/setup.sh makes it)")
    proc = subprocess.run(["/usr/bin/env", "-i", _bare_python(), str(EXAMPLES / "run.py"), "run", "--help"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "--mode" in proc.stdout
    assert "ModuleNotFoundError" not in proc.stderr


def test_run_py_without_a_venv_says_what_to_do_in_one_line(tmp_path: Path):
    """A checkout without ``.venv`` (setup not run): one line naming what is missing and the set-up
    command, exit 2, no traceback."""
    copy = tmp_path / "repo" / "examples" / "infra_features" / "p2p_weight_transfer" / "run.py"
    copy.parent.mkdir(parents=True)
    copy.write_text((EXAMPLES / "run.py").read_text())
    python = _bare_python()
    proc = subprocess.run(["/usr/bin/env", "-i", python, str(copy), "run", "Qwen3-4B"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"run.py: this Python ({python}) lacks ")
    assert "httpx" in lines[0]
    assert "bash scripts/setup.sh" in lines[0]
    assert ".venv/bin/python examples/infra_features/p2p_weight_transfer/run.py" in lines[0]
