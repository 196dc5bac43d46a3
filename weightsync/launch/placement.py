"""Where the processes of a run start, how they find each other, and how they are stopped.

A :class:`Placement` starts the run's rollout engines (``weightsync serve`` processes, reached over
HTTP) and trainer ranks (:mod:`~weightsync.launch.trainer_worker`, driven with the typed commands
of :mod:`~weightsync.launch.messages`, each rank bound to its own node's address), tells
the run loop the addresses peers reach them at, and stops everything it started. The run loop
(:class:`~weightsync.launch.session.RunSession`) talks to it alone and does not know which one it
got:

* :class:`LocalPlacement` -- every process on this host, started here (the single-node runs; no
  Ray needed);
* :class:`~weightsync.launch.placement_ray.RayPlacement` -- one Ray placement-group bundle per
  trainer rank and per engine, pinned to the node the run's
  :class:`~weightsync.models.fit.NodePlan` gives it; a small Ray actor on that node starts the
  same processes there.

Addresses: an engine binds its HTTP (and publishes its Mooncake session) on its host's real
address when a peer -- the launcher or a trainer rank -- is on another host, and on loopback
otherwise (:attr:`EngineEndpoint.remote`); rendezvous ports are picked on the host that binds them.

Token: the engines' access token is the run's (``EnvSettings.token``, ``WEIGHTSYNC_TOKEN``), given
to the placement; when none is given, a placement that starts engines makes one for them, loopback
included (another local user could otherwise pause, reset and publish on them), and writes it to
``engine-token`` in the run's log directory (mode 0600). It reaches the engines in their
environment (readable by their own user only, never on a command line) and is passed to every
client: the launcher's, and the trainer ranks' through ``UpdaterConfig.token``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from weightsync.launch.config import Deadlines
from weightsync.launch.messages import Command, Reply, Started, Stop
from weightsync.launch.procs import AttachedEngine, EngineProc, TrainerError
from weightsync.launch.trainer_worker import WorkerConfig, worker_main
from weightsync.models.fit import NodePlan
from weightsync.proc import end_child, free_port, stopped_reason
from weightsync.sync.engine_client import EngineClient, EngineError

log = logging.getLogger(__name__)

R = TypeVar("R")

LOOPBACK = "127.0.0.1"
DIE_WITH_PARENT = "--die-with-parent"
"""``weightsync serve``'s flag: the engine stops when the process that started it dies."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineEndpoint:
    """Where one engine serves: its node, the address it binds and publishes, its HTTP port."""

    index: int
    node: int
    host: str
    """The address the engine binds its HTTP on and publishes for Mooncake peers."""
    port: int
    remote: bool
    """Peers on other hosts reach it, so it binds its host's address instead of loopback. Its
    control endpoints are then open to that network: the place where an access token belongs."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class EngineHandle(Protocol):
    """One engine as the run loop sees it (:class:`~weightsync.launch.procs.EngineProc` fits)."""

    index: int
    url: str
    client: EngineClient

    def alive(self) -> bool: ...

    def tail(self, n: int = 30) -> str: ...

    def request_stop(self) -> None: ...

    def diagnose(self) -> str:
        """Why it cannot serve, in one line ("" when nothing is wrong that can be seen)."""
        ...

    def stop(self) -> None: ...


class RankChannel(ABC):
    """The command pipe of one trainer rank: one reply per command, the first one its start-up
    (:mod:`~weightsync.launch.messages`)."""

    @abstractmethod
    def send(self, msg: Command[Any]) -> None: ...

    @abstractmethod
    def poll(self, timeout_s: float) -> bool:
        """Whether the reply is there (waits up to ``timeout_s``)."""

    @abstractmethod
    def recv(self) -> Reply[Any]:
        """The rank's reply: the command's value, or its error (with the rank's traceback)."""

    @abstractmethod
    def dead(self) -> str:
        """Why the rank cannot answer any more (its exit), or "" while it runs."""

    @abstractmethod
    def stop(self) -> None:
        """Send STOP without waiting (a rank that already exited is fine)."""

    @abstractmethod
    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the rank to exit after :meth:`stop`, then end it (SIGTERM,
        then SIGKILL: a hung or stopped rank too); returns in bounded time."""

    def hung(self) -> str:
        """Why the rank cannot answer although it runs (its process is stopped), or ""."""
        return ""


class Placement(ABC):
    """Starts, reaches and stops the engines and trainer ranks of a run (module docstring)."""

    kind: str = ""

    def __init__(self, log_dir: Path, nodes: NodePlan, *, token: str | None = None) -> None:
        """``token``: the engines' access token (None: engines this run starts get one of their own)."""
        self.log_dir = log_dir
        self.nodes = nodes
        self.engines: list[EngineHandle] = []
        self._ranks: list[RankChannel] = []
        self._pool = ThreadPoolExecutor(max_workers=16)
        self.deadlines = Deadlines()
        """The run's deadlines (the session sets its own): HTTP calls, commands, the failure grace, stops."""
        self.token = token
        """The engines' access token (module docstring); None: none yet."""
        self.token_file: Path | None = None
        """Where the token this run made for its engines is (mode 0600); None: it made none."""
        self._launched: dict[int, tuple[EngineEndpoint, list[str]]] = {}
        """Engine index -> where this run started it and its command line (:meth:`replace_engine`)."""
        self._replaced: dict[int, int] = {}
        """Engine index -> how many times it was replaced."""

    # -- addresses ------------------------------------------------------------------------------
    @abstractmethod
    def trainer_host(self, rank: int) -> str:
        """The address peers reach trainer rank ``rank``'s host at (rendezvous it hosts)."""

    @abstractmethod
    def trainer_port(self, rank: int) -> int:
        """A TCP port free right now on trainer rank ``rank``'s host (for a rendezvous it hosts)."""

    @abstractmethod
    def engine_endpoints(self) -> list[EngineEndpoint]:
        """Where each engine will serve (ports picked on its own host)."""

    # -- engines --------------------------------------------------------------------------------
    def start_engines(self, argv_for: Callable[[EngineEndpoint], Sequence[str]], *, timeout_s: float) -> None:
        """Start every engine (``argv_for(endpoint)`` is its command line) and wait until every one
        is healthy.

        Raises:
            EngineError: an engine exited or did not become healthy; its log tail is in the message.
        """
        if self.token is None:
            self.token = secrets.token_urlsafe(32)
            self.token_file = write_private(self.log_dir / TOKEN_FILE, self.token)
            log.info("the engines' token of this run: %s (mode 0600)", self.token_file)
        for ep in self.engine_endpoints():
            if ep.remote:
                log.info("engine %d serves on %s (reachable from other hosts: its control endpoints are open to the "
                         "cluster network)", ep.index, ep.url)
            argv = list(argv_for(ep))
            self._launched[ep.index] = (ep, argv)
            self.engines.append(self._start_engine(ep, argv))
        for e in self.engines:
            try:
                e.client.wait_healthy(timeout_s=timeout_s, proc_alive=e.alive)
            except EngineError as exc:
                raise EngineError(f"{exc}\n--- engine {e.index} log ({self.engine_log(e.index)}) ---\n{e.tail()}"
                                  ) from None

    def launched(self, index: int) -> bool:
        """Whether this run started engine ``index`` (else it was attached: never restarted)."""
        return index in self._launched

    def replaced(self, index: int) -> int:
        """How many times engine ``index`` was replaced (:meth:`replace_engine`)."""
        return self._replaced.get(index, 0)

    def replace_engine(self, index: int, extra: Sequence[str]) -> EngineHandle:
        """Start engine ``index`` again where it served -- its endpoint (host, port, node), its
        command line with ``extra`` appended, its environment -- once what is left of the old one
        is stopped (a hung process is killed); the new handle takes its place in :attr:`engines`.
        It writes a log of its own (:meth:`engine_log`); this does not wait for it.

        Raises:
            KeyError: this run did not start engine ``index``.
        """
        ep, argv = self._launched[index]
        self.engines[index].stop()
        self._replaced[index] = self._replaced.get(index, 0) + 1
        handle = self._start_engine(ep, [*argv, *extra], replacement=self._replaced[index])
        self.engines[index] = handle
        return handle

    @abstractmethod
    def _start_engine(self, ep: EngineEndpoint, argv: list[str], *, replacement: int = 0) -> EngineHandle:
        """Start one engine's process (``replacement``: the how-manieth replacement of the engine
        at ``ep``, 0 for the first start); its handle (an :class:`EngineHandle`)."""

    def engine_log(self, index: int, replacement: int = 0) -> str:
        """Where engine ``index`` writes its output (on its own node); a replacement in a file of
        its own, next to its predecessor's (which says why that one stopped)."""
        return str(self.log_dir / (f"engine{index}.log" if not replacement else
                                   f"engine{index}-replacement{replacement}.log"))

    def attach_engines(self, urls: Sequence[str]) -> None:
        """Use engines that are already serving (they are left running on close)."""
        self.engines.extend(AttachedEngine(len(self.engines) + i, u, self.token, timeout_s=self.deadlines.engine_call_s)
                            for i, u in enumerate(urls))

    def submit(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> Future[R]:
        """Run ``fn`` in the launcher's thread pool (a future)."""
        return self._pool.submit(fn, *args, **kwargs)

    def on_engines(self, fn: Callable[[EngineClient], R]) -> list[R]:
        """Call ``fn(client)`` on every engine concurrently; results in engine order."""
        return list(self._pool.map(lambda e: fn(e.client), self.engines))

    # -- trainer ranks --------------------------------------------------------------------------
    def spawn_trainers(self, cfg: WorkerConfig) -> None:
        """Start every trainer rank (they load their shards in the background), each bound to the
        address of its own host (:attr:`WorkerConfig.host`)."""
        self._ranks = [self._spawn_trainer(rank, replace(cfg, host=self.trainer_host(rank)))
                       for rank in range(cfg.train.world_size)]

    @abstractmethod
    def _spawn_trainer(self, rank: int, cfg: WorkerConfig) -> RankChannel:
        """Start trainer rank ``rank`` with ``cfg`` (its own); its channel."""

    def wait_trainers(self, *, timeout_s: float) -> list[Started]:
        """Wait until every trainer rank has loaded its shards."""
        return self._collect(timeout_s, "start-up")

    def command(self, msg: Command[R], *, timeout_s: float | None = None) -> list[R]:
        """Send ``msg`` to every trainer rank; their replies' values in rank order.

        Args:
            timeout_s: default the run's ``command`` deadline.

        Raises:
            TrainerError: any rank failed (the first failure first, with its traceback), or a
                rank did not answer in time (named, with the deadline).
        """
        for ch in self._ranks:
            ch.send(msg)
        return self._collect(self.deadlines.command_s if timeout_s is None else timeout_s, str(msg.cmd))

    def command_async(self, msg: Command[R], *, timeout_s: float | None = None) -> Future[list[R]]:
        """:meth:`command` in a background thread (a future), to overlap with engine calls."""
        return self._pool.submit(self.command, msg, timeout_s=timeout_s)

    def _collect(self, timeout_s: float, what: str) -> list[Any]:
        """Every rank's answer to ``what``, watching all ranks at once: the first rank that fails
        (an error answer, its exit, or its process stopped for ``failure_grace_s``) stops the wait
        within ``failure_grace_s`` -- the others, often waiting for it in a collective, get that
        long to report -- and its error comes first.

        Raises:
            TrainerError: as :meth:`command`.
        """
        t0 = time.monotonic()
        grace = self.deadlines.failure_grace_s
        out: list[Any] = [None] * len(self._ranks)
        waiting = set(range(len(self._ranks)))
        failures: list[tuple[float, str]] = []
        hung_since: dict[int, float] = {}
        while waiting:
            for rank in sorted(waiting):
                ch = self._ranks[rank]
                if ch.poll(0):
                    try:
                        reply = ch.recv()
                    except (EOFError, OSError):  # the rank's end of the pipe closed: it died
                        waiting.discard(rank)
                        failures.append((time.monotonic(), f"trainer rank {rank} died during {what} "
                                                           f"({_exit_of(ch)})"))
                        continue
                    waiting.discard(rank)
                    if not reply.ok:
                        failures.append((time.monotonic(), reply.error))
                    out[rank] = reply.value
                    continue
                why = ch.dead()
                if why and not ch.poll(0.05):  # its last answer may still be on the way
                    waiting.discard(rank)
                    failures.append((time.monotonic(), f"trainer rank {rank} died during {what} ({why})"))
                    continue
                stuck = ch.hung()
                since = hung_since.setdefault(rank, time.monotonic()) if stuck else hung_since.pop(rank, None)
                if stuck and since is not None and time.monotonic() - since >= grace:
                    waiting.discard(rank)
                    failures.append((since, f"trainer rank {rank} cannot answer {what}: {stuck}"))
            now = time.monotonic()
            if failures and waiting and now - failures[0][0] >= grace:
                failures.append((now, f"trainer rank(s) {sorted(waiting)} did not answer {what} within {grace:g} s "
                                      "of that failure (waiting for the failed rank, presumably)"))
                break
            if waiting and now - t0 > timeout_s:
                raise TrainerError(f"trainer rank(s) {sorted(waiting)}: no answer to {what} within {timeout_s:g} s "
                                   "(the command deadline, run --deadlines command=SECONDS)")
            if waiting:
                self._ranks[min(waiting)].poll(0.05)
        if failures:  # the cause first: a rank's own error or death before its peers' broken collectives
            ordered = sorted(failures, key=lambda f: (_collateral(f[1]), f[0]))
            raise TrainerError("\n".join(text for _, text in ordered))
        return out

    def diagnose_engines(self) -> list[str]:
        """Why engines cannot serve, one line each (none when every engine looks fine): what a
        failed run says first, instead of the errors its callers saw (a connection closed, a
        timeout, a trainer rank's traceback)."""
        return [why for why in self._pool.map(lambda e: e.diagnose(), self.engines) if why]

    # -- results and teardown -------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Where everything ran, for ``results.json``."""
        return {"kind": self.kind, "num_nodes": self.nodes.num_nodes,
                "trainer_hosts": [self.trainer_host(r) for r in range(len(self._ranks))],
                "engine_urls": [e.url for e in self.engines],
                "engine_nodes": [self.nodes.engine_node(e.index) for e in self.engines
                                 if e.index < len(self.nodes.engines)]}

    def close(self) -> None:
        """Stop the trainer ranks and the engines this run started, all at once (each takes a few
        seconds to leave its process groups and exit; in turn they took the sum)."""
        for ch in self._ranks:
            ch.stop()
        for e in self.engines:
            e.request_stop()
        for ch in self._ranks:
            ch.join(self.deadlines.stop_s)
        for e in self.engines:
            e.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)


TOKEN_FILE = "engine-token"
"""The file in the run's log directory that holds the token a run made for its engines."""


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to a new file at ``path`` readable by this user only (mode 0600 from its
    creation: never readable by others, not even for a moment); an existing file is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "did not answer")
"""What a rank reports when a peer of its process group died or stopped answering (gloo's words):
the consequence of another rank's failure, listed after it."""


def _collateral(text: str) -> bool:
    return any(c in text for c in COLLATERAL)


def _exit_of(ch: RankChannel, wait_s: float = 2.0) -> str:
    """How a rank whose channel closed ended (its exit, once the process is reaped)."""
    end = time.monotonic() + wait_s
    while not ch.dead() and time.monotonic() < end:
        time.sleep(0.05)
    return ch.dead() or "its channel closed"


# -- this host ------------------------------------------------------------------------------------


class _PipeChannel(RankChannel):
    """A trainer rank spawned on this host, driven over a pipe."""

    def __init__(self, rank: int, cfg: WorkerConfig) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(rank, cfg, child), name=f"trainer-rank{rank}", daemon=True)
        self.proc.start()
        child.close()

    def send(self, msg: Command[Any]) -> None:
        self._conn.send(msg)

    def poll(self, timeout_s: float) -> bool:
        return self._conn.poll(timeout_s)

    def recv(self) -> Reply[Any]:
        return self._conn.recv()

    def dead(self) -> str:
        return "" if self.proc.is_alive() else f"exit code {self.proc.exitcode}"

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # a rank that already exited
            self._conn.send(Stop())

    def hung(self) -> str:
        return stopped_reason(self.proc.pid)

    def join(self, timeout_s: float) -> None:
        end_child(self.proc, timeout_s)


class LocalPlacement(Placement):
    """Every process of the run on this host: engines are ``weightsync serve`` subprocesses,
    trainer ranks spawned Python processes; everything binds ``host`` (loopback by default)."""

    kind = "local"

    def __init__(self, log_dir: Path, nodes: NodePlan, *, host: str = LOOPBACK, token: str | None = None) -> None:
        if nodes.num_nodes != 1:
            raise ValueError(f"a local placement runs on one host; this run spans {nodes.num_nodes} nodes")
        super().__init__(log_dir, nodes, token=token)
        self.host = host

    def trainer_host(self, rank: int) -> str:
        return self.host

    def trainer_port(self, rank: int) -> int:
        return free_port(self.host)

    def engine_endpoints(self) -> list[EngineEndpoint]:
        return [EngineEndpoint(index=e, node=0, host=self.host, port=free_port(self.host), remote=False)
                for e in range(len(self.nodes.engines))]

    def _start_engine(self, ep: EngineEndpoint, argv: list[str], *, replacement: int = 0) -> EngineProc:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if DIE_WITH_PARENT not in argv:  # the launcher's death, even a SIGKILL, stops the engine
            argv = [*argv, DIE_WITH_PARENT]
        return EngineProc(ep.index, argv, ep.url, Path(self.engine_log(ep.index, replacement)), env, token=self.token,
                          timeout_s=self.deadlines.engine_call_s, stop_s=self.deadlines.stop_s)

    def _spawn_trainer(self, rank: int, cfg: WorkerConfig) -> RankChannel:
        return _PipeChannel(rank, cfg)


__all__ = ["LOOPBACK", "EngineEndpoint", "EngineHandle", "LocalPlacement", "Placement", "RankChannel", "TrainerError"]
