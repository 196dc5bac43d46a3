"""Many nodes on one machine: two hosts of the test's own, the wrapper commands on each.

The hosts are Linux network namespaces joined by a veth pair, with addresses from 198.18.0.0/15
(reserved for network tests), created here and removed at the end. Node rank 0 runs in the first,
node rank 1 in the second, each with its own Ray node, exactly as on two machines:

    ip netns exec <host0> bash GLM-4.7-Flash.sh p2p 0 198.18.0.1
    ip netns exec <host1> bash GLM-4.7-Flash.sh p2p 1 198.18.0.1

Contracts:

* Both modes across hosts (the same two hosts, one run after the other: a second run on the same
  nodes works): exit 0 on both nodes, every validation gate passes on every update, the trainer
  ranks are on the first host and the engine on the second (its HTTP URL and its Mooncake session
  ids carry the second host's address, the trainer ranks' Mooncake sessions the first host's), p2p
  goes over Mooncake; the worker says the job ended and left, and nothing the run started is left
  running on either host.
* Only the head: the deadline error names how many nodes joined and the missing rank, nothing
  hangs, nothing is left running.
* The head killed mid-job: the worker exits 1 naming the cause, and both hosts are empty.
* ``--replace-dead-engines`` with two engines on the second host, one SIGKILLed as step 1 trains
  (``tests/fault_hooks.py``'s ``kill_engine``): its replacement starts on the second host at the
  same URL, joins the current version from the other engine, and the run completes every step,
  each verified, with exit 0 on both nodes; ``results.json`` names the replacement, which logs to
  a file of its own there; nothing is left running.

Without network namespaces (not root, no iproute2) or without Ray the tests are skipped, saying so;
there is no fallback to Ray's single-host test cluster, whose nodes share one address (nothing
would cross hosts).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e_helpers import (
    PYTHON,
    REPO_ROOT,
    RunOutcome,
    assert_bytes_exact,
    assert_run_passed,
    e2e_ckpt_fixture,  # noqa: F401 -- the e2e_ckpt fixture
    model_bytes,
    run_cli,
    run_env,
)

pytest.importorskip("ray", reason="Ray is not installed here (scripts/setup.sh installs it): no multi-node runs")

pytestmark = pytest.mark.timeout(600)

MODEL = "GLM-4.7-Flash"  # a 2-node profile
WRAPPER = REPO_ROOT / "examples" / "infra_features" / "p2p_weight_transfer" / f"{MODEL}.sh"
RUN_PY = WRAPPER.parent / "run.py"
HEAD_IP, WORKER_IP = "198.18.0.1", "198.18.0.2"
RUN_TIMEOUT_S = 360


@dataclass(frozen=True)
class Hosts:
    """Two network namespaces joined by a veth pair: host 0 at HEAD_IP, host 1 at WORKER_IP."""

    names: tuple[str, str]

    def cmd(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]

    def pids(self, host: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True, text=True, check=False)
        return [int(p) for p in out.stdout.split()]

    def wait_empty(self, timeout_s: float = 30.0) -> dict[int, list[str]]:
        """Wait until no process runs in either host; what still runs (pid: command) otherwise."""
        end = time.monotonic() + timeout_s
        while True:
            left = {p: _cmdline(p) for h in (0, 1) for p in self.pids(h)}
            if not left or time.monotonic() > end:
                return left
            time.sleep(0.5)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:6]
    except OSError:
        return []


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces unavailable (needs root and iproute2's `ip`): the multi-host runs are not "
                    "exercised here (no fallback to Ray's single-host test cluster: nothing would cross hosts)")
    tag = f"{os.getpid() % 10**6}"
    names = (f"wsh{tag}a", f"wsh{tag}b")
    veth = (f"wsv{tag}a", f"wsv{tag}b")
    steps = [("netns", "add", names[0]), ("netns", "add", names[1]),
             ("link", "add", veth[0], "type", "veth", "peer", "name", veth[1]),
             ("link", "set", veth[0], "netns", names[0]), ("link", "set", veth[1], "netns", names[1]),
             ("-n", names[0], "addr", "add", f"{HEAD_IP}/24", "dev", veth[0]),
             ("-n", names[1], "addr", "add", f"{WORKER_IP}/24", "dev", veth[1]),
             ("-n", names[0], "link", "set", veth[0], "up"), ("-n", names[1], "link", "set", veth[1], "up"),
             ("-n", names[0], "link", "set", "lo", "up"), ("-n", names[1], "link", "set", "lo", "up")]
    made = Hosts(names)
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"network namespaces unavailable (`ip {' '.join(step)}`: {done.stderr.strip()}): the "
                            "multi-host runs are not exercised here (no fallback to Ray's single-host test cluster: "
                            "nothing would cross hosts)")
        yield made
    finally:
        for h in (0, 1):  # whatever a failed test left behind there is this test's own
            for pid in made.pids(h):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for name in names:
            _ip("netns", "del", name)
        _ip("link", "del", veth[0])


@pytest.fixture(scope="module")
def prepared(e2e_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model prepared once, so that both nodes' wrappers find it complete (they would not
    write the same directory at once)."""
    run = run_cli(["prepare", MODEL], ckpt_dir=e2e_ckpt, log_dir=tmp_path_factory.mktemp("prepare"), timeout_s=300)
    assert run.returncode == 0, run.describe()
    return e2e_ckpt


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """TMPDIR of the nodes: Ray's socket paths under it must stay short (AF_UNIX limit)."""
    path = Path(tempfile.mkdtemp(prefix="wst", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(ckpt: Path, log_dir: Path, tmp: Path, **extra: str) -> dict[str, str]:
    return run_env(ckpt, log_dir, {"TMPDIR": str(tmp), **extra})


def _start(hosts: Hosts, host: int, argv: list[str], env: dict[str, str], out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(hosts.cmd(host, argv), cwd=REPO_ROOT, env=env, stdout=out.open("w"),
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait(proc: subprocess.Popen[str], out: Path, timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"{proc.args} did not finish within {timeout_s} s; output:\n{out.read_text()[-4000:]}")
    return code, out.read_text()


@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
def test_wrappers_on_two_hosts(mode: str, hosts: Hosts, prepared: Path, tmp_path: Path, short_tmp: Path):
    log_dir = tmp_path / "logs"
    env = _env(prepared, log_dir, short_tmp)
    t0 = time.monotonic()
    head = _start(hosts, 0, ["bash", str(WRAPPER), mode, "0", HEAD_IP], env, tmp_path / "head.out")
    worker = _start(hosts, 1, ["bash", str(WRAPPER), mode, "1", HEAD_IP], env, tmp_path / "worker.out")
    head_code, head_out = _wait(head, tmp_path / "head.out")
    worker_code, worker_out = _wait(worker, tmp_path / "worker.out")
    results = log_dir / "results.json"
    run = RunOutcome(returncode=head_code, output=head_out, log_dir=log_dir,
                     results=json.loads(results.read_text()) if results.exists() else None)
    assert_run_passed(run, modes=[mode] * 4)  # the first update, then --num-rollout's default 3
    assert_bytes_exact(run, model_bytes(MODEL))
    assert worker_code == 0, worker_out[-3000:]
    assert "nothing to do" not in worker_out
    assert "node 1 of 2 (198.18.0.2): joining the Ray head at 198.18.0.1" in worker_out
    assert "it runs engine 0 here" in worker_out
    assert "the job ended on the head (finished)" in worker_out
    assert "left the cluster" in worker_out

    meta = run.meta
    where = meta["placement"]
    assert where["kind"] == "ray"
    assert where["nodes"] == {"0": HEAD_IP, "1": WORKER_IP}
    assert where["trainer_hosts"] == [HEAD_IP, HEAD_IP]
    assert [u.rsplit(":", 1)[0] for u in where["engine_urls"]] == [f"http://{WORKER_IP}"]
    assert where["engine_nodes"] == [1]
    if mode == "p2p":
        assert meta["transport"] == "mooncake"  # every pair crosses hosts: tcp on CPU
        assert where["engine_sessions"]
        assert all(s.startswith(f"{WORKER_IP}:") for s in where["engine_sessions"])
        # each trainer rank opened Mooncake on its own node's address, not loopback
        for rank in range(2):
            opened = [x for x in (log_dir / f"trainer{rank}.log").read_text().splitlines() if "Mooncake listeners" in x]
            assert opened, f"trainer rank {rank} logged no Mooncake session"
            assert all(x.endswith(f"({HEAD_IP})") for x in opened), opened
    # each node's processes logged under the run's directory on that node (one filesystem here)
    assert (log_dir / "engine0.log").stat().st_size > 0
    assert (log_dir / "trainer0.log").exists()
    assert (log_dir / "ray_node0" / "raylet.out").exists()
    assert (log_dir / "ray_node1" / "raylet.out").exists()
    left = hosts.wait_empty()
    assert not left, f"still running after the job ended: {left}"
    assert not list(short_tmp.glob("wsray*")), "every node removes its Ray temporary directory"
    print(f"{mode}: both nodes done in {time.monotonic() - t0:.1f} s")


def test_missing_node_is_named_by_the_deadline(hosts: Hosts, prepared: Path, tmp_path: Path, short_tmp: Path):
    log_dir = tmp_path / "logs"
    env = _env(prepared, log_dir, short_tmp, WEIGHTSYNC_NODE_TIMEOUT_S="5")
    t0 = time.monotonic()
    head = _start(hosts, 0, ["bash", str(WRAPPER), "p2p", "0", HEAD_IP], env, tmp_path / "head.out")
    code, out = _wait(head, tmp_path / "head.out", timeout_s=120)
    elapsed = time.monotonic() - t0
    assert code == 1, out[-3000:]
    assert f"1 of 2 nodes joined the Ray head at {HEAD_IP}:6379 within 5 s; missing node rank(s) 1" in out
    assert "WEIGHTSYNC_NODE_TIMEOUT_S" in out
    assert "Traceback" not in out
    left = hosts.wait_empty(timeout_s=10)
    assert not left, f"still running after the deadline error: {left}"
    assert not list(short_tmp.glob("wsray*"))
    assert not (log_dir / "results.json").exists()
    print(f"missing node: refused in {elapsed:.1f} s")


def test_worker_exits_1_when_the_head_goes_away(hosts: Hosts, prepared: Path, tmp_path: Path, short_tmp: Path):
    log_dir = tmp_path / "logs"
    env = _env(prepared, log_dir, short_tmp)
    head_out = tmp_path / "head.out"
    # the head's run itself (no wrapper in between), so that the process killed is the launcher
    head = _start(hosts, 0, [PYTHON, str(RUN_PY), "run", MODEL, "--node-rank", "0", "--head-ip", HEAD_IP,
                             "--num-rollout", "100"], env, head_out)
    worker = _start(hosts, 1, ["bash", str(WRAPPER), "p2p", "1", HEAD_IP], env, tmp_path / "worker.out")
    end = time.monotonic() + RUN_TIMEOUT_S
    while "step 1:" not in head_out.read_text():
        assert head.poll() is None, head_out.read_text()[-3000:]
        assert time.monotonic() < end, head_out.read_text()[-3000:]
        time.sleep(0.5)
    head.kill()  # mid-job, as a crash would
    head.wait()
    t0 = time.monotonic()
    code, out = _wait(worker, tmp_path / "worker.out", timeout_s=120)
    assert code == 1, out[-3000:]
    assert "node 1: the head" in out
    assert "went away mid-job" in out or "exited without ending the job" in out, out
    assert "stopping this node's Ray processes" in out
    left = hosts.wait_empty()
    assert not left, f"still running after the head went away: {left}"
    print(f"head killed: the worker left in {time.monotonic() - t0:.1f} s")


def test_a_killed_engine_on_the_worker_is_replaced_there(hosts: Hosts, prepared: Path, tmp_path: Path,
                                                         short_tmp: Path):
    log_dir = tmp_path / "logs"
    # engine 1 (of two on the worker: its replacement joins from the other) SIGKILLed as step 1 trains
    env = _env(prepared, log_dir, short_tmp, WEIGHTSYNC_FAULT_HOOK="tests.fault_hooks:kill_engine:1:1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p))
    argv = [PYTHON, str(RUN_PY), "run", MODEL, "--head-ip", HEAD_IP, "--mode", "p2p", "--train", "tp=1,ep=1,world=1",
            "--rollout", "tp=1,ep=1,engines=2", "--num-rollout", "1", "--replace-dead-engines"]
    t0 = time.monotonic()
    head = _start(hosts, 0, [*argv, "--node-rank", "0"], env, tmp_path / "head.out")
    worker = _start(hosts, 1, [*argv, "--node-rank", "1"], env, tmp_path / "worker.out")
    head_code, head_out = _wait(head, tmp_path / "head.out")
    worker_code, worker_out = _wait(worker, tmp_path / "worker.out")
    results = log_dir / "results.json"
    run = RunOutcome(returncode=head_code, output=head_out, log_dir=log_dir,
                     results=json.loads(results.read_text()) if results.exists() else None)
    assert_run_passed(run, modes=["p2p"] * 2)
    assert worker_code == 0, worker_out[-3000:]
    assert "the job ended on the head (finished)" in worker_out
    urls = run.meta["placement"]["engine_urls"]
    assert [u.rsplit(":", 1)[0] for u in urls] == [f"http://{WORKER_IP}"] * 2, urls
    line = next((ln for ln in head_out.splitlines() if ln.startswith("replaced engine 1")), "")
    assert line.startswith(f"replaced engine 1 before step 1's update: engine 1 ({urls[1]}, node 1) exited "
                           "(killed by SIGKILL)"), head_out[-3000:]
    assert line.endswith(f"joined from {urls[0]}"), line
    [r] = run.results["summary"]["engine_replacements"]
    assert (r["engine"], r["step"], r["version"], r["peer"]) == (1, 1, "0", urls[0]), r
    assert [len(s.get("replacements", [])) for s in run.steps] == [0, 1], run.steps
    assert run.meta["placement"]["engine_nodes"] == [1, 1]
    assert all(x.startswith(f"{WORKER_IP}:") for x in run.meta["placement"]["engine_sessions"])
    # on the second host (only there can it bind WORKER_IP), its log next to its predecessor's
    assert (log_dir / "engine1.log").stat().st_size > 0
    replacement = (log_dir / "engine1-replacement1.log").read_text()
    assert f"joining from {urls[0]}" in replacement, replacement[-3000:]
    assert f"running on {urls[1]}" in replacement, replacement[-3000:]
    left = hosts.wait_empty()
    assert not left, f"still running after the job ended: {left}"
    print(f"engine replaced on the worker: both nodes done in {time.monotonic() - t0:.1f} s")
