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
