"""Process plumbing for every layer that starts processes: a free port, dying with the launcher.

The engine server spawns its ranks, ``run`` spawns trainer ranks and engines, ``bench`` spawns one
process per rank; each needs rendezvous ports and children that do not outlive whoever started
them. One implementation of each lives here, on the ground floor (no weightsync imports), so that
``engine`` and ``launch`` share it without importing each other.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import socket

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal this process gets when its parent exits (Linux)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (bind to port 0, read it, close).

    Another process may take it before the caller binds it; callers bind soon after.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def log_tail(path: str | os.PathLike[str], n: int) -> str:
    """The last ``n`` lines of the log file at ``path`` ("" when it cannot be read): what a
    launcher shows of a child process that failed."""
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-n:])
    except OSError:
        return ""


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send this process ``sig`` (SIGKILL by default) when its parent dies, however
    it dies (Linux ``PR_SET_PDEATHSIG``); exit at once if the parent is already gone. A process that
    must stop its own children first asks for SIGTERM and handles it.

    A killed launcher must not leave ranks holding GPU memory or ports. The orphan check closes
    the window between the parent's death and the ``prctl`` call (the signal is only armed for a
    parent that is still alive); for a ``multiprocessing`` child the parent is the process that
    spawned it. Elsewhere than Linux a no-op.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    if prctl(PR_SET_PDEATHSIG, sig) != 0:
        errno = ctypes.get_errno()
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this process may outlive its parent", errno)
    # Already reparented (to init, or to a container's subreaper): the parent is gone.
    parent = multiprocessing.parent_process()
    if os.getppid() == 1 or (parent is not None and os.getppid() != parent.pid):
        os._exit(1)


def stop_on_signals() -> None:
    """SIGTERM (and SIGHUP) end this process as Ctrl-C does: a KeyboardInterrupt in the main thread,
    so that a launcher's teardown stops every process it started. (A SIGKILL cannot be caught: the
    children's parent-death signal ends them then, :func:`die_with_parent`.)"""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
