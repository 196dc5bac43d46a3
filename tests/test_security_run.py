"""Contract of a ``weightsync run`` against the other users and networks of its machine (one run of
tiny Qwen3-4B on loopback, both modes, two trainer ranks, no ``WEIGHTSYNC_TOKEN`` set, its log
directory readable by everyone), checked while it runs:

* the run made a token for the engines it started, loopback included, in ``engine-token`` of its
  log directory, mode 0600; the token is on no process's command line;
* another user (uid 65534) reads neither that file nor the engine's environment, and its
  ``pause_generation``, ``reset_tensors``, ``update_weight_version`` and ``begin_weight_update``
  answer 401 (before, it paused, reset and published, and the engine served random weights);
* every listening socket of the trainer ranks (rank 0's process-group store, the gloo pairs, the
  weight-update group's store) is bound to loopback: a peer in another network namespace, routed
  to this host's address on a link of its own, is refused at each of their ports, while the same
  peer reaches a socket bound to every interface there (the route works: the binding refuses it);
* the run then finishes with every update verified and every validation passed: nothing the other
  user sent reached the engine.

The namespace is this test's own (198.18.0.0/15, reserved for network tests), made and removed here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e_helpers import PYTHON, REPO_ROOT, e2e_ckpt_fixture, run_env  # noqa: F401 -- the e2e_ckpt fixture
from tests.netns_helpers import veth_peer
from weightsync.transport.net import Listener, is_loopback, listening_sockets

pytestmark = pytest.mark.timeout(600)

HOST_IP, PEER_IP = "198.18.7.1", "198.18.7.2"
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
RUN = ["run", "Qwen3-4B", "--train", "tp=2,cp=1,world=2", "--rollout", "tp=1,engines=1", "--mode", "both",
       "--num-rollout", "10"]

ATTACK = textwrap.dedent("""
    import json, sys, httpx
    url, token_file, engine_pid = sys.argv[1:4]
    out = {}
    for what, path in (("token_file", token_file), ("environ", f"/proc/{engine_pid}/environ")):
        try:
            open(path, "rb").read()
            out[what] = "read"
        except PermissionError:
            out[what] = "denied"
    out["/health"] = httpx.get(url + "/health", timeout=30).status_code
    for path, body in (("/pause_generation", {}), ("/weights_checker", {"action": "reset_tensors"}),
                       ("/update_weight_version", {"new_version": "evil"}), ("/begin_weight_update", {})):
        out[path] = httpx.post(url + path, json=body, timeout=30).status_code
    print(json.dumps(out))
""")

CONNECT = textwrap.dedent("""
    import json, socket, sys
    host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
    out = {}
    for port in ports:
        with socket.socket() as s:
            s.settimeout(5)
            try:
                s.connect((host, port))
                out[port] = "connected"
            except OSError as exc:
                out[port] = type(exc).__name__
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def peer() -> Iterator[str]:
    """A network namespace at PEER_IP, linked to this host at HOST_IP."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (a second uid)")
    with veth_peer("r", HOST_IP, PEER_IP) as ns:
        yield ns


def _children(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                out += kids
                todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _from_peer(ns: str, ports: list[int]) -> dict[str, str]:
    done = subprocess.run(["ip", "netns", "exec", ns, PYTHON, "-c", CONNECT, HOST_IP, *map(str, ports)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_runs_engines_and_trainer_ranks_are_closed_to_others(peer: str, e2e_ckpt: Path, tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    for d in (tmp_path, log_dir):  # everyone may look: the files' own modes are what protect them
        d.chmod(0o755)
    env = {k: v for k, v in run_env(e2e_ckpt, log_dir).items() if k != "WEIGHTSYNC_TOKEN"}
    out_path = tmp_path / "out.txt"
    with out_path.open("w") as out:
        proc = subprocess.Popen([PYTHON, "-m", "weightsync.cli", *RUN], cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 300
        while "step 1:" not in out_path.read_text() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert "step 1:" in out_path.read_text(), out_path.read_text()[-3000:]
        pids = _children(proc.pid)
        direct = [p for p in pids if _parent(p) == proc.pid]
        engines = [p for p in direct if "weightsync.cli serve" in _cmdline(p)]
        trainers = [p for p in direct if "spawn_main" in _cmdline(p)]
        assert len(engines) == 1, [_cmdline(p) for p in pids]
        assert len(trainers) == 2, [_cmdline(p) for p in pids]
        _check_token(log_dir, engines[0], [proc.pid, *pids])
        _check_listeners(peer, trainers)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = out_path.read_text()
    assert code == 0, output[-3000:]
    results = json.loads((log_dir / "results.json").read_text())
    assert all(s["update_verified"] for s in results["steps"]), results["steps"]
    assert results["summary"]["validation_passed"], results["summary"]


def _check_token(log_dir: Path, engine: int, pids: list[int]) -> None:
    token_file = log_dir / "engine-token"
    st = token_file.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    token = token_file.read_text().strip()
    assert len(token) >= 32
    assert not [p for p in pids if token in _cmdline(p)], "the token is on a command line"
    port = _cmdline(engine).split("--port ")[1].split()[0]
    url = f"http://127.0.0.1:{port}"
    done = subprocess.run([*NOBODY, PYTHON, "-c", ATTACK, url, str(token_file), str(engine)], capture_output=True,
                          text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"token_file": "denied", "environ": "denied", "/health": 200, "/pause_generation": 401,
                    "/weights_checker": 401, "/update_weight_version": 401, "/begin_weight_update": 401}, seen


def _check_listeners(ns: str, trainers: list[int]) -> None:
    listeners: dict[int, list[Listener]] = {p: listening_sockets(p) for p in trainers}
    assert all(listeners.values()), f"both trainer ranks listen (store, gloo pairs): {listeners}"
    wide = [(p, lst) for p, ls in listeners.items() for lst in ls if not is_loopback(lst.address)]
    assert not wide, f"trainer listeners beyond loopback: {wide}"
    ports = sorted({lst.port for ls in listeners.values() for lst in ls})
    with socket.socket() as open_to_all:  # the control: a socket bound to every interface
        open_to_all.bind(("0.0.0.0", 0))
        open_to_all.listen()
        control = open_to_all.getsockname()[1]
        seen = _from_peer(ns, [control, *ports])
    assert seen.pop(str(control)) == "connected", "the peer does not reach this host at all"
    assert set(seen.values()) == {"ConnectionRefusedError"}, seen
