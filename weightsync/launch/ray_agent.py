"""What runs inside the Ray cluster of a multi-node run for each placement-group bundle: an agent
that starts a rank's process on its node.

The agent is a plain class; :mod:`~weightsync.launch.placement_ray` turns it into a Ray actor
(``ray.remote(NodeAgent)``) where it is used, so importing this module needs no Ray.

An agent starts exactly one process of the run on its node, as the single-node placement does on
its host: an engine (``weightsync serve`` with this node's Python, its output in
``<log dir>/engine<i>.log`` on this node) or a trainer rank (a spawned process driven over a pipe,
whose commands the agent relays, its output in ``<log dir>/trainer<r>.log``). The process dies with
the agent (``PR_SET_PDEATHSIG``), and the agent stops it when told. An engine that dies ends nothing
else: the agent stays and answers for it (its exit, its log), and starts its replacement when the
launcher asks (``run --replace-dead-engines``), in this node's environment, with a log of its own.
Collectives of these processes (gloo, NCCL) bind the interface of the node's address
(``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless the environment sets them).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightsync.launch.messages import Command, Reply, Started, Stop
from weightsync.proc import die_with_parent, end_child, free_port

if TYPE_CHECKING:
    from weightsync.launch.trainer_worker import WorkerConfig

log = logging.getLogger(__name__)


def _node_env(ip: str) -> dict[str, str]:
    """This node's environment for a rank's process: collectives on the interface of ``ip``."""
    from weightsync.launch.cluster import interface_of

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    iface = interface_of(ip)
    if iface:
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
        env.setdefault("NCCL_SOCKET_IFNAME", iface)
    return env


def _trainer_main(rank: int, cfg: WorkerConfig, conn: Any, log_path: str, env: dict[str, str]) -> None:
    """Entry of a trainer rank spawned by an agent: its output to ``log_path``, then the rank."""
    die_with_parent()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # torch and the trainer: imported in the rank's process only (an engine's agent never needs them)
    from weightsync.launch.trainer_worker import worker_main

    worker_main(rank, cfg, conn)


class NodeAgent:
    """Starts and stops one rank's process on the node of its bundle (module docstring)."""

    def __init__(self, log_dir: str) -> None:
        import ray

        self.ip = ray.util.get_node_ip_address()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._engine: Any = None
        self._proc: Any = None
        self._conn: Any = None
        self._rank = -1

    def address(self) -> str:
        """This node's address as the cluster knows it."""
        return str(self.ip)

    def free_port(self) -> int:
        """A TCP port free right now on this node's address."""
        return free_port(self.ip)

    # -- an engine ------------------------------------------------------------------------------
    def start_engine(self, index: int, argv: list[str], url: str, token: str | None = None, node: int = 0,
                     log_name: str = "") -> str:
        """Start engine ``index`` (``argv[0]``, the launcher's Python, becomes this node's) with
        the run's ``token``, its output in ``log_name`` under the log directory (default
        ``engine<index>.log``; a replacement's is a file of its own); returns its log path. A
        replacement starts the same way, in this node's environment, once its predecessor was
        stopped (:meth:`stop_engine`)."""
        from weightsync.launch.procs import EngineProc

        path = self.log_dir / (log_name or f"engine{index}.log")
        self._engine = EngineProc(index, [sys.executable, *argv[1:]], url, path, _node_env(self.ip),
                                  preexec_fn=die_with_parent, token=token, where=f"node {node}")
        return str(path)

    def engine_alive(self) -> bool:
        return self._engine is not None and self._engine.alive()

    def engine_tail(self, n: int = 30) -> str:
        return self._engine.tail(n) if self._engine is not None else ""

    def engine_diagnose(self) -> str:
        """Why the engine cannot serve, seen on its node (its exit code and the cause its log
        names, a rank process stopped, its ``/health``); "" when nothing is wrong."""
        return self._engine.diagnose() if self._engine is not None else ""

    def request_stop_engine(self) -> None:
        if self._engine is not None:
            self._engine.request_stop()

    def stop_engine(self) -> None:
        if self._engine is not None:
            self._engine.stop()

    # -- a trainer rank -------------------------------------------------------------------------
    def start_trainer(self, rank: int, cfg: WorkerConfig) -> Reply[Started]:
        """Spawn trainer rank ``rank`` (``cfg`` its own: :attr:`WorkerConfig.host` is this node's
        address; the engines' token reaches it with its updater's config) and wait for its start-up
        reply."""
        ctx = mp.get_context("spawn")
        self._rank = rank
        self._conn, child = ctx.Pipe()
        path = str(self.log_dir / f"trainer{rank}.log")
        self._proc = ctx.Process(target=_trainer_main, args=(rank, cfg, child, path, _node_env(self.ip)),
                                 name=f"trainer-rank{rank}", daemon=True)
        self._proc.start()
        child.close()
        return self._reply("start-up")

    def request(self, msg: Command[Any]) -> Reply[Any]:
        """Relay one command to the rank; its reply."""
        try:
            self._conn.send(msg)
        except (OSError, ValueError) as exc:
            return Reply.failure(self._rank, f"trainer rank {self._rank} on {self.ip}: cannot send {msg.cmd}: {exc}")
        return self._reply(str(msg.cmd))

    def _reply(self, what: str) -> Reply[Any]:
        while not self._conn.poll(0.1):
            if not self._proc.is_alive():
                return Reply.failure(self._rank, f"trainer rank {self._rank} on {self.ip} died during {what} (exit "
                                     f"code {self._proc.exitcode}; its output: {self.log_dir}/trainer{self._rank}.log "
                                     "there)")
        return self._conn.recv()

    def stop_trainer(self, timeout_s: float) -> None:
        """STOP the rank and wait up to ``timeout_s`` for it to exit, then end it (SIGTERM, SIGKILL)."""
        if self._proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(Stop())
        end_child(self._proc, timeout_s)


__all__ = ["NodeAgent"]
