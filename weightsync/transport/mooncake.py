"""Cross-host transport: Mooncake TransferEngine (RDMA, or TCP where there is no RDMA).

Each process runs one TransferEngine in P2PHANDSHAKE mode (no metadata server: peers exchange
segment descriptors directly over the engine's RPC port); its session id is ``"host:rpc_port"``.
Memory is registered once with ``register_memory``; a write is one
``batch_transfer_sync_write(session, srcs, dsts, lengths)`` (the engine's batch API; it releases
the GIL) issued on a worker thread, so :meth:`MooncakeTransport.write` returns at once and
:meth:`~MooncakeTransport.wait` applies the deadline. Destination addresses are the receiver's
own pointers (Mooncake addresses remote memory by virtual address).

Protocol (``tcp``, ``rdma``, ...) and device (an RDMA NIC name such as ``mlx5_0``, or empty) are
constructor arguments (:class:`~weightsync.transport.config.TransportConfig` carries them; the
launcher fills them from ``MOONCAKE_PROTOCOL`` and ``MOONCAKE_DEVICE``). The Mooncake package is
imported lazily: importing this module works without it (see :func:`mooncake_available`).

Measured on the 2-core CPU machine (tcp, 127.0.0.1): see scripts/bench_transport.py. Same-host
CPU traffic belongs on shm; this is for other hosts.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

from weightsync.transport.base import Transport
from weightsync.transport.handles import WriteBatch, WriteHandle, timeout_message
from weightsync.transport.records import Region

P2P_HANDSHAKE = "P2PHANDSHAKE"
DEFAULT_PROTOCOL = "tcp"


@functools.cache
def mooncake_available() -> bool:
    """True when ``mooncake.engine`` imports (package and its system libraries are installed)."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


def _engine_class() -> Any:
    if not mooncake_available():
        raise RuntimeError(
            "mooncake transport needs the Mooncake TransferEngine: pip install "
            "mooncake-transfer-engine-non-cuda (needs the Debian packages libibverbs1 librdmacm1 ibverbs-providers)"
        )
    from mooncake.engine import TransferEngine

    return TransferEngine


@dataclass(eq=False, kw_only=True)
class MooncakeHandle(WriteHandle):
    future: Future[int]
    session_id: str


class MooncakeTransport(Transport):
    """One-sided writes through a Mooncake TransferEngine (see module docstring)."""

    kind: ClassVar[str] = "mooncake"

    def __init__(self, *, protocol: str = DEFAULT_PROTOCOL, device: str = "", hostname: str = "127.0.0.1") -> None:
        """Args:
        protocol: Mooncake transport protocol (``tcp``, ``rdma``, ...).
        device: RDMA device name(s) for ``rdma`` (``mlx5_0``); empty for ``tcp``.
        hostname: this host's address as peers reach it (an IP on multi-host runs).

        Raises:
            RuntimeError: Mooncake is missing or the engine fails to start.
        """
        super().__init__()
        self.protocol, self.device, self.hostname = protocol, device, hostname
        self._engine = _engine_class()()
        ret = self._engine.initialize(hostname, P2P_HANDSHAKE, protocol, device)
        if ret != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}, {device!r}) "
                f"returned {ret}: check the protocol/device (MOONCAKE_PROTOCOL, MOONCAKE_DEVICE)"
            )
        self._port = int(self._engine.get_rpc_port())
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-mooncake")

    @property
    def session_id(self) -> str:
        return f"{self.hostname}:{self._port}"

    def _register(self, region: Region) -> Region:
        ret = self._engine.register_memory(region.addr, region.nbytes)
        if ret != 0:
            raise RuntimeError(
                f"Mooncake register_memory of region {region.name!r} "
                f"({region.nbytes} bytes at {region.addr:#x}) returned {ret}"
            )
        return region


    def _submit(self, batch: WriteBatch) -> MooncakeHandle:
        src, dst, n = (col.tolist() for col in batch.runs.T)
        session = batch.peer.session_id
        future = self._pool.submit(self._engine.batch_transfer_sync_write, session, src, dst, n)
        return MooncakeHandle(nbytes=batch.nbytes, future=future, session_id=session)

    def _wait(self, handle: WriteHandle, deadline: float) -> None:
        assert isinstance(handle, MooncakeHandle)
        try:
            ret = handle.future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise TimeoutError(timeout_message(self.kind, handle, deadline)) from None
        if ret != 0:
            raise RuntimeError(
                f"Mooncake batch_transfer_sync_write to {handle.session_id!r} ({handle.nbytes} bytes) returned {ret}: "
                f"the peer is unreachable or rejected an address (see the engine log above)"
            )

    def _close(self) -> None:
        # Wait for a transfer still in flight (bounded by Mooncake's own transfer timeout)
        # before unregistering the memory it reads.
        self._pool.shutdown(wait=True, cancel_futures=True)
        errors = []
        for r in self.regions:
            ret = self._engine.unregister_memory(r.addr)
            if ret != 0:
                errors.append(f"{r.name!r} ({ret})")
        self._engine = None
        if errors:
            raise RuntimeError(f"Mooncake unregister_memory failed for regions {', '.join(errors)}")
