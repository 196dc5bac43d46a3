"""Contract of the engine's processes and listeners (``weightsync serve`` subprocesses, tiny
Qwen3-4B, two CPU ranks each):

* an engine whose ``--host`` is not loopback refuses to start without a token (exit 2, one line
  naming the rule, before any process starts);
* every listening socket of a Mooncake engine's rank processes -- HTTP, the ranks' process group
  store and gloo pairs, a weight-update group's gloo pairs, Mooncake's RPC and TCP data ports --
  is bound to loopback or confined to the loopback interface: a connection to the machine's other
  address is refused; the trainer side's group store and pairs too;
* a process writing into the shm segment of an engine (``--transport shm``) outside an update
  session changes no served byte (the segment is the engine's inbox; a session's begin wipes it);
* an engine started with ``--die-with-parent`` ends when its launcher is killed with SIGKILL,
  every rank process gone and no shm segment of theirs left; shm segments of processes that are
  gone are removed when an engine starts;
* Mooncake takes a write into the served weights from any peer on its network, token or not; the
  engine's live check finds such a write and never serves it;
* SIGTERM ends an engine whose weight-update group join is pending at once (not at the join's
  deadline); configuration directories of engines that are gone are removed when one starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO_ROOT
from weightsync.proc import free_port
from weightsync.sync.engine_client import SESSION_HEADER, EngineClient, EngineError
from weightsync.transport.mooncake import mooncake_available
from weightsync.transport.net import Listener, is_loopback, listening_sockets, route_source
from weightsync.transport.shm import SHM_DIR, list_segments, segment_owner

MODEL_ARGS = ["Qwen3-4B", "--scale", "tiny", "--load-format", "dummy", "--tp", "2", "--log-level", "warning"]
SERVE = [sys.executable, "-m", "weightsync.cli", "serve"]


def _other_address() -> str | None:
    """An address of this machine that is not loopback (None: it has none)."""
    try:
        addr = route_source("192.0.2.1")  # a documentation address: nothing is sent
    except OSError:
        return None
    return None if is_loopback(addr) else addr


def _wait_healthy(url: str, alive: Any, log: Path, timeout_s: float = 120.0) -> None:
    client = EngineClient(url)
    try:
        client.wait_healthy(timeout_s=timeout_s, proc_alive=alive)
    except EngineError as exc:
        pytest.fail(f"{exc}:\n{log.read_text()}")
    finally:
        client.close()


def _engine_pids(root: int) -> list[int]:
    """``root`` and its descendant processes."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        todo += [int(k) for k in kids]
    return out


def _reachable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect((host, port))
        except OSError:
            return False
    return True


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """Start ``weightsync serve ARGS`` (own session, killed at the end); returns (proc, url, log)."""
    started: list[subprocess.Popen] = []

    def start(args: list[str]) -> tuple[subprocess.Popen, str, Path]:
        port = free_port()
        log = tmp_path / f"serve{len(started)}.log"
        with log.open("w") as out:
            proc = subprocess.Popen([*SERVE, *args, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=REPO_ROOT)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, lambda: proc.poll() is None, log)
        return proc, url, log

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_off_loopback_without_a_token_refuses_to_start(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "192.0.2.7"):
        done = subprocess.run([*SERVE, *MODEL_ARGS, "--host", host], capture_output=True, text=True, timeout=60,
                              cwd=REPO_ROOT, env={k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_TOKEN"})
        assert done.returncode == 2, done.stderr
        assert f"--host {host}" in done.stderr
        assert "token" in done.stderr
        assert "Traceback" not in done.stderr
    empty = tmp_path / "token"
    empty.write_text("")
    done = subprocess.run([*SERVE, *MODEL_ARGS, "--token-file", str(empty)], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 2
    assert "is empty" in done.stderr


@pytest.mark.timeout(240)
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake is not installed")
def test_every_listener_of_an_engine_is_on_loopback(serve: Any) -> None:
    from weightsync.transport.group import new_weight_update_group

    proc, url, _ = serve([*MODEL_ARGS, "--transport", "mooncake"])
    # a weight-update group with this process as its master: the ranks open their gloo pairs
    master_port = free_port()
    before = {lst.inode for lst in listening_sockets()}
    groups: list[Any] = []

    def trainer() -> None:
        groups.append(new_weight_update_group(master_address="127.0.0.1", master_port=master_port, rank=0,
                                              world_size=3, group_name="g", backend="gloo"))

    t = threading.Thread(target=trainer)
    t.start()
    r = httpx.post(f"{url}/init_weights_update_group", json={"master_address": "127.0.0.1",
                                                               "master_port": master_port, "rank_offset": 1,
                                                               "world_size": 3, "group_name": "g", "backend": "gloo"},
                   timeout=60)
    t.join(timeout=60)
    assert r.status_code == 200, r.text
    ours = [lst for lst in listening_sockets() if lst.inode not in before]
    assert ours, "the group's master listens"
    assert all(is_loopback(lst.address) for lst in ours), ours
    pids = _engine_pids(proc.pid)
    listeners: dict[int, list[Listener]] = {pid: listening_sockets(pid) for pid in pids}
    ranks = [pid for pid, ls in listeners.items() if ls]
    assert len(ranks) == 2, f"two rank processes listen: {listeners}"
    other = _other_address()
    wide = []
    for pid, ls in listeners.items():
        for lst in ls:
            if is_loopback(lst.address):
                continue
            assert lst.wildcard, f"pid {pid} listens on {lst.address}:{lst.port}"
            wide.append(lst.port)
            assert _reachable("127.0.0.1", lst.port), lst
            if other is not None:
                assert not _reachable(other, lst.port), f"port {lst.port} answers on {other}"
    assert len(wide) == 4, f"Mooncake's two ports on each rank are the only wildcard listeners: {listeners}"
    httpx.post(f"{url}/destroy_weights_update_group", json={"group_name": "g"}, timeout=30)
    groups.clear()


LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    proc = subprocess.Popen(sys.argv[1:])  # the engine, in this launcher's session
    print(proc.pid, flush=True)
    time.sleep(3600)
""")


@pytest.mark.timeout(240)
def test_shm_writes_outside_a_session_and_a_killed_launcher(tmp_path: Path) -> None:
    """One engine under a launcher process: the stale-segment sweep at its start, the foreign
    writer, then SIGKILL of the launcher."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    ns = os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]")
    stale = f"weightsync-{dead.pid}-n{ns}-0badc0ffee00"
    (SHM_DIR / stale).write_bytes(b"x")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "engine.log"
    with log.open("w") as out:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, *SERVE, *MODEL_ARGS, "--transport", "shm",
                                     "--die-with-parent", "--port", str(port)], stdout=subprocess.PIPE, stderr=out,
                                    start_new_session=True, cwd=REPO_ROOT, text=True)
    try:
        engine_pid = int(launcher.stdout.readline())
        _wait_healthy(url, lambda: _alive(engine_pid), log)
        assert not (SHM_DIR / stale).exists(), "the stale segment of a dead process was removed at start-up"
        pids = _engine_pids(engine_pid)
        segments = [s for s in list_segments() if segment_owner(s)[0] in pids]
        assert len(segments) == 2, segments
        _foreign_write_changes_nothing(url, tmp_path)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], f"engine processes outlived their launcher:\n{log.read_text()}"
        left = [s for s in list_segments() if segment_owner(s)[0] in pids]
        assert left == [], f"shm segments left behind: {left}"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-KILL", "-s", str(launcher.pid)], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


FOREIGN_WRITER = textwrap.dedent("""
    import json, sys, torch
    from weightsync.transport import PeerDescriptor, TransportConfig, deadline_after
    info = json.loads(sys.argv[1])
    ptr, numel, esize = info["weights"][sys.argv[2]]
    kind, host = (sys.argv[3:5] + ["shm", "127.0.0.1"][len(sys.argv) - 3:])[:2]
    writer = TransportConfig(kind=kind).on_host(host).make()
    zeros = torch.zeros(numel * esize, dtype=torch.uint8)
    writer.register_tensor("zeros", zeros)
    peer = writer.connect(PeerDescriptor.from_json(info["descriptor"]))
    writer.wait(writer.write(peer, [(zeros.data_ptr(), ptr, numel * esize)]), deadline_after(30))
    writer.close()
    print("written")
""")


def _foreign_write_changes_nothing(url: str, tmp_path: Path) -> None:
    def checksums() -> dict[str, str]:
        return httpx.post(f"{url}/weights_checker", json={"action": "checksum", "rank": 0}, timeout=60).json()[
            "checksums"]

    def generate() -> list[int]:
        body = {"input_ids": [5, 17, 250, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        return httpx.post(f"{url}/generate", json=body, timeout=60).json()["output_ids"]

    before, out = checksums(), generate()
    answer = httpx.get(f"{url}/get_remote_instance_transfer_engine_info", params={"rank": 0}).json()
    _, weights = answer["remote_instance_transfer_engine_info"]
    name = "model.embed_tokens.weight"
    info = json.dumps({"weights": weights, "descriptor": answer["transport_descriptor"]})
    done = subprocess.run([sys.executable, "-c", FOREIGN_WRITER, info, name], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT)
    assert done.stdout.strip() == "written", done.stderr
    assert checksums() == before, "a write outside a session reached the served weights"
    assert generate() == out
    # a session's begin wipes the inbox: ending it and publishing serves the old weights
    for path, body in (("/pause_generation", {}), ("/begin_weight_update", {}), ("/end_weight_update", {}),
                       ("/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
                       ("/continue_generation", {})):
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
    assert checksums() == before
    assert generate() == out


MOONCAKE_HOST, MOONCAKE_PEER = "198.18.9.1", "198.18.9.2"


@pytest.mark.timeout(300)
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake is not installed")
def test_a_foreign_mooncake_write_is_found_and_never_served(tmp_path: Path) -> None:
    """A Mooncake engine bound to a network address, with a token: a peer on that network (a
    namespace of the test's own) writes zeros into a served parameter through Mooncake outside any
    session -- the token does not stop it, nothing in Mooncake authenticates peers. The live check
    (every second here) finds the change: the weights turn dirty, ``/generate`` answers 503, and
    ``/live_weights_check`` names the tensor; a session that reloads, verifies and publishes
    serves the original tokens again."""
    from tests.engine_helpers import write_tiny_checkpoint
    from tests.netns_helpers import veth_peer

    ckpt = tmp_path / "ckpt"
    write_tiny_checkpoint("Qwen3-4B", ckpt)
    token = "live-check-token-0123456789"
    (tmp_path / "token").write_text(token)
    with veth_peer("m", MOONCAKE_HOST, MOONCAKE_PEER) as ns:
        port = free_port(MOONCAKE_HOST)
        url = f"http://{MOONCAKE_HOST}:{port}"
        log = tmp_path / "engine.log"
        argv = [*SERVE, "Qwen3-4B", "--scale", "tiny", "--tp", "2", "--checkpoint", str(ckpt), "--dtype", "float32",
                "--transport", "mooncake", "--host", MOONCAKE_HOST, "--port", str(port), "--token-file",
                str(tmp_path / "token"), "--live-check-interval-s", "1"]
        with log.open("w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO_ROOT)
        client = EngineClient(url, token=token, timeout_s=60)
        try:
            client.wait_healthy(timeout_s=120, proc_alive=lambda: proc.poll() is None)
            _foreign_mooncake_write(client, url, token, ns, log)
        finally:
            client.close()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert "no authentication" in log.read_text(), "serve warns at start"


def _foreign_mooncake_write(client: EngineClient, url: str, token: str, ns: str, log: Path) -> None:
    body = {"input_ids": [5, 17, 250, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    out = client.generate(body)["output_ids"]
    auth = {"Authorization": f"Bearer {token}"}
    first = httpx.post(f"{url}/live_weights_check", headers=auth, timeout=60).json()
    assert (first["checked"], first["match"]) == (True, True), first
    answer = httpx.get(f"{url}/get_remote_instance_transfer_engine_info", params={"rank": 0}, headers=auth).json()
    _, weights = answer["remote_instance_transfer_engine_info"]
    name = "model.embed_tokens.weight"
    info = json.dumps({"weights": weights, "descriptor": answer["transport_descriptor"]})
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", FOREIGN_WRITER, info, name, "mooncake",
                           MOONCAKE_PEER], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.stdout.strip() == "written", done.stderr[-3000:]
    end = time.monotonic() + 30
    while not client.engine_state()["weights_dirty"] and time.monotonic() < end:
        time.sleep(0.2)
    state = client.engine_state()
    assert state["weights_dirty"], f"the foreign write was not found:\n{log.read_text()[-3000:]}"
    assert state["state"] == "paused", state
    refused = httpx.post(f"{url}/generate", json=body, headers=auth, timeout=60)
    assert refused.status_code == 503, refused.text
    assert "changed outside an update session" in log.read_text()
    assert name in log.read_text()
    # the holder reloads, checks and publishes: served again, as before the write
    client.pause_generation()
    client.begin_weight_update()
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(log.parent / "ckpt")},
                   headers={**auth, SESSION_HEADER: client.session_id or ""}, timeout=120)
    assert r.status_code == 200, r.text
    client.end_weight_update()
    client.update_weight_version("2")
    client.continue_generation()
    assert client.generate(body)["output_ids"] == out
    again = httpx.post(f"{url}/live_weights_check", headers=auth, timeout=60).json()
    assert (again["checked"], again["match"]) == (True, True), again


@pytest.mark.timeout(240)
def test_sigterm_ends_an_engine_whose_group_join_is_pending(serve: Any, tmp_path: Path) -> None:
    """SIGTERM while ``init_weights_update_group`` waits on a master that accepts connections but
    never answers (the join's deadline is 600 s): the engine exits within seconds (it waited for
    the join's deadline), and a dummy engine's configuration directory goes with it -- or, killed
    outright, the next engine's start removes it."""
    import tempfile

    from weightsync.proc import pid_namespace

    master = socket.socket()
    master.bind(("127.0.0.1", 0))
    master.listen(8)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Path(tempfile.gettempdir()) / f"weightsync-config-{dead.pid}-n{pid_namespace()}-0ld"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    proc, url, log = serve(MODEL_ARGS)
    assert not stale.exists(), "a gone engine's configuration directory is removed at start"
    mine = sorted(Path(tempfile.gettempdir()).glob(f"weightsync-config-{proc.pid}-n*"))
    assert len(mine) == 1, mine
    body = {"master_address": "127.0.0.1", "master_port": master.getsockname()[1], "rank_offset": 1,
            "world_size": 3, "group_name": "stuck", "backend": "gloo"}
    pending = threading.Thread(target=lambda: _post_quietly(f"{url}/init_weights_update_group", body), daemon=True)
    pending.start()
    time.sleep(3.0)
    assert pending.is_alive(), "the join is pending"
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    took = time.monotonic() - t0
    master.close()
    assert took < 60, f"{took:.0f} s:\n{log.read_text()[-2000:]}"
    assert not mine[0].exists(), "the engine's configuration directory outlived it"


def _post_quietly(url: str, body: dict[str, Any]) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url, json=body, timeout=600)
