"""In-process contract tests of the transports' failure behaviour and of the mock.

Contracts: a write outside a registered region fails with ValueError naming the region, on the
source side and on the destination side, before any byte moves; ``wait`` raises TimeoutError at
its deadline (and the same handle can still be waited to completion where the backend allows);
shm segments are unlinked by ``close`` (also while tensor views are alive) and stale segments of
dead owners can be removed; the mock copies bytes exactly, records events in order and injects
delays and failures.
"""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from tests.transport_mock import MockTransport
from weightsync.transport import deadline_after, make_transport
from weightsync.transport.mooncake import mooncake_available
from weightsync.transport.shm import SHM_DIR, SharedArena, list_segments, remove_stale_segments

MB = 1 << 20


def _make(kind: str):
    return MockTransport() if kind == "mock" else make_transport(kind)


def _pair(kind: str, nbytes: int):
    """Receiver and sender transports of ``kind`` in this process, connected; dest zeroed."""
    recv, send = _make(kind), _make(kind)
    arena = recv.new_arena(nbytes)
    dest = arena.empty((nbytes,), torch.uint8)
    dest.zero_()
    recv.register("params", arena.base, arena.nbytes)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    send.register_tensor("staging", src)
    return recv, send, send.connect(recv.descriptor()), src, dest


KINDS = [
    "shm",
    "mock",
    "local",
    pytest.param("mooncake", marks=pytest.mark.skipif(not mooncake_available(), reason="mooncake not importable")),
]


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_region_writes_name_the_region(kind: str) -> None:
    recv, send, peer, src, dest = _pair(kind, 4096)
    try:
        s, d = src.data_ptr(), recv.regions[0].addr
        with pytest.raises(ValueError, match=r"destination on peer .* crosses the end of region 'params'"):
            send.write(peer, [(s, d, 100), (s, d + 4000, 200)])
        with pytest.raises(ValueError, match=r"source \(this process\).* crosses the end of region 'staging'"):
            send.write(peer, [(s + 4000, d, 200)])
        with pytest.raises(ValueError, match=r"outside every registered region \(nearest: 'params'"):
            send.write(peer, [(s, d + (1 << 30), 8)])
        assert int(dest.sum()) == 0  # nothing moved
        send.wait(send.write(peer, [(s + 8, d + 16, 32)]), deadline_after(30))
        assert torch.equal(dest[16:48], src[8:40])
    finally:
        send.close()
        recv.close()


@pytest.mark.parametrize(
    "kind", ["shm", pytest.param("mooncake", marks=pytest.mark.skipif(not mooncake_available(), reason="no mooncake"))]
)
def test_deadline_expiry_raises_timeout(kind: str) -> None:
    """A deadline already past while a large write is in flight raises TimeoutError; waiting
    again with a later deadline completes it (the handle stays valid)."""
    size = 128 * MB if kind == "shm" else 32 * MB
    recv, send, peer, src, dest = _pair(kind, size)
    try:
        h = send.write(peer, [(src.data_ptr(), recv.regions[0].addr, size)])
        with pytest.raises(TimeoutError, match=rf"{kind} write of {size} bytes not complete at its deadline"):
            send.wait(h, time.monotonic() - 1.0)
        send.wait(h, deadline_after(60))
        assert torch.equal(dest, src)
    finally:
        send.close()
        recv.close()


def test_mock_records_events_and_injects_faults() -> None:
    recv = MockTransport()
    send = MockTransport(delay_s=0.2, fail_on_write=1)
    dest = torch.zeros(1024, dtype=torch.uint8)
    src = torch.arange(256, dtype=torch.uint8).repeat(4)
    recv.register_tensor("params", dest)
    send.register_tensor("staging", src)
    peer = send.connect(recv.descriptor())
    runs = [(src.data_ptr() + 10, dest.data_ptr() + 100, 50), (src.data_ptr() + 60, dest.data_ptr() + 150, 50)]
    h = send.write(peer, runs)
    with pytest.raises(TimeoutError):
        send.wait(h, deadline_after(0.01))
    send.wait(h, deadline_after(10))
    assert torch.equal(dest[100:200], src[10:110])
    assert int(dest[:100].sum()) == 0
    assert int(dest[200:].sum()) == 0
    h2 = send.write(peer, runs)
    with pytest.raises(RuntimeError, match="injected write failure"):
        send.wait(h2, deadline_after(10))
    send.close()
    recv.close()
    assert [e[0] for e in send.events] == ["register", "connect", "write", "wait", "wait", "write", "wait", "close"]
    assert send.events[2] == ("write", recv.session_id, 100, 1)  # the two runs coalesced
    assert send.bytes_written == 200


def test_shm_close_unlinks_even_with_live_views() -> None:
    t = make_transport("shm")
    arena = t.new_arena(MB)
    view = arena.empty((16,), torch.float32)
    view.fill_(1.5)
    seg = arena.segment
    assert seg in list_segments()
    t.close()
    t.close()  # idempotent
    assert seg not in list_segments()
    assert float(view.sum()) == 24.0  # the mapping outlives the name


def test_shm_connect_to_closed_segment_says_why() -> None:
    recv, send = make_transport("shm"), make_transport("shm")
    arena = recv.new_arena(MB)
    recv.register("params", arena.base, arena.nbytes)
    desc = recv.descriptor()
    recv.close()
    with pytest.raises(ValueError, match="does not exist: the owner closed it"):
        send.connect(desc)
    send.close()


def test_shm_refuses_device_arenas_and_unshared_destinations() -> None:
    with make_transport("shm") as t:
        with pytest.raises(ValueError, match="use cuda_ipc for GPU memory"):
            t.new_arena(MB, device="cuda:0")
        plain = torch.zeros(64, dtype=torch.uint8)
        t.register_tensor("plain", plain)
        assert t.descriptor().regions == ()  # source-only memory is not published


def test_remove_stale_segments() -> None:
    """A segment whose owner died (SIGKILL, no cleanup) is removed; live owners' are kept."""
    owner = subprocess.Popen(["true"])
    owner.wait()  # reaped: its pid names no process now
    dead = f"weightsync-{owner.pid}-0badc0ffee00"
    (SHM_DIR / dead).write_bytes(b"x")
    mine = SharedArena(4096)
    try:
        removed = remove_stale_segments()
        assert dead in removed
        assert not (SHM_DIR / dead).exists()
        assert mine.segment in list_segments()
    finally:
        mine.close()
