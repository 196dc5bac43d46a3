"""Fault injection into whole runs (``weightsync run``, tiny Qwen3-4B on CPU, shm): the must-show of
writes dropped at step k -- a client records the weight version of every answer an engine gives
while the run goes on, and none is served from step k's unverified weights --, a trainer rank
killed mid-update (its own death is what the run reports, at once), and the launcher killed
(every process it started ends, no shm segment is left), a trainer rank stopped by SIGSTOP (the
run names it and ends, every wait bounded), and an engine rank killed or stopped (the run's message
is the cause in a line; no process or shm segment of the engine is left).

The first two attach one engine (``--engine-urls``) that lives through the module: each failed
run leaves it serving the old version (its updates are pause-free: what failed only ever reached
the shadow copy), and the next run's first update goes on from there. Faults are
``tests/fault_hooks.py``'s, reached through ``WEIGHTSYNC_FAULT_HOOK`` (tests only).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.e2e_helpers import (  # noqa: F401 -- the e2e_ckpt fixture
    PYTHON,
    REPO_ROOT,
    e2e_ckpt_fixture,
    run_cli,
    run_env,
)
from tests.test_e2e_cli import qwen_engine
from tests.test_faults_update import _state
from weightsync.sync.engine_client import EngineClient, EngineError

RUN = ["run", "Qwen3-4B", "--train", "tp=1,cp=1,world=1", "--rollout", "tp=1", "--mode", "p2p"]
PROBE = {"text": "The weights of version", "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
         "return_logprob": True, "logprob_start_len": 0}
"""A greedy request whose prompt logprobs are a fingerprint of the weights that computed them."""


engine = qwen_engine  # the fixture: Qwen3-4B tiny, TP 1, shm, from the shared prepared checkpoint


class Recorder:
    """Asks the engine one greedy question after another, recording every answer's weight
    version and prompt logprobs (answers cut short by a pause are left out: they have none)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[str, list[float]]] = []
        self.refused: list[int | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _loop(self) -> None:
        c = EngineClient(self.url, timeout_s=5.0)
        while not self._stop.is_set():
            try:
                out = c.generate(PROBE)
            except EngineError as exc:
                self.refused.append(exc.status)
                time.sleep(0.05)
                continue
            if (out["meta_info"].get("finish_reason") or {}).get("type") == "abort":
                continue
            self.answers.append((str(out["meta_info"]["weight_version"]),
                                 [r[0] for r in out["meta_info"]["input_token_logprobs"] if r[0] is not None]))
        c.close()

    def by_version(self) -> dict[str, list[list[float]]]:
        out: dict[str, list[list[float]]] = {}
        for v, fp in self.answers:
            out.setdefault(v, []).append(fp)
        return out


def _spread(fps: list[list[float]]) -> float:
    return max(abs(a - b) for fp in fps for a, b in zip(fp, fps[0], strict=True))


@pytest.mark.timeout(400)
def test_trainer_rank_killed_mid_update(engine: str, e2e_ckpt: Path, tmp_path: Path):
    """Trainer rank 1 SIGKILLed as update 1 writes: the run ends within seconds naming that rank's
    death (not a timeout of rank 0 waiting for it); the engine is left serving version 0."""
    t0 = time.monotonic()
    run = run_cli(["run", "Qwen3-4B", "--train", "tp=2,cp=1,world=2", "--rollout", "tp=1", "--mode", "p2p",
                   "--num-rollout", "2", "--engine-urls", engine],
                  ckpt_dir=e2e_ckpt, log_dir=tmp_path, env={"WEIGHTSYNC_FAULT_HOOK": "tests.fault_hooks:kill_rank:1:1"})
    took = time.monotonic() - t0
    assert run.returncode == 1, run.describe()
    assert "trainer rank 1 died during update" in run.output, run.describe()
    assert "step 0:" in run.output, run.describe()
    assert "step 1:" not in run.output, run.describe()
    assert took < 120, f"{took:.0f} s"
    s = _state(engine)
    assert (s["state"], s["weight_version"], s["session_id"]) == ("serving", "0", None), s


@pytest.mark.timeout(600)
def test_writes_dropped_at_step_k_are_never_served(engine: str, e2e_ckpt: Path, tmp_path: Path):
    """The must-show: writes silently dropped at step 2.

    Without retries the run stops at step 2's verification, naming the tensors; no answer ever
    carries version 2; the engine goes on serving version 1, untouched. With
    ``--update-retries 1`` the next run (which recovers the engine by its first update) retries
    step 2 from scratch, verifies it, and only then publishes: every answer labelled 2 was
    computed with step 2's verified weights -- its logprobs are those of every other answer
    labelled 2, and not those of version 1.
    """
    hook = {"WEIGHTSYNC_FAULT_HOOK": "tests.fault_hooks:drop_writes:2"}
    with Recorder(engine) as rec:
        run = run_cli([*RUN, "--num-rollout", "3", "--engine-urls", engine], ckpt_dir=e2e_ckpt,
                      log_dir=tmp_path / "stop", env=hook)
        time.sleep(1.0)
    assert run.returncode == 1, run.describe()
    assert "update to version 2 failed" in run.output, run.describe()
    assert "fingerprints differ: engine 0" in run.output, run.describe()
    assert "step 1:" in run.output, run.describe()
    assert "step 2:" not in run.output, run.describe()
    versions = [v for v, _ in rec.answers]
    assert "1" in versions, versions
    assert "2" not in versions, "an answer was served from step 2's unverified weights"
    s = _state(engine)
    assert (s["state"], s["weight_version"], s["weights_dirty"]) == ("serving", "1", False), s

    # the next run recovers the engine the failed run left paused and dirty at version 1, under live
    # traffic: its step-0 check loads this run's checkpoint first and pauses before it resets
    with Recorder(engine) as rec:
        run = run_cli([*RUN, "--num-rollout", "3", "--update-retries", "1", "--engine-urls", engine],
                      ckpt_dir=e2e_ckpt, log_dir=tmp_path / "retry", env=hook)
        time.sleep(1.0)
    assert run.returncode == 0, run.describe()
    assert run.steps[0]["validation"]["check_weight_update_equal"] == "pass", run.steps[0]
    step2 = run.steps[2]
    assert step2["attempts"] == 2, step2
    assert "fingerprints differ" in step2["failed_attempts"][0], step2
    assert all(v in ("pass", "skipped") for s in run.steps for v in s["validation"].values()), run.steps
    assert all(s["validation"]["checksums"] == "pass" for s in run.steps), run.steps
    seen = rec.by_version()
    assert {"1", "2", "3"} <= set(seen), sorted(seen)
    for v, fps in seen.items():
        assert _spread(fps) < 1e-4, f"answers labelled {v} came from different weights"
    assert max(abs(a - b) for a, b in zip(seen["2"][0], seen["1"][0], strict=True)) > 1e-4, \
        "version 2's answers have version 1's logprobs"
    s = _state(engine)
    assert (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, "3"), s


@pytest.mark.timeout(400)
def test_a_stopped_trainer_rank_ends_the_run_and_every_process(engine: str, e2e_ckpt: Path, tmp_path: Path):
    """Trainer rank 1 SIGSTOPped as update 1 writes (a hang, not a death; SIGTERM stays pending on
    it): the launcher names that rank's stopped process within the failure grace, stops every
    process it started (SIGKILL for the stopped one) and exits 1, within the grace plus the stop
    deadline and its kill step -- no join waits on the stopped rank. The engine keeps its old
    version."""
    out_path = tmp_path / "out.txt"
    argv = [*RUN[:2], "--train", "tp=2,cp=1,world=2", "--rollout", "tp=1", "--mode", "p2p", "--num-rollout", "2",
            "--engine-urls", engine, "--deadlines", "stop=5"]
    with open(out_path, "w") as out:
        proc = subprocess.Popen([PYTHON, "-m", "weightsync.cli", *argv], cwd=REPO_ROOT, stdout=out,
                                stderr=subprocess.STDOUT,
                                env=run_env(e2e_ckpt, tmp_path / "logs",
                                            {"WEIGHTSYNC_FAULT_HOOK": "tests.fault_hooks:stop_rank:1:1"}))
    children: list[int] = []
    try:
        end = time.monotonic() + 300
        while "step 0:" not in out_path.read_text() and proc.poll() is None and time.monotonic() < end:
            children = _descendants(proc.pid) or children
            time.sleep(0.2)
        assert "step 0:" in out_path.read_text(), out_path.read_text()[-3000:]
        children = _descendants(proc.pid)
        assert len(children) >= 2, children  # the two trainer ranks
        t0 = time.monotonic()
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t0
        output = out_path.read_text()
        assert rc == 1, output[-3000:]
        assert "trainer rank 1 cannot answer update" in output, output[-3000:]
        assert "is stopped (SIGSTOP)" in output, output[-3000:]
        assert took < 2 + 5 + 2 * 5 + 30, f"{took:.0f} s"  # grace + stop + SIGTERM/SIGKILL steps + the exit
        end = time.monotonic() + 10  # (multiprocessing's resource tracker leaves once its pipe closes)
        while any(_alive(p) for p in children) and time.monotonic() < end:
            time.sleep(0.2)
        assert not [p for p in children if _alive(p)], "a trainer rank outlived the launcher"
        s = _state(engine)
        assert s["weight_version"] == "0", s
    finally:
        _kill_all(proc, children)


def _kill_all(proc: subprocess.Popen, pids: list[int]) -> None:
    """What a failed test leaves: the run and the processes it started."""
    if proc.poll() is None:
        proc.kill()
    for p in pids:
        if _alive(p):
            os.kill(p, signal.SIGKILL)


ENGINE_FAULTS = [
    pytest.param(signal.SIGKILL, 1, "engine rank process engine-rank1 exited (code -9)", id="rank1-SIGKILL"),
    pytest.param(signal.SIGKILL, 0, "exited (killed by SIGKILL)", id="rank0-SIGKILL"),
    pytest.param(signal.SIGSTOP, 0, "its rank 0 cannot answer: its process", id="rank0-SIGSTOP"),
    pytest.param(signal.SIGSTOP, 1, "is stopped (SIGSTOP)", id="rank1-SIGSTOP"),
]
"""(signal, engine rank, what the run's first line says): a stopped rank 1 is named by the launcher
("a rank cannot answer: its process (pid N) is stopped") or, once a collective would have timed
out, by the engine's own watchdog ("engine rank process engine-rank1 is stopped (SIGSTOP) ...")."""


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("sig", "rank", "cause"), ENGINE_FAULTS)
def test_an_engine_rank_killed_or_stopped_is_named_and_leaks_nothing(sig: signal.Signals, rank: int, cause: str,
                                                                      e2e_ckpt: Path, tmp_path: Path):
    """An engine rank (TP 2, shm) killed or stopped mid-run: the run's message is the cause in a
    line (which rank, how it ended or that it is stopped), then one line of what the run was doing,
    no traceback (the whole error is in error.log); no process and no shm segment of the engine
    is left -- rank 0 killed, rank 1 removes both ranks' segments; a stopped rank 1 ends the
    engine once a collective would have timed out; a stopped rank 0 is killed by the launcher,
    which removes what it leaves."""
    from weightsync.transport.shm import list_segments, segment_owner

    out_path = tmp_path / "out.txt"
    argv = [*RUN[:2], "--train", "tp=1,cp=1,world=1", "--rollout", "tp=2,engines=1", "--mode", "p2p",
            "--num-rollout", "40", "--deadlines", "engine_call=10,generate=10,collective=10,stop=5"]
    with open(out_path, "w") as out:
        proc = subprocess.Popen([PYTHON, "-m", "weightsync.cli", *argv], cwd=REPO_ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=run_env(e2e_ckpt, tmp_path / "logs"))
    engine: list[int] = []
    try:
        end = time.monotonic() + 300
        while "step 1:" not in out_path.read_text() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert "step 1:" in out_path.read_text(), out_path.read_text()[-3000:]
        serve = next(p for p in _descendants(proc.pid) if b"weightsync.cli\x00serve" in _cmdline(p))
        engine = [serve, *_descendants(serve)]
        ranks = [serve, next(p for p in _descendants(serve) if b"spawn_main" in _cmdline(p))]
        os.kill(ranks[rank], sig)
        rc = proc.wait(timeout=240)
        output = out_path.read_text()
    finally:
        _kill_all(proc, engine)
    message = output[output.index("weightsync run:"):].strip().splitlines()
    assert rc == 1, output[-3000:]
    assert message[0].startswith("weightsync run: engine 0 (http://127.0.0.1:"), message
    assert cause in message[0], message
    assert len(message) <= 3, message
    assert message[-1].startswith("(the whole error, tracebacks included:"), message
    assert "Traceback" not in output
    assert not [p for p in engine if _alive(p)], "an engine process outlived the run"
    assert not [g for g in list_segments() if (segment_owner(g) or (None,))[0] in engine], "shm segments leaked"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                kids = [int(x) for x in (t / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_launcher_killed_ends_every_process(sig: signal.Signals, e2e_ckpt: Path, tmp_path: Path):
    """SIGKILL (or SIGTERM) of ``weightsync run`` mid-run: its engine (and the engine's ranks) and
    its trainer ranks end within seconds, and none of their shm segments is left; SIGTERM stops
    them itself and exits 130."""
    from weightsync.transport.shm import segment_owner

    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:
        proc = subprocess.Popen([PYTHON, "-m", "weightsync.cli", *RUN, "--num-rollout", "50"], cwd=REPO_ROOT,
                                env=run_env(e2e_ckpt, tmp_path / "logs"), stdout=out, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 300
        while "step 1:" not in out_path.read_text() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.2)
        assert "step 1:" in out_path.read_text(), out_path.read_text()[-3000:]
        children = _descendants(proc.pid)
        assert len(children) >= 3, children  # an engine with its rank, a trainer rank
        os.kill(proc.pid, sig)
        rc = proc.wait(timeout=60)
        assert rc == (-9 if sig == signal.SIGKILL else 130), (rc, out_path.read_text()[-2000:])
        end = time.monotonic() + 30
        while any(_alive(p) for p in children) and time.monotonic() < end:
            time.sleep(0.2)
        assert not [p for p in children if _alive(p)], "processes outlived the killed launcher"
        owners = {proc.pid, *children}
        left = [p.name for p in Path("/dev/shm").glob("weightsync-*")
                if (segment_owner(p.name) or (None,))[0] in owners]
        assert not left, left
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _descendants(proc.pid):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
