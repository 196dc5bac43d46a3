"""A byte-copying fake transport for orchestration tests: in-process, recorded, with injectable faults.

Not a registered kind: tests construct :class:`MockTransport` directly.

It copies bytes exactly like the local transport (so bit-exact checks hold), and records each
call as an event tuple so that tests can assert order, e.g.
``[e[0] for e in t.events] == ["register", "connect", "write", "wait", "close"]``. Faults:
``delay_s`` holds every write back (deadline tests), ``fail_on_write=k`` makes the k-th write
(0-based) fail at ``wait`` with RuntimeError, as a broken link would.

Typical usage::

    engine_side, trainer_side = MockTransport(), MockTransport()
    engine_side.register("params", arena.base, arena.nbytes)
    peer = trainer_side.connect(engine_side.descriptor())
    ...  # drive the sender under test with trainer_side
    assert [e[0] for e in trainer_side.events].count("write") == expected_buckets
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import numpy as np

from weightsync.transport._host import copy_blocks
from weightsync.transport.handles import Peer, WriteBatch, WriteHandle
from weightsync.transport.local import LocalHandle, LocalTransport
from weightsync.transport.records import PeerDescriptor, Region


class MockTransport(LocalTransport):
    """Recording, fault-injecting :class:`LocalTransport` on host memory (see module docstring)."""

    kind: ClassVar[str] = "mock"

    def __init__(self, *, delay_s: float = 0.0, fail_on_write: int | None = None) -> None:
        """Args:
        delay_s: seconds each write waits before copying.
        fail_on_write: 0-based index of the write that fails (its bytes are not copied).
        """
        super().__init__()
        self.delay_s = delay_s
        self.fail_on_write = fail_on_write
        self.events: list[tuple[str | int, ...]] = []
        self.bytes_written = 0
        self._num_writes = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-mock")

    def _register(self, region: Region) -> Region:
        self.events.append(("register", region.name, region.nbytes))
        return super()._register(region)

    def _connect(self, descriptor: PeerDescriptor) -> Peer:
        self.events.append(("connect", descriptor.session_id))
        return super()._connect(descriptor)

    def _copy(self, blocks: np.ndarray, fail: bool) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if fail:
            raise RuntimeError("mock transport: injected write failure")
        copy_blocks(blocks)

    def _submit(self, batch: WriteBatch) -> LocalHandle:
        assert batch.blocks is not None
        fail = self._num_writes == self.fail_on_write
        self._num_writes += 1
        self.bytes_written += batch.nbytes
        self.events.append(("write", batch.peer.session_id, batch.nbytes, batch.num_runs))
        return LocalHandle(nbytes=batch.nbytes, futures=[self._pool.submit(self._copy, batch.blocks, fail)])

    def _wait(self, handle: WriteHandle, deadline: float) -> None:
        self.events.append(("wait", handle.nbytes))
        super()._wait(handle, deadline)

    def _close(self) -> None:
        self.events.append(("close",))
        self._pool.shutdown(wait=True, cancel_futures=True)
        super()._close()
