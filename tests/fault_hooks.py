"""Faults injected into a trainer rank's updates, for the fault-injection tests only.

A run reaches them through ``WEIGHTSYNC_FAULT_HOOK=tests.fault_hooks:FUNCTION:ARGUMENT`` (read
in ``weightsync.launch.config``; the trainer rank calls ``FUNCTION(worker, ARGUMENT)`` once its
updater is built); the in-process tests call :func:`on_write` on an updater directly. Every hook
wraps :meth:`WeightUpdater.write` and acts during the write call numbered ``K`` (0-based: in a
p2p run without retries call ``K`` writes version ``K``; a retry is the next call, which is
written normally), so each fault happens once.

Faults, on the p2p transport of the updater:

* ``drop_writes:K`` -- every write is acknowledged but nothing is copied (a silent drop);
* ``fail_write:K`` -- the first write raises, as a broken link does;
* ``slow_writes:K:SECONDS`` -- every write completes ``SECONDS`` late (past a shorter deadline
  the wait raises ``TimeoutError``, as a transport's does);
* ``kill_rank:K:RANK`` -- trainer rank ``RANK`` is SIGKILLed as the write starts;
* ``stop_rank:K:RANK`` -- trainer rank ``RANK`` is SIGSTOPped as the write starts (a hang, not a
  death: only SIGKILL ends it).

And one of an engine: ``kill_engine:STEP:ENGINE[:update]`` -- as trainer step ``STEP`` (1-based)
runs, between the step's generation and its update (with ``update``: as update ``STEP`` begins,
before any engine is called), trainer rank 0 SIGKILLs every process of engine ``ENGINE`` (its
``weightsync serve`` process group, found by its address) and waits until its rank 0 is gone.
An in-process test kills an engine itself with :func:`kill_serve`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from weightsync.transport.handles import WriteHandle

INJECTED = "injected fault"
"""In the message of every error these hooks raise."""


def on_write(updater: Any, k: int, fault: Callable[[Any], Callable[[], None]]) -> None:
    """Wrap ``updater.write``: during its call ``k`` (0-based, counted from this wrapping),
    ``fault(transport)`` is applied first and the callable it returns undoes it afterwards."""
    real = updater.write
    calls = [0]

    def write(mode: Any = "p2p", **kwargs: Any) -> Any:
        n = calls[0]
        calls[0] += 1
        if n != k or updater.p2p_sender is None:
            return real(mode, **kwargs)
        undo = fault(updater.p2p_sender.transport)
        try:
            return real(mode, **kwargs)
        finally:
            undo()

    updater.write = write


def dropping(transport: Any) -> Callable[[], None]:
    """Writes acknowledged, nothing copied."""
    transport.write = lambda peer, batch: WriteHandle(nbytes=int(getattr(batch, "nbytes", 0)), done=True)
    return lambda: vars(transport).pop("write", None)


def failing(transport: Any) -> Callable[[], None]:
    """The first write raises (a broken link)."""

    def write(peer: Any, batch: Any) -> Any:
        raise RuntimeError(f"{INJECTED}: {transport.kind} write to {peer.session_id} failed")

    transport.write = write
    return lambda: vars(transport).pop("write", None)


def slowing(delay_s: float) -> Callable[[Any], Callable[[], None]]:
    """Every write lands ``delay_s`` late; a wait whose deadline comes first raises TimeoutError."""

    def fault(transport: Any) -> Callable[[], None]:
        real_wait = transport.wait

        def wait(handle: Any, deadline: float) -> None:
            ready = handle.issued_at + delay_s
            if ready > deadline:
                time.sleep(max(0.0, deadline - time.monotonic()))
                raise TimeoutError(f"{INJECTED}: {transport.kind} write of {handle.nbytes} bytes not complete by its "
                                   "deadline (a slow receiver)")
            time.sleep(max(0.0, ready - time.monotonic()))
            real_wait(handle, deadline)

        transport.wait = wait
        return lambda: vars(transport).pop("wait", None)

    return fault


def drop_writes(worker: Any, arg: str) -> None:
    on_write(worker.updater, int(arg), dropping)


def fail_write(worker: Any, arg: str) -> None:
    on_write(worker.updater, int(arg), failing)


def slow_writes(worker: Any, arg: str) -> None:
    k, delay = arg.split(":")
    on_write(worker.updater, int(k), slowing(float(delay)))


def _signal_rank(worker: Any, arg: str, sig: signal.Signals) -> None:
    k, rank = (int(x) for x in arg.split(":"))
    if worker.rank != rank:
        return

    def fault(transport: Any) -> Callable[[], None]:
        os.kill(os.getpid(), sig)
        return lambda: None

    on_write(worker.updater, k, fault)


def kill_rank(worker: Any, arg: str) -> None:
    _signal_rank(worker, arg, signal.SIGKILL)


def stop_rank(worker: Any, arg: str) -> None:
    _signal_rank(worker, arg, signal.SIGSTOP)


def kill_engine(worker: Any, arg: str) -> None:
    step, engine, *when = arg.split(":")
    if worker.rank != 0:
        return
    method = "update" if when == ["update"] else "train_step"
    real = getattr(worker, method)
    calls = [0]

    def wrapped(msg: Any) -> Any:
        calls[0] += 1
        if (msg.version if method == "update" else calls[0]) == int(step):  # update 0 is the run's first
            kill_serve(worker.updater.engines.urls[int(engine)])
        return real(msg)

    setattr(worker, method, wrapped)


def kill_serve(url: str) -> None:
    """SIGKILL the ``weightsync serve`` process group of the engine at ``url`` and wait until its
    rank 0 is gone (30 s at most)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    pid = serve_pid(port, host)
    os.killpg(pid, signal.SIGKILL)
    end = time.monotonic() + 30
    while _running(pid) and time.monotonic() < end:
        time.sleep(0.05)


def serve_pid(port: str, host: str = "") -> int:
    """The pid of the ``weightsync serve`` process listening on ``port`` (and ``host``, when given:
    engines on other hosts' addresses may use the same port) from its command line."""
    from pathlib import Path

    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode() and \
                (not host or b"--host" not in argv or argv[argv.index(b"--host") + 1] == host.encode()):
            return int(d.name)
    raise LookupError(f"no weightsync serve process on {host or 'any address'}:{port}")


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
