"""Same-process transport: the writer and the destination share an address space (colocated).

Destination addresses are used as they are; copies are memcpy on a worker thread for host memory
(``device=HOST``) or ``cudaMemcpyAsync`` on a private stream of ``device`` (HBM-local when both
sides are on that GPU; host<->device copies work too, through unified addressing).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

from weightsync.transport._host import HostCopier, wait_futures
from weightsync.transport.base import Transport
from weightsync.transport.handles import WriteBatch, WriteHandle, timeout_message
from weightsync.transport.records import HOST, Region


@dataclass(eq=False, kw_only=True)
class LocalHandle(WriteHandle):
    futures: list[Future[None]] | None = None
    """Host copies in flight."""
    event: object | None = None
    """CUDA completion event (a ctypes pointer) of device copies."""


class LocalTransport(Transport):
    """Copies within one process; see the module docstring."""

    kind: ClassVar[str] = "local"
    same_process_only: ClassVar[bool] = True
    supports_device_memory: ClassVar[bool] = True
    uses_blocks: ClassVar[bool] = True

    @classmethod
    def config_options(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        device = HOST if cfg["cuda_device"] is None else cfg["cuda_device"]
        return {"device": device, "num_threads": cfg["shm_threads"]}

    def __init__(self, *, device: int = HOST, num_threads: int = 1) -> None:
        """Args:
        device: CUDA device whose stream runs the copies, or HOST for memcpy on threads.
        num_threads: host copy threads (device=HOST only).
        """
        super().__init__()
        self.device = device
        self._host: HostCopier | None = None
        self._dev = None
        if device == HOST:
            self._host = HostCopier(num_threads, name="weightsync-local")
        else:
            from weightsync.transport._cuda import CudaRuntime, DeviceCopier

            self._dev = DeviceCopier(CudaRuntime(), device)

    @property
    def session_id(self) -> str:
        return f"local:{os.getpid()}:{id(self):x}"

    def _register(self, region: Region) -> Region:
        if self.device == HOST and region.device != HOST:
            raise ValueError(
                f"local transport with device=HOST copies host memory; region {region.name!r} is on "
                f"cuda:{region.device}: construct it with device={region.device}"
            )
        return region


    def _submit(self, batch: WriteBatch) -> LocalHandle:
        assert batch.blocks is not None
        if self._host is not None:
            return LocalHandle(nbytes=batch.nbytes, futures=self._host.submit(batch.blocks))
        assert self._dev is not None
        return LocalHandle(nbytes=batch.nbytes, event=self._dev.submit(batch.blocks))

    def _wait(self, handle: WriteHandle, deadline: float) -> None:
        assert isinstance(handle, LocalHandle)
        if handle.futures is not None:
            done = wait_futures(handle.futures, deadline)
        else:
            assert self._dev is not None
            done = self._dev.wait(handle.event, deadline)
        if not done:
            raise TimeoutError(timeout_message(self.kind, handle, deadline))

    def _close(self) -> None:
        if self._host is not None:
            self._host.shutdown()
        if self._dev is not None:
            self._dev.close()
