"""Contract of the process plumbing (:mod:`weightsync.proc`).

* a process that called :func:`die_with_parent` dies when its parent is killed outright (SIGKILL:
  no clean-up runs in the parent), so a killed launcher or engine rank 0 leaves no ranks behind;
* a child whose parent is alive keeps running;
* :func:`free_port` returns a port that can be bound;
* :func:`end_child` returns for a child that exits, one that ignores SIGTERM and one stopped by
  SIGSTOP (SIGTERM stays pending on it), each reaped, and :func:`stopped_reason` names the stopped one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from weightsync.proc import end_child, free_port, stopped_reason

REPO = Path(__file__).resolve().parent.parent

PARENT = textwrap.dedent("""
    import multiprocessing as mp, sys, time
    from weightsync.proc import die_with_parent

    def child(path):
        die_with_parent()
        with open(path, "w") as f:
            f.write(str(__import__("os").getpid()))
        time.sleep(120)

    if __name__ == "__main__":
        p = mp.get_context("spawn").Process(target=child, args=(sys.argv[1],))
        p.start()
        time.sleep(120)
""")


def _alive(pid: int) -> bool:
    """Running (a zombie left for a reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_child_dies_with_its_killed_parent(tmp_path: Path) -> None:
    script, pid_file = tmp_path / "parent.py", tmp_path / "child.pid"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file)], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert parent.poll() is None, "the parent exited before its child started"
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_die_with_parent_keeps_a_child_of_a_live_parent_running() -> None:
    code = "from weightsync.proc import die_with_parent; die_with_parent(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def _sleep(ignore_term: bool) -> None:
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(120)


@pytest.mark.parametrize(("how", "ended"), [("exits", "exited (code 0)"), ("ignores SIGTERM", "killed"),
                                            ("stopped", "killed"), ("plain", "terminated")])
def test_end_child_always_returns_and_reaps(how: str, ended: str) -> None:
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=time.sleep if how == "exits" else _sleep,
                    args=(0.0,) if how == "exits" else (how == "ignores SIGTERM",), daemon=True)
    p.start()
    if how != "exits":
        time.sleep(1.0)  # started (and, for one, ignoring SIGTERM)
    if how == "stopped":
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert "is stopped (SIGSTOP)" in stopped_reason(p.pid)
    t0 = time.monotonic()
    assert end_child(p, 0.5 if how != "exits" else 30.0) == ended
    assert time.monotonic() - t0 < 20
    assert not p.is_alive()
    assert stopped_reason(p.pid) == ""
