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
