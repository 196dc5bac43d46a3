"""Process-local handles of a transport: connected peers, prepared write batches, issued writes.

None of these crosses a process boundary; the backends subclass them to carry what they opened
(a mapping, an IPC pointer) or the token of an issued write. Also the deadline helpers that
:meth:`~weightsync.transport.base.Transport.wait` speaks in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from weightsync.transport.records import PeerDescriptor
from weightsync.transport.region_table import RegionTable


def deadline_after(seconds: float) -> float:
    """The absolute deadline (``time.monotonic()`` clock) ``seconds`` from now, for :meth:`Transport.wait`."""
    return time.monotonic() + seconds


@dataclass(eq=False, kw_only=True)
class Peer:
    """A connected peer: its descriptor and what this process opened to reach it (local only)."""

    descriptor: PeerDescriptor
    table: RegionTable

    @property
    def session_id(self) -> str:
        return self.descriptor.session_id


@dataclass(eq=False, kw_only=True)
class MappedPeer(Peer):
    """A peer whose regions this process mapped at its own addresses (shm, cuda_ipc; local only)."""

    local_bases: np.ndarray
    """Per region of ``table``: where this process sees the region's first byte."""


@dataclass(eq=False, kw_only=True)
class WriteBatch:
    """A validated, coalesced write to one peer, ready to replay every step (local only).

    ``runs`` are in the backend's address space: destination addresses already translated.
    """

    peer: Peer
    runs: np.ndarray
    """``(N, 3)`` int64 ``[src, dst, nbytes]`` after coalescing and translation."""
    blocks: np.ndarray | None
    """``(M, 6)`` :func:`strided_blocks` of ``runs``, for backends that copy in 2-D."""
    nbytes: int

    @property
    def num_runs(self) -> int:
        return len(self.runs)


@dataclass(eq=False, kw_only=True)
class WriteHandle:
    """An issued write; pass it to :meth:`Transport.wait`. Subclasses carry the backend's token."""

    nbytes: int
    issued_at: float = field(default_factory=time.monotonic)
    done: bool = False


def timeout_message(kind: str, handle: WriteHandle, deadline: float) -> str:
    """The common text of a deadline expiry."""
    waited = time.monotonic() - handle.issued_at
    return (
        f"{kind} write of {handle.nbytes} bytes not complete at its deadline "
        f"({waited:.3f} s after issue, deadline passed {time.monotonic() - deadline:.3f} s ago); "
        f"the destination is now undefined: mark the receiver dirty and close this transport"
    )
