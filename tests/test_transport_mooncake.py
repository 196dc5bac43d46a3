"""Contract of the Mooncake transport's asynchronous writes.

* Up to ``workers`` batches are in flight at once: four writes whose batches each take 0.3 s
  from their submit finish in about 0.3 s with ``workers=4`` and about 1.2 s with 1 (a fake
  TransferEngine that records the overlap).
* A write that misses its deadline raises ``TimeoutError`` and ``close()`` returns at once
  without unregistering the memory the abandoned batch may still read -- with a fake batch that
  never finishes, and with a real Mooncake tcp write into a receiver process that is stopped
  (SIGSTOP) mid-transfer.
* A failed submit (Mooncake's batch id 0) is a ``RuntimeError`` naming the peer; a write still
  running at ``close()`` is waited for, then the memory is unregistered.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch

from weightsync.transport import PeerDescriptor, Region, deadline_after
from weightsync.transport.mooncake import MooncakeTransport, mooncake_available

PEER = "10.0.0.9:15001"
DST = 1 << 30


class FakeEngine:
    """A TransferEngine whose batches each take ``seconds`` from their submit (forever when None),
    as Mooncake's do: they move concurrently once submitted. Records how many overlapped."""

    def __init__(self, seconds: float | None = 0.3, batch_id: int = 1) -> None:
        self.seconds = seconds
        self.batch_id = batch_id
        self.ends: dict[int, float] = {}
        self.max_active = 0
        self.unregistered: list[int] = []
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> FakeEngine:
        return self

    def initialize(self, *args: Any) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 15000

    def register_memory(self, addr: int, nbytes: int) -> int:
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.unregistered.append(addr)
        return 0

    @property
    def active(self) -> int:
        now = time.monotonic()
        with self._lock:
            return sum(end > now for end in self.ends.values())

    def batch_transfer_async_write(self, session: str, src: list[int], dst: list[int], n: list[int]) -> int:
        if not self.batch_id:
            return 0
        with self._lock:
            bid = len(self.ends) + 1
            self.ends[bid] = time.monotonic() + (self.seconds if self.seconds is not None else 1e9)
        self.max_active = max(self.max_active, self.active)
        return bid

    def get_batch_transfer_status(self, ids: list[int]) -> int:
        if self.seconds is None:
            self.release.wait()
            return 0
        time.sleep(max(max(self.ends[i] for i in ids) - time.monotonic(), 0.0))
        return 0


def _transport(engine: FakeEngine, **kw: Any) -> tuple[MooncakeTransport, Any, torch.Tensor]:
    t = MooncakeTransport(engine_factory=engine, **kw)
    src = torch.zeros(4096, dtype=torch.uint8)
    t.register_tensor("src", src)
    peer = t.connect(PeerDescriptor(kind="mooncake", session_id=PEER, host_id="", pid=0,
                                    regions=(Region(name="dst", addr=DST, nbytes=1 << 20),)))
    return t, peer, src


@pytest.mark.parametrize(("workers", "low", "high"), [(4, 0.25, 1.05), (1, 1.15, 5.0)])
def test_batches_in_flight_at_once(workers: int, low: float, high: float) -> None:
    engine = FakeEngine(seconds=0.3)
    t, peer, src = _transport(engine, workers=workers)
    t0 = time.monotonic()
    handles = [t.write(peer, [(src.data_ptr() + 1024 * i, DST + 1024 * i, 1024)]) for i in range(4)]
    issued = time.monotonic() - t0
    for h in handles:
        t.wait(h, deadline_after(10))
    took = time.monotonic() - t0
    t.close()
    assert issued < 0.1, "write() only queues"
    assert engine.max_active == workers
    assert low <= took <= high


def test_timed_out_write_does_not_hang_close() -> None:
    engine = FakeEngine(seconds=None)
    t, peer, src = _transport(engine, close_grace_s=30.0)
    h = t.write(peer, [(src.data_ptr(), DST, 4096)])
    with pytest.raises(TimeoutError, match="not complete at its deadline"):
        t.wait(h, deadline_after(0.2))
    t0 = time.monotonic()
    t.close()
    assert time.monotonic() - t0 < 1.0, "close() waited for a write that had already timed out"
    assert engine.unregistered == [], "memory an abandoned batch may read stays registered"
    engine.release.set()


def test_failed_submit_names_the_peer_and_close_waits_for_running_writes() -> None:
    t, peer, src = _transport(FakeEngine(batch_id=0))
    with pytest.raises(RuntimeError, match=PEER):
        t.wait(t.write(peer, [(src.data_ptr(), DST, 64)]), deadline_after(5))
    t.close()
    engine = FakeEngine(seconds=0.3)
    t, peer, src = _transport(engine)
    t.write(peer, [(src.data_ptr(), DST, 64)])
    time.sleep(0.05)
    t.close()
    assert engine.max_active == 1
    assert engine.active == 0, "close() waited for the running write"
    assert engine.unregistered == [src.data_ptr()]


_RECEIVER = textwrap.dedent("""
    import json, sys, torch
    from weightsync.transport import make_transport
    t = make_transport("mooncake", protocol="tcp", hostname="127.0.0.1")
    dst = torch.zeros(int(sys.argv[1]), dtype=torch.uint8)
    t.register_tensor("dst", dst)
    print(json.dumps(t.descriptor().to_json()), flush=True)
    sys.stdin.readline()
""")


@pytest.mark.skipif(not mooncake_available(), reason="mooncake.engine is not importable")
@pytest.mark.timeout(120)
def test_real_write_into_a_stopped_receiver_times_out_and_close_returns() -> None:
    size = 64 << 20
    proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(size)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        desc = PeerDescriptor.from_json(json.loads(proc.stdout.readline()))
        t = MooncakeTransport(protocol="tcp", hostname="127.0.0.1", close_grace_s=30.0)
        src = torch.ones(size, dtype=torch.uint8)
        t.register_tensor("src", src)
        peer = t.connect(desc)
        dst = desc.region("dst").addr
        t.wait(t.write(peer, [(src.data_ptr(), dst, 1 << 20)]), deadline_after(60))  # connected and working
        os.kill(proc.pid, signal.SIGSTOP)
        chunk = 1 << 20
        h = t.write(peer, [(src.data_ptr() + i, dst + i, chunk) for i in range(0, size, chunk)])
        with pytest.raises(TimeoutError):
            t.wait(h, deadline_after(2.0))
        t0 = time.monotonic()
        t.close()
        assert time.monotonic() - t0 < 2.0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


# -- the protocol --------------------------------------------------------------------------------


def _ports(root: Any, states: dict[str, str]) -> Any:
    """A fake ``/sys/class/infiniband``: ``{"mlx5_0:1": "4: ACTIVE", ...}``."""
    for where, state in states.items():
        dev, port = where.split(":")
        d = root / dev / "ports" / port
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
    return root


PROTOCOL_CASES = [
    # (asked, device filter, ports, MC_FORCE_TCP, chosen, said)
    ("auto", "", {}, "", "tcp", "no RDMA port is ACTIVE"),
    ("auto", "", {"mlx5_0:1": "1: DOWN"}, "", "tcp", "no RDMA port is ACTIVE"),
    ("auto", "", {"mlx5_0:1": "1: DOWN", "mlx5_1:1": "4: ACTIVE"}, "", "rdma", "mlx5_1:1 active"),
    ("auto", "mlx5_0", {"mlx5_1:1": "4: ACTIVE"}, "", "tcp", "(devices mlx5_0)"),
    ("auto", "", {"mlx5_0:1": "4: ACTIVE"}, "1", "tcp", "MC_FORCE_TCP is set"),
    ("rdma", "", {}, "", "tcp", "rdma asked for, but no RDMA port is ACTIVE"),
    ("rdma", "mlx5_0,mlx5_1", {"mlx5_1:1": "4: ACTIVE"}, "", "rdma", "mlx5_1:1 active"),
    ("tcp", "", {"mlx5_0:1": "4: ACTIVE"}, "", "tcp", "tcp asked for"),
]


@pytest.mark.parametrize(("asked", "device", "ports", "force", "chosen", "said"), PROTOCOL_CASES)
def test_the_protocol_is_mooncakes_own_choice(tmp_path: Any, asked: str, device: str, ports: dict[str, str],
                                              force: str, chosen: str, said: str) -> None:
    """Mooncake runs RDMA iff a port of its device filter is ACTIVE, TCP under ``MC_FORCE_TCP``
    (``transfer_engine_impl.cpp``, ``topology.cpp``): ``auto`` says which, in one line."""
    from weightsync.transport.mooncake import choose_protocol

    got, why = choose_protocol(asked, device, environ={"MC_FORCE_TCP": force}, root=_ports(tmp_path / "ib", ports))
    assert got == chosen
    assert said in why
    assert "\n" not in why


def test_an_unknown_protocol_is_refused() -> None:
    from weightsync.transport.config import TransportConfig
    from weightsync.transport.mooncake import choose_protocol

    with pytest.raises(ValueError, match="choose one of auto, tcp, rdma"):
        choose_protocol("efa")
    with pytest.raises(ValueError, match="mooncake_protocol must be auto, tcp or rdma"):
        TransportConfig(kind="mooncake", mooncake_protocol="roce")


def test_the_engine_is_initialized_with_the_chosen_protocol(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from weightsync.transport import mooncake as mod

    seen: list[tuple[Any, ...]] = []

    class Recording(FakeEngine):
        def initialize(self, *args: Any) -> int:
            seen.append(args)
            return 0

    monkeypatch.setattr(mod, "IB_SYSFS", mod.Path("/nonexistent/infiniband"))  # a host without RDMA
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    mod._say.cache_clear()
    with caplog.at_level("WARNING"):
        for _ in range(2):
            t = MooncakeTransport(engine_factory=Recording(), protocol="auto", hostname="127.0.0.1")
            assert t.protocol == "tcp"
            t.close()
    assert [a[2] for a in seen] == ["tcp", "tcp"]
    said = [r.getMessage() for r in caplog.records if "no RDMA port is ACTIVE" in r.getMessage()]
    assert len(said) == 1, "said once per process"


def test_gpu_memory_needs_mooncakes_cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The non-CUDA build cannot register GPU memory: refused before Mooncake is asked, naming
    the build to install; a CUDA build serves it."""
    from weightsync.transport import mooncake as mod

    t = MooncakeTransport(engine_factory=FakeEngine(), protocol="tcp", hostname="127.0.0.1")
    try:
        monkeypatch.setattr(mod, "mooncake_build", lambda: "mooncake-transfer-engine-non-cuda")
        assert not MooncakeTransport.serves("cuda")
        with pytest.raises(ValueError, match=r"on cuda:0 \(the installed Mooncake is mooncake-transfer-engine-non-cuda"
                                             r"; GPU memory needs mooncake-transfer-engine-cuda13==0.3.14"):
            t.register("params", 1 << 20, 4096, device=0)
        monkeypatch.setattr(mod, "mooncake_build", lambda: "mooncake-transfer-engine-cuda13")
        assert MooncakeTransport.serves("cuda")
        assert t.register("params", 1 << 20, 4096, device=0).device == 0
    finally:
        t.close()


@pytest.mark.skipif(not mooncake_available(), reason="mooncake.engine is not importable")
@pytest.mark.timeout(180)
def test_the_gpu_check_script_writes_and_verifies(repo_root: Any, tmp_path: Any) -> None:
    """scripts/gpu_mooncake_check.py (the GPU machine's check), run on host memory: two processes,
    every byte written and compared, the protocol chosen and said, JSON out."""
    out = tmp_path / "mc.json"
    proc = subprocess.run([sys.executable, str(repo_root / "scripts" / "gpu_mooncake_check.py"), "--device", "cpu",
                           "--size-mb", "2", "--iters", "2", "--timeout-s", "120", "--out", str(out)],
                          capture_output=True, text=True, timeout=170, check=False)
    report = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["ok"] is True
    assert report["bytes_equal"] is True
    assert report["protocol"] in ("tcp", "rdma")
    assert report["reason"]
    assert len(report["seconds"]) == 2


@pytest.mark.skipif(not mooncake_available(), reason="mooncake.engine is not importable")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
@pytest.mark.timeout(180)
def test_the_gpu_check_script_says_no_cuda_and_checks_host_memory_instead(repo_root: Any, tmp_path: Any) -> None:
    """Without CUDA the GPU check is not passed off as done: ok false, 'no CUDA: <why>', exit 1,
    and the CPU-memory check's own report beside it."""
    out = tmp_path / "mc.json"
    proc = subprocess.run([sys.executable, str(repo_root / "scripts" / "gpu_mooncake_check.py"), "--size-mb", "2",
                           "--iters", "1", "--timeout-s", "120", "--out", str(out)],
                          capture_output=True, text=True, timeout=170, check=False)
    report = json.loads(out.read_text())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert report["ok"] is False
    assert report["device"] == "cuda"
    assert report["error"].startswith("no CUDA: ")
    assert "no CUDA" in proc.stdout
    assert report["cpu_fallback"]["ok"] is True
    assert report["cpu_fallback"]["bytes_equal"] is True
