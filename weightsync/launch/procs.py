"""The processes of a run: one engine's ``weightsync serve`` process, an engine this run did not
start, and the command lines that start engines.

Engines are separate programs reached over HTTP, exactly as sglang servers are; trainer ranks
are spawned Python processes driven over pipes (:mod:`weightsync.launch.trainer_worker`). Where
they start is a :mod:`~weightsync.launch.placement`'s decision; it stops what it started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from weightsync.launch.config import TOKEN_ENV
from weightsync.proc import KILL_AFTER_S, descendants, exit_text, log_tail, process_state, stopped_reason
from weightsync.sync.engine_client import EngineClient
from weightsync.transport import TransportConfig
from weightsync.transport.config import receiver_argv
from weightsync.transport.registry import remove_leftovers

log = logging.getLogger(__name__)


class TrainerError(RuntimeError):
    """A trainer rank failed; the message carries its traceback."""


DYING_S = 5.0
"""How long a diagnosis waits for an unhealthy engine that may be ending itself (its exit says why)."""
ENGINE_CAUSES = ("engine rank process", "engine fault:", "driver did not stop", "stopping the engine")
"""Words of the lines in which an engine's log says why it stopped serving (engine/serve.py,
engine/scheduler.py)."""


def engine_log_cause(text: str) -> str:
    """The line of an engine's log that says why it stopped serving, without its timestamp and
    logger ("" when none does): the last line naming a cause, else the last error line."""
    lines = text.splitlines()
    picked = next((ln for ln in reversed(lines) if any(c in ln for c in ENGINE_CAUSES)), "")
    picked = picked or next((ln for ln in reversed(lines) if " ERROR " in ln), "")
    return picked.split(": ", 1)[1].strip() if " ERROR " in picked and ": " in picked else picked.strip()


def health_cause(client: EngineClient, what: str) -> str:
    """Why an engine does not serve, as its ``/health`` says ("" when it answers 200)."""
    status, body = client.health()
    if status == 200:
        return ""
    if status is None:
        return f"{what} does not answer /health ({body.get('error', 'no answer')})"
    return f"{what} is unhealthy (HTTP {status}): {body.get('reason') or body}"


class EngineProc:
    """One engine: its ``weightsync serve`` process and its HTTP client."""

    def __init__(self, index: int, argv: Sequence[str], url: str, log_path: Path, env: dict[str, str], *,
                 preexec_fn: Callable[[], None] | None = None, token: str | None = None, timeout_s: float = 600.0,
                 stop_s: float = 15.0, where: str = "") -> None:
        """``token``: the engine's (in its environment as ``WEIGHTSYNC_TOKEN``, never on its
        command line) and sent by its client; None: the environment's, if any. ``timeout_s``: per
        HTTP call of its client; ``stop_s``: how long :meth:`stop` waits before it kills;
        ``where``: added to its URL in what :meth:`diagnose` says (``node 1``)."""
        self.index = index
        self.url = url
        self.where = where
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 -- closed in stop()
        if token is not None:
            env = {**env, TOKEN_ENV: token}
        self.proc = subprocess.Popen(list(argv), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=preexec_fn)
        self.client = EngineClient(url, token=token, timeout_s=timeout_s)
        self.stop_s = stop_s
        self._stopping = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        return log_tail(self.log_path, n)

    def pids(self) -> list[int]:
        """Its processes: ``weightsync serve`` (rank 0) and the rank processes below it."""
        return [self.proc.pid, *descendants(self.proc.pid)] if self.alive() else []

    def diagnose(self) -> str:
        """Why this engine cannot serve, in one line ("" when nothing is wrong that can be seen): its
        exit and the cause its log names, a rank process stopped (SIGSTOP), or its ``/health``."""
        what = f"engine {self.index} ({self.url}{', ' + self.where if self.where else ''})"
        for pid in self.pids():
            stopped = stopped_reason(pid)
            if stopped:
                return f"{what}: {'its rank 0' if pid == self.proc.pid else 'a rank'} cannot answer: {stopped}"
        unhealthy = health_cause(self.client, what) if self.alive() else ""
        t0 = time.monotonic()
        # an engine ending itself (a rank died: its watchdog stops it within a second) says why as it exits
        while self.alive() and time.monotonic() - t0 < (DYING_S if unhealthy else 1.0):
            time.sleep(0.1)
        code = self.proc.poll()
        if code is not None:
            cause = engine_log_cause(self.tail(200))
            return f"{what} exited ({exit_text(code)})" + (f": {cause}" if cause else "")
        return unhealthy

    def request_stop(self) -> None:
        """Ask the engine to shut down (SIGTERM) without waiting; :meth:`stop` waits."""
        if self.alive() and not self._stopping:
            self.proc.terminate()
            self._stopping = True

    def stop(self) -> None:
        self.client.close()
        pids = self.pids()
        if self.alive():
            self.request_stop()
            try:
                self.proc.wait(timeout=self.stop_s)
            except subprocess.TimeoutExpired:
                log.warning("engine %d (pid %d) did not stop within %.0f s; killing its process group", self.index,
                            self.proc.pid, self.stop_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=KILL_AFTER_S)
                # what killed ranks could not remove (their shm segments): theirs, by pid
                left = remove_leftovers({p for p in pids if not process_state(p) or process_state(p) == "Z"})
                if left:
                    log.info("removed %d transport leftover(s) of engine %d: %s", len(left), self.index,
                             ", ".join(left))
        self._log.close()


class AttachedEngine:
    """An engine this run did not start (``--engine-urls``): reached over HTTP, never stopped."""

    def __init__(self, index: int, url: str, token: str | None = None, *, timeout_s: float = 600.0) -> None:
        self.index = index
        self.url = url
        self.client = EngineClient(url, token=token, timeout_s=timeout_s)

    def alive(self) -> bool:
        return True

    def tail(self, n: int = 30) -> str:
        return ""

    def request_stop(self) -> None:
        pass

    def diagnose(self) -> str:
        return health_cause(self.client, f"engine {self.index} ({self.url})")

    def stop(self) -> None:
        self.client.close()


def serve_argv(*, model: str, scale: str, tp: int, ep: int, dp: int, device: str, port: int, checkpoint: Path | None,
               transport: TransportConfig | None, host: str = "127.0.0.1", moe_dense_tp: int | None = None,
               dp_lm_head: bool = False, options: Sequence[str] = (), extra: Sequence[str] = ()) -> list[str]:
    """The command line of one engine (``python -m weightsync.cli serve ...``); ``transport`` travels
    whole, as one JSON argument (the engine binds its own GPUs and address)."""
    argv = [sys.executable, "-m", "weightsync.cli", "serve", model, "--scale", scale, "--tp", str(tp), "--ep", str(ep),
            "--dp", str(dp), "--device", device, "--host", host, "--port", str(port), *receiver_argv(transport)]
    argv += ["--moe-dense-tp-size", str(moe_dense_tp)] if moe_dense_tp is not None else []
    argv += ["--enable-dp-lm-head"] if dp_lm_head else []
    argv += list(options)  # the layout options' flags (weightsync.engine.config.option_flags)
    argv += ["--checkpoint", str(checkpoint)] if checkpoint is not None else ["--load-format", "dummy"]
    return argv + list(extra)

