"""Two-sided fallback transport over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

Unlike the other transports this one is **not one-sided**: for every ``write(peer, runs)`` the
receiver must post a matching ``post_recv(peer, runs)`` with the same runs in the same order
(the plan gives both sides the same op list) and then ``wait`` on it; a write whose receive is
never posted times out. Each write is one message: the sender packs its runs into one buffer
(or sends the single run in place), the receiver receives into one buffer and scatters it.
Messages between a pair are matched in issue order.

Both sides must be ranks of ``group`` (passed explicitly; its rank is the session id). After a
deadline expires the group is unusable (gloo closes the pair on a timed-out wait; with NCCL the
message may still be in flight): destroy it and build a new one, as after any collective timeout.

Typical usage (receiver rank 1, sender rank 0, same ``runs`` on both)::

    t = DistTransport(group=group)              # both
    t.register("params", arena.base, arena.nbytes)
    peer = t.connect(other_side_descriptor)
    h = t.write(peer, runs)          # sender
    h = t.post_recv(peer, runs)      # receiver
    t.wait(h, deadline_after(60))    # both
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from weightsync.transport._host import copy_blocks, host_tensor
from weightsync.transport.base import Transport
from weightsync.transport.handles import Peer, WriteBatch, WriteHandle, timeout_message
from weightsync.transport.records import HOST, Region, Run
from weightsync.transport.runs import as_runs, coalesce_runs


def dist_available() -> bool:
    """True when torch.distributed is built in."""
    return dist.is_available()


@dataclass(eq=False, kw_only=True)
class DistHandle(WriteHandle):
    work: Any
    """The torch.distributed ``Work`` of the send or receive."""
    buffer: torch.Tensor
    """The message buffer; kept alive until the operation completes."""
    scatter: np.ndarray | None = None
    """Receiver only: ``(N, 3)`` runs ``[buffer addr, dst, nbytes]`` to copy out after receipt."""


def _copy_runs(runs: np.ndarray, device: int) -> None:
    """Copy ``[src, dst, nbytes]`` runs within this process (host memcpy or device copies)."""
    if device == HOST:
        blocks = np.concatenate([runs, np.ones((len(runs), 1), np.int64), runs[:, 2:3], runs[:, 2:3]], axis=1)
        copy_blocks(blocks)
        return
    from weightsync.transport._cuda import device_tensor

    for s, d, n in runs.tolist():
        device_tensor(d, n, device).copy_(device_tensor(s, n, device))


class DistTransport(Transport):
    """Point-to-point send/recv over a torch.distributed group (see module docstring)."""

    kind: ClassVar[str] = "dist"
    one_sided: ClassVar[bool] = False
    supports_device_memory: ClassVar[bool] = True

    def __init__(self, *, group: dist.ProcessGroup, device: int = HOST) -> None:
        """Args:
        group: an initialized process group holding both sides (gloo for host memory,
            NCCL for device memory).
        device: HOST (gloo) or the CUDA device of this rank's registered memory (NCCL).
        """
        super().__init__()
        self.group, self.device = group, device
        self._rank = dist.get_rank(group)

    @property
    def session_id(self) -> str:
        return str(self._rank)

    def _register(self, region: Region) -> Region:
        if region.device != self.device:
            raise ValueError(
                f"region {region.name!r} is on {'host' if region.device == HOST else f'cuda:{region.device}'} "
                f"but this dist transport moves {'host' if self.device == HOST else f'cuda:{self.device}'} memory"
            )
        return region


    def _buffer(self, nbytes: int) -> torch.Tensor:
        device = "cpu" if self.device == HOST else f"cuda:{self.device}"
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _view(self, addr: int, nbytes: int) -> torch.Tensor:
        if self.device == HOST:
            return host_tensor(addr, nbytes)
        from weightsync.transport._cuda import device_tensor

        return device_tensor(addr, nbytes, self.device)

    def _submit(self, batch: WriteBatch) -> DistHandle:
        runs = batch.runs
        if len(runs) == 1:
            buf = self._view(int(runs[0, 0]), int(runs[0, 2]))
        else:
            buf = self._buffer(batch.nbytes)
            offsets = np.concatenate(([0], np.cumsum(runs[:, 2])[:-1]))
            _copy_runs(np.stack([runs[:, 0], buf.data_ptr() + offsets, runs[:, 2]], axis=1), self.device)
        work = dist.isend(buf, group_dst=int(batch.peer.session_id), group=self.group)
        return DistHandle(nbytes=batch.nbytes, work=work, buffer=buf)

    def post_recv(self, peer: Peer, runs: Sequence[Run] | np.ndarray) -> DistHandle:
        """Post the receive matching the peer's ``write(me, runs)``; complete it with :meth:`wait`.

        Args:
            peer: the sender, connected through its descriptor.
            runs: the same runs the sender writes: sources in the sender's regions,
                destinations in this side's regions.

        Raises:
            ValueError: a run outside the sender's or this side's regions.
        """
        self._check_open()
        arr = as_runs(runs)
        peer.table.locate(arr[:, 0], arr[:, 2], what=f"dist receive source on peer {peer.session_id!r}")
        dst_idx = self._local_table.locate(arr[:, 1], arr[:, 2], what="dist receive destination (this process)")
        # The message is the runs' bytes in order; coalescing by destination alone keeps that order.
        stream = np.concatenate(([1], 1 + np.cumsum(arr[:, 2])[:-1]))
        arr = coalesce_runs(np.stack([stream, arr[:, 1], arr[:, 2]], axis=1), keys=dst_idx)
        nbytes = int(arr[:, 2].sum())
        if len(arr) == 1:
            buf, scatter = self._view(int(arr[0, 1]), nbytes), None
        else:
            buf = self._buffer(nbytes)
            scatter = np.stack([buf.data_ptr() + arr[:, 0] - 1, arr[:, 1], arr[:, 2]], axis=1)
        work = dist.irecv(buf, group_src=int(peer.session_id), group=self.group)
        return DistHandle(nbytes=nbytes, work=work, buffer=buf, scatter=scatter)

    def _wait(self, handle: WriteHandle, deadline: float) -> None:
        assert isinstance(handle, DistHandle)
        if self.device == HOST:
            self._wait_gloo(handle, deadline)
        else:
            self._wait_nccl(handle, deadline)
        if handle.scatter is not None:
            _copy_runs(handle.scatter, self.device)
            handle.scatter = None
        if self.device != HOST:
            torch.cuda.current_stream(self.device).synchronize()

    def _wait_gloo(self, handle: DistHandle, deadline: float) -> None:
        # Gloo's send/recv work reports completion only through wait(), which takes a timeout
        # and, when it expires, raises RuntimeError("... Timed out waiting ...") and closes the
        # pair: the group is unusable afterwards (module docstring).
        remaining = max(deadline - time.monotonic(), 1e-3)
        try:
            handle.work.wait(timeout=timedelta(seconds=remaining))
        except RuntimeError as e:
            if "Timed out" not in str(e):
                raise
            raise TimeoutError(timeout_message(self.kind, handle, deadline)) from e

    def _wait_nccl(self, handle: DistHandle, deadline: float) -> None:
        # NCCL work completes asynchronously on its stream; poll it against the deadline.
        pause = 50e-6
        while not handle.work.is_completed():
            if time.monotonic() >= deadline:
                raise TimeoutError(timeout_message(self.kind, handle, deadline))
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
        handle.work.wait()  # raises the backend's error, if the operation failed

    def _close(self) -> None:
        # The group belongs to the caller, who destroys it; nothing here is registered outside it.
        pass
