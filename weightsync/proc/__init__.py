"""Process plumbing for every layer that starts processes: a free port, dying with the launcher,
ending a child in bounded time.

The engine server spawns its ranks, ``run`` spawns trainer ranks and engines, ``bench`` spawns one
process per rank; each needs rendezvous ports, children that do not outlive whoever started them,
and a way to end a child that always returns: a hung or stopped (SIGSTOP) child ignores SIGTERM
until it runs again, so every stop is terminate, a grace, then SIGKILL (:func:`end_child`). One
implementation of each lives here, on the ground floor (no weightsync imports), so that ``engine``
and ``launch`` share it without importing each other.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

log = logging.getLogger(__name__)

KILL_AFTER_S = 5.0
"""How long :func:`end_child` waits after SIGTERM before it sends SIGKILL (and after SIGKILL
before it gives up reaping)."""

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


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``R`` running, ``S`` / ``D`` sleeping, ``T`` stopped,
    ``t`` stopped by a tracer, ``Z`` zombie), "" when it is gone or the state cannot be read
    (elsewhere than Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0] if fields else ""


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, theirs, ...), read from ``/proc`` (Linux; [] elsewhere)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def exit_text(code: int) -> str:
    """A process's exit status in words: ``exit code N`` or ``killed by SIGKILL`` (negative: a signal)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def stopped_reason(pid: int | None) -> str:
    """Why process ``pid`` cannot answer although it exists ("" when it can, or is gone): it is
    stopped (SIGSTOP, Ctrl-Z, or a debugger holds it)."""
    if pid is None:
        return ""
    state = process_state(pid)
    if state in ("T", "t"):
        return f"its process (pid {pid}) is stopped ({'a debugger holds it' if state == 't' else 'SIGSTOP'})"
    return ""


def end_child(p: BaseProcess, grace_s: float) -> str:
    """End child process ``p`` of this process in bounded time: wait up to ``grace_s`` for it to
    exit, then SIGTERM and :data:`KILL_AFTER_S`, then SIGKILL and as long again to reap it. A
    stopped or hung child is ended too (SIGTERM stays pending on a stopped process, SIGKILL does
    not), so nothing waits on it forever, multiprocessing's exit-time join included.

    Returns:
        How it ended: ``exited (code N)``, ``terminated``, ``killed``, or ``not reaped`` (a process
        in uninterruptible sleep that SIGKILL has not ended yet; the kernel ends it later).
    """
    if p.pid is None:
        return "never started"
    p.join(timeout=max(grace_s, 0.0))
    if not p.is_alive():
        return f"exited (code {p.exitcode})"
    for how, send in (("terminated", p.terminate), ("killed", p.kill)):
        with contextlib.suppress(OSError):
            send()
        end = time.monotonic() + KILL_AFTER_S
        while p.is_alive() and time.monotonic() < end:
            p.join(timeout=0.1)
        if not p.is_alive():
            log.warning("%s (pid %d) did not exit within %.0f s; %s", p.name, p.pid, grace_s, how)
            return how
    log.error("%s (pid %d) survives SIGKILL (uninterruptible sleep?); left to the kernel", p.name, p.pid)
    return "not reaped"


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where ``/proc`` does not say): a pid means a
    process only within its namespace."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return 0
    return int(link[link.index("[") + 1 : -1])


def owned_temp_dir(prefix: str) -> Path:
    """A new temporary directory named after this process (``PREFIX-<pid>-n<pid namespace>-*``), so
    that :func:`remove_stale_temp_dirs` can remove it once this process is gone, however it died."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-n{pid_namespace()}-"))


def remove_stale_temp_dirs(prefix: str) -> list[str]:
    """Remove the :func:`owned_temp_dir` directories of ``prefix`` whose process is gone (only those
    of this pid namespace). Deletes directories in the temporary directory.

    Returns:
        The paths removed.
    """
    mine, removed = pid_namespace(), []
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}-*-n*-*"):
        fields = path.name[len(prefix) + 1 :].split("-")
        try:
            pid, ns = int(fields[0]), int(fields[1][1:])
        except (ValueError, IndexError):
            continue
        if ns == mine and not process_state(pid) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed
