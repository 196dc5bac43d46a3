"""Shared pieces of the end-to-end tests (tests/test_e2e_*.py): run ``weightsync run`` and read
what it leaves behind.

Two ways in, both public entry points:

* :func:`run_in_process` -- ``resolve()`` + ``ensure_prepared()`` + ``RunSession.run()`` in the
  pytest process, exactly as ``weightsync run``'s ``main`` chains them, with the environment
  given as a mapping to :func:`env_settings`. The engines and trainer ranks are still separate
  processes; only the launcher's own start-up (a torch import, the prepare check) is saved.
* :func:`run_cli` -- the command in a subprocess, for what only the command line shows: exit
  codes, messages, the environment variables as the shell sets them, the wrappers.

Every run uses one shared checkpoint directory (a session fixture), so each model is prepared
once per test session.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOutcome:
    """What one ``run`` left: exit status, output, and ``results.json`` when it was written."""

    returncode: int
    output: str
    log_dir: Path
    results: dict[str, Any] | None

    @property
    def steps(self) -> list[dict[str, Any]]:
        assert self.results is not None, f"no results.json in {self.log_dir}; output:\n{self.output[-3000:]}"
        return list(self.results["steps"])

    @property
    def meta(self) -> dict[str, Any]:
        assert self.results is not None, f"no results.json in {self.log_dir}; output:\n{self.output[-3000:]}"
        return dict(self.results["meta"])

    def describe(self) -> str:
        return f"exit {self.returncode}, logs {self.log_dir}; output tail:\n{self.output[-4000:]}"


def _read_results(log_dir: Path) -> dict[str, Any] | None:
    path = log_dir / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


def run_env(ckpt_dir: Path, log_dir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process environment of a run: this one, minus the run's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SKIP_VALIDATION", "BUCKET_SIZE_GB", "MOONCAKE_PROTOCOL", "MOONCAKE_DEVICE")}
    env.update({"CKPT_SAVE_DIR": str(ckpt_dir), "MILES_LOG_DIR": str(log_dir), "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def run_in_process(argv: Sequence[str], *, ckpt_dir: Path, log_dir: Path,
                   env: Mapping[str, str] | None = None) -> RunOutcome:
    """``weightsync run ARGV`` through ``resolve`` and ``RunSession`` in this process.

    Args:
        argv: the arguments after ``run`` (model first).
        ckpt_dir: ``CKPT_SAVE_DIR``.
        log_dir: ``MILES_LOG_DIR``.
        env: further variables (``BUCKET_SIZE_GB``, ``SKIP_VALIDATION``, ...).
    """
    import contextlib
    import io

    from weightsync.cli import build_parser
    from weightsync.cli.run import resolve
    from weightsync.launch.config import env_settings
    from weightsync.launch.session import RunSession
    from weightsync.sources.prepare import ensure_prepared

    args = build_parser().parse_args(["run", *argv])
    settings = env_settings({"CKPT_SAVE_DIR": str(ckpt_dir), "MILES_LOG_DIR": str(log_dir), **(env or {})})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cfg = resolve(args, settings)
        assert cfg is not None
        hf_dir, torch_dist_dir = ensure_prepared(cfg.model, scale=cfg.scale, ckpt_dir=settings.ckpt_dir,
                                                 train=cfg.train, progress=False, hf_checkpoint=cfg.hf_checkpoint,
                                                 dtype=cfg.dtype, synthetic=cfg.synthetic)
        summary = RunSession(cfg, hf_dir=hf_dir, torch_dist_dir=torch_dist_dir).run()
    return RunOutcome(returncode=0 if summary["validation_passed"] else 1, output=out.getvalue(), log_dir=log_dir,
                      results=_read_results(log_dir))


def run_cli(argv: Sequence[str], *, ckpt_dir: Path, log_dir: Path, env: Mapping[str, str] | None = None,
            timeout_s: float = 400) -> RunOutcome:
    """``python -m weightsync.cli ARGV`` in a subprocess (``argv`` includes the sub-command)."""
    return run_command([PYTHON, "-m", "weightsync.cli", *argv], ckpt_dir=ckpt_dir, log_dir=log_dir, env=env,
                       timeout_s=timeout_s)


def run_command(cmd: Sequence[str], *, ckpt_dir: Path, log_dir: Path, env: Mapping[str, str] | None = None,
                timeout_s: float = 400) -> RunOutcome:
    """Any command (a wrapper script, ``run.py``) with the run's environment, from the repo root."""
    proc = subprocess.run(list(cmd), cwd=REPO_ROOT, env=run_env(ckpt_dir, log_dir, env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout_s, check=False)
    return RunOutcome(returncode=proc.returncode, output=proc.stdout, log_dir=log_dir, results=_read_results(log_dir))


@contextmanager
def serve_engine(argv: Sequence[str], log: Path, port: int | None = None) -> Iterator[str]:
    """``weightsync serve ARGV`` (without ``--port``) on ``port`` (default: a free one) until the
    block ends, its output appended to ``log``; yields its URL once it is healthy."""
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
    with serve_process([PYTHON, "-m", "weightsync.cli", "serve", *argv, "--port", str(port)], log, port) as url:
        yield url


@contextmanager
def serve_process(cmd: Sequence[str], log: Path, port: int, *, timeout_s: float = 180) -> Iterator[str]:
    """A server process ``cmd`` (run from the repo root) listening on ``port`` until the block
    ends, its output appended to ``log``; yields its URL once ``/health`` answers; stopped by its id."""
    from weightsync.sync.engine_client import EngineClient

    with open(log, "a") as out:
        proc = subprocess.Popen(list(cmd), cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        client = EngineClient(url)
        try:
            client.wait_healthy(timeout_s=timeout_s, proc_alive=lambda: proc.poll() is None)
            yield url
        finally:
            client.close()
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- what a passing run must show ---------------------------------------------------------------


def assert_run_passed(run: RunOutcome, *, modes: Sequence[str], equal_check: str = "pass") -> None:
    """Exit 0; ``results.json`` with one step per entry of ``modes`` (step 0 first); on step 0 the
    check-weight-update-equal verdict ``equal_check``; checksums and logprob parity pass on every
    step; the summary says validation passed."""
    assert run.returncode == 0, run.describe()
    steps = run.steps
    assert [s["mode"] for s in steps] == list(modes), run.describe()
    assert steps[0]["validation"].get("check_weight_update_equal") == equal_check, steps[0]["validation"]
    for s in steps:
        v = s["validation"]
        assert v["checksums"] == "pass", f"step {s['step']} ({s['mode']}): {v}"
        assert v["logprob_parity"] == "pass", f"step {s['step']} ({s['mode']}): {v}"
    assert run.results is not None
    assert run.results["summary"]["validation_passed"], run.results["summary"]
    assert (run.log_dir / "update_phases.png").exists()


def model_bytes(model: str, scale: str = "tiny") -> int:
    """Bytes of the whole model as an engine stores it: what a one-rank engine holds of the
    global tensors (fp8 weights at one byte per element plus their scales, tensors the engine
    keeps in float32 at four), without vocab padding and derived tensors."""
    from weightsync.layout.box import box_volume
    from weightsync.layout.sglang import engine_layout
    from weightsync.models import get_model
    from weightsync.models.hf import DTYPE_BYTES
    from weightsync.models.parallel import RolloutParallel

    tensors = engine_layout(get_model(model, scale), RolloutParallel(), 0)
    return sum(sum(box_volume(p.local_box) for p in t.pieces) * DTYPE_BYTES[t.dtype]
               for t in tensors if not t.derived)


def assert_bytes_exact(run: RunOutcome, full_model_bytes: int) -> None:
    """p2p steps: every rollout rank received exactly its shard's bytes (no redundant byte);
    broadcast steps: every rollout rank received the full model."""
    meta = run.meta
    shard = {int(k): v for k, v in meta["dest_bytes_per_receiver"].items()}
    num_ranks = len(shard)
    assert all(v > 0 for v in shard.values()), shard
    for s in run.steps:
        got = {int(k): v for k, v in s["bytes_per_receiver"].items()}
        if s["mode"] == "p2p":
            assert got == shard, f"step {s['step']} p2p: received {got}, shards are {shard}"
            assert s["bytes"] == sum(shard.values())
        else:
            assert got == dict.fromkeys(range(num_ranks), full_model_bytes), \
                f"step {s['step']} broadcast: received {got}, full model {full_model_bytes}"
            assert s["bytes"] == full_model_bytes * num_ranks


@pytest.fixture(scope="session", name="e2e_ckpt")
def e2e_ckpt_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``CKPT_SAVE_DIR`` shared by every end-to-end test of the session: each model is prepared
    by the first run that needs it and found complete by the others. (A fixed folder under the
    session's base temp, so that test modules importing this fixture share it.)"""
    path = tmp_path_factory.getbasetemp() / "e2e_ckpt"
    path.mkdir(exist_ok=True)
    return path
