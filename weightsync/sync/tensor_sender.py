"""The colocated broadcast: full tensors handed to the engines through ``/update_weights_from_tensor``.

When trainer and engine ranks share GPUs, NCCL cannot put two ranks of one group on one GPU, so
the broadcast path uses the route colocated RL frameworks use (sglang's
``update_weights_from_tensor``): bucket by bucket, the stage source gathers the bucket's full HF
tensors in the engines' storage format (:meth:`BroadcastSender.wire_bucket`: the same gather and
conversion as the broadcast over a group) straight into one flat buffer (on a GPU kept across
steps; in host memory a new segment per bucket; a tensor converted on the way -- fp8, a cast -- is
copied in after its conversion), and hands the engines a description of that buffer -- each tensor
a view into it, pickled by torch's ``ForkingPickler`` (a CUDA IPC handle for GPU memory, a
shared-memory file name for host memory) -- with ``load_format`` None: a list of ``(name,
tensor)`` pairs, one entry per engine TP rank. Every engine rank opens the buffer in place and keeps
the pieces it owns (its own loading rule). The call returns once the engine has written every
tensor, so the buffer is reused for the next bucket.

Host memory is shared by file name (torch's ``file_system`` strategy, set only while pickling):
the default file-descriptor strategy passes descriptors through a socket that only processes of
one ``multiprocessing`` family may use, and an engine is an unrelated process.

Typical usage (every trainer rank; inside :class:`~weightsync.sync.updater.WeightUpdater`)::

    sender = TensorSender(gatherer, engines)
    stats = sender.send_bucket(bucket_names)        # collective over the trainer ranks
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import math
import time
from collections.abc import Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import torch

from weightsync.sync.broadcast_sender import BroadcastSender, announcement

if TYPE_CHECKING:
    from weightsync.sync.engines import Engines

log = logging.getLogger(__name__)

ALIGN = 256


@contextlib.contextmanager
def _share_host_memory_by_name() -> Iterator[None]:
    """torch's ``file_system`` sharing strategy for the duration (module docstring)."""
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(old)


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One ``serialized_named_tensors`` entry: base64 of a ``ForkingPickler`` dump of the pairs
    (sglang's ``MultiprocessingSerializer.serialize(..., output_str=True)``)."""
    buf = io.BytesIO()
    with _share_host_memory_by_name():
        ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("ascii")


class TensorSender:
    """One trainer rank's part of the colocated broadcast (module docstring)."""

    def __init__(self, gatherer: BroadcastSender, engines: Engines | None, *, tp: int) -> None:
        """Args:
            gatherer: this rank's :class:`BroadcastSender` (no weight-update group needed).
            engines: the engines (the stage sources call them; None on ranks that are no source).
            tp: ranks per engine (one entry each).
        """
        self.gatherer = gatherer
        self.engines = engines
        self.tp = tp
        self._flat = torch.empty(0, dtype=torch.uint8, device=gatherer.device)

    def _layout(self, names: Sequence[str]) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
        """Where each tensor of the bucket goes in the flat buffer (grown when the bucket needs
        more): ``{name: (offset, shape, dtype)}`` in the engines' storage format."""
        slots: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        size = 0
        for name, dtype, shape in zip(*announcement(self.gatherer.inputs, names), strict=True):
            dt = getattr(torch, dtype)
            slots[name] = (size, tuple(shape), dt)
            size = -(-(size + math.prod(shape) * dt.itemsize) // ALIGN) * ALIGN
        # Host memory: a new shared segment per bucket. torch unlinks a segment shared by name once
        # the engine has closed it (the engine holds the last registered reference), so a buffer
        # kept across buckets would be gone at the next call. GPU memory: one buffer, kept.
        if size > self._flat.numel() or self._flat.device.type == "cpu":
            self._flat = torch.empty(size, dtype=torch.uint8, device=self.gatherer.device)
        return slots

    def _slot(self, slots: dict[str, tuple[int, tuple[int, ...], torch.dtype]], name: str) -> torch.Tensor:
        off, shape, dtype = slots[name]
        return self._flat[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def _pack(self, tensors: Sequence[tuple[str, torch.Tensor]],
              slots: dict[str, tuple[int, tuple[int, ...], torch.dtype]]) -> list[tuple[str, torch.Tensor]]:
        """The tensors as views of the flat buffer: those gathered there already as they are, the
        converted ones copied in."""
        views = []
        for name, t in tensors:
            view = self._slot(slots, name)
            if view.data_ptr() != t.data_ptr():
                view.copy_(t)
            views.append((name, view))
        if self._flat.is_cuda:
            torch.cuda.current_stream().synchronize()
        return views

    def send_bucket(self, names: Sequence[str]) -> dict[str, Any]:
        """Gather, convert and hand over one bucket (collective over the trainer ranks).

        Returns:
            ``{"pack_s", "wire_s", "bytes"}`` of this rank (sources: the bucket's bytes, which
            every engine rank reads; wire is the engines' call, which includes their load).

        Raises:
            EngineError: an engine refused the tensors (named).
        """
        t0 = time.perf_counter()
        wire_s = 0.0
        sent = 0
        slots = self._layout(names) if self.gatherer.is_source else {}

        def alloc(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            slot = slots.get(name)
            if slot is not None and (slot[1], slot[2]) == (shape, dtype):  # goes out as it is gathered
                return self._slot(slots, name)
            return torch.empty(shape, dtype=dtype, device=self.gatherer.device)

        for _, tensors in self.gatherer.wire_bucket(names, alloc=alloc):
            if not tensors:
                continue
            views = self._pack(tensors, slots)
            entry = serialize_named_tensors(views)
            tw = time.perf_counter()
            assert self.engines is not None, "a stage source needs the engines"
            self.engines.each(lambda c, e=entry: c.update_weights_from_tensor([e] * self.tp),
                              what="/update_weights_from_tensor")
            wire_s += time.perf_counter() - tw
            sent += sum(t.numel() * t.element_size() for _, t in views)
        return {"pack_s": time.perf_counter() - t0 - wire_s, "wire_s": wire_s, "bytes": sent}

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the flat buffer this rank keeps (0 on ranks that are no source)."""
        return self._flat.numel()

    def close(self) -> None:
        self._flat = torch.empty(0, dtype=torch.uint8)
