"""Local processes of a run: rollout engines (``weightsync serve`` subprocesses) and trainer ranks.

Engines are separate programs reached over HTTP, exactly as sglang servers are; trainer ranks
are spawned Python processes driven over pipes (:mod:`weightsync.launch.trainer_worker`).
Everything started here is stopped in :meth:`LocalProcs.close`, also on errors.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weightsync.launch.trainer_worker import Cmd, WorkerConfig, worker_main
from weightsync.sync.engine_client import EngineClient, EngineError
from weightsync.transport import TransportConfig, TransportKind

log = logging.getLogger(__name__)


class TrainerError(RuntimeError):
    """A trainer rank failed; the message carries its traceback."""


class EngineProc:
    """One engine: its ``weightsync serve`` process and its HTTP client."""

    def __init__(self, index: int, argv: Sequence[str], url: str, log_path: Path, env: dict[str, str]) -> None:
        self.index = index
        self.url = url
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(list(argv), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.client = EngineClient(url)
        self._stopping = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def request_stop(self) -> None:
        """Ask the engine to shut down (SIGTERM) without waiting; :meth:`stop` waits."""
        if self.alive() and not self._stopping:
            self.proc.terminate()
            self._stopping = True

    def stop(self) -> None:
        self.client.close()
        if self.alive():
            self.request_stop()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()


class AttachedEngine:
    """An engine this run did not start (``--engine-urls``): reached over HTTP, never stopped."""

    def __init__(self, index: int, url: str) -> None:
        self.index = index
        self.url = url
        self.client = EngineClient(url)

    def alive(self) -> bool:
        return True

    def tail(self, n: int = 30) -> str:
        return ""

    def request_stop(self) -> None:
        pass

    def stop(self) -> None:
        self.client.close()


class LocalProcs:
    """Starts, drives and stops the engines and trainer ranks of a run on this machine."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.engines: list[EngineProc | AttachedEngine] = []
        self._workers: list[Any] = []
        self._conns: list[Any] = []
        self._pool = ThreadPoolExecutor(max_workers=16)

    # -- engines --------------------------------------------------------------------------------
    def start_engines(self, argvs: Sequence[Sequence[str]], urls: Sequence[str], *, timeout_s: float) -> None:
        """Start one ``serve`` process per engine and wait until every one is healthy.

        Raises:
            EngineError: an engine exited or did not become healthy; its log tail is in the message.
        """
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        for i, (argv, url) in enumerate(zip(argvs, urls, strict=True)):
            self.engines.append(EngineProc(i, argv, url, self.log_dir / f"engine{i}.log", env))
        for e in self.engines:
            try:
                e.client.wait_healthy(timeout_s=timeout_s, proc_alive=e.alive)
            except EngineError as exc:
                raise EngineError(f"{exc}\n--- engine {e.index} log ({e.log_path}) ---\n{e.tail()}") from None

    def attach_engines(self, urls: Sequence[str]) -> None:
        """Use engines that are already serving (they are left running on close)."""
        self.engines.extend(AttachedEngine(len(self.engines) + i, u) for i, u in enumerate(urls))

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` in the launcher's thread pool (a future)."""
        return self._pool.submit(fn, *args, **kwargs)

    def on_engines(self, fn: Any) -> list[Any]:
        """Call ``fn(client)`` on every engine concurrently; results in engine order."""
        return list(self._pool.map(lambda e: fn(e.client), self.engines))

    # -- trainer ranks --------------------------------------------------------------------------
    def spawn_trainers(self, cfg: WorkerConfig) -> None:
        """Spawn every trainer rank (they load their shards in the background)."""
        ctx = mp.get_context("spawn")
        for rank in range(cfg.train.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(rank, cfg, child), name=f"trainer-rank{rank}", daemon=True)
            p.start()
            child.close()
            self._workers.append(p)
            self._conns.append(parent)

    def wait_trainers(self, *, timeout_s: float) -> list[Any]:
        """Wait until every spawned trainer rank has loaded its shards."""
        return self._collect(timeout_s, "start-up")

    def _collect(self, timeout_s: float, what: str) -> list[Any]:
        end = time.monotonic() + timeout_s
        out: list[Any] = [None] * len(self._conns)
        errors: list[str] = []
        for rank, conn in enumerate(self._conns):
            while not conn.poll(0.1):
                if not self._workers[rank].is_alive():
                    code = self._workers[rank].exitcode
                    raise TrainerError(f"trainer rank {rank} died during {what} (exit code {code})")
                if time.monotonic() > end:
                    raise TrainerError(f"trainer rank {rank}: no answer to {what} within {timeout_s:.0f} s")
            status, payload = conn.recv()
            if status == "error":
                errors.append(payload)
            out[rank] = payload
        if errors:
            raise TrainerError("\n".join(errors))
        return out

    def command(self, cmd: Cmd, arg: Any = None, *, timeout_s: float = 600.0) -> list[Any]:
        """Send ``cmd`` to every trainer rank; the answers in rank order.

        Raises:
            TrainerError: any rank failed (every failing rank's traceback is in the message).
        """
        for conn in self._conns:
            conn.send((cmd, arg))
        return self._collect(timeout_s, str(cmd))

    def command_async(self, cmd: Cmd, arg: Any = None, *, timeout_s: float = 600.0) -> Any:
        """:meth:`command` in a background thread (a future), to overlap with engine calls."""
        return self._pool.submit(self.command, cmd, arg, timeout_s=timeout_s)

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the trainer ranks and the engines this run started, all at once (each takes a few
        seconds to leave its process groups and exit; in turn they took the sum)."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):  # a rank that already exited
                conn.send((Cmd.STOP, None))
        for e in self.engines:
            e.request_stop()
        for p in self._workers:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for e in self.engines:
            e.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)


def serve_argv(*, model: str, scale: str, tp: int, ep: int, dp: int, device: str, port: int, checkpoint: Path | None,
               transport: TransportConfig | None, host: str = "127.0.0.1", moe_dense_tp: int | None = None,
               dp_lm_head: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """The command line of one engine (``python -m weightsync.cli serve ...``)."""
    argv = [sys.executable, "-m", "weightsync.cli", "serve", model, "--scale", scale, "--tp", str(tp), "--ep", str(ep),
            "--dp", str(dp), "--device", device, "--host", host, "--port", str(port), *transport_argv(transport)]
    argv += ["--moe-dense-tp-size", str(moe_dense_tp)] if moe_dense_tp is not None else []
    argv += ["--enable-dp-lm-head"] if dp_lm_head else []
    argv += ["--checkpoint", str(checkpoint)] if checkpoint is not None else ["--load-format", "dummy"]
    return argv + list(extra)


def transport_argv(transport: TransportConfig | None) -> list[str]:
    """The engine options that carry ``transport`` (the engine rebuilds it from them,
    :func:`weightsync.engine.bootstrap.transport_config`); None: ``--transport none``.

    Only the kind and the Mooncake protocol and device travel: the engine binds its own GPUs
    and publishes its own address, and its side of shm copies nothing.
    """
    if transport is None:
        return ["--transport", "none"]
    argv = ["--transport", transport.kind.value]
    if transport.kind is TransportKind.MOONCAKE:
        argv += ["--mooncake-protocol", transport.mooncake_protocol]
        argv += ["--mooncake-device", transport.mooncake_device] if transport.mooncake_device else []
    return argv
