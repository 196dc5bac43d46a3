"""Arenas: one allocation per process side, parameters handed out as aligned views.

Allocating every parameter of an engine inside one arena means one registration, one published
region, one IPC handle or shm segment to open, instead of one per parameter. A backend whose
peers must open the destination memory themselves (shm) returns its own arena subclass from
:meth:`~weightsync.transport.base.Transport.new_arena`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_ALIGN = 256
"""Byte alignment of arena allocations: CUDA's allocation granularity for vectorized access."""


class Arena:
    """One block of memory from which parameters are carved as aligned tensor views.

    Allocating every parameter of an engine inside one arena means one registration, one
    published region, one IPC handle or shm segment to open, instead of one per parameter.
    """

    def __init__(self, storage: torch.Tensor, *, align: int = DEFAULT_ALIGN) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        if storage.data_ptr() % align:
            raise ValueError(f"arena memory at {storage.data_ptr():#x} is not {align}-byte aligned")
        self._buf = storage
        self.align = align
        self.used = 0

    @property
    def base(self) -> int:
        """Address of the first byte."""
        return self._buf.data_ptr()

    @property
    def nbytes(self) -> int:
        return self._buf.numel()

    @property
    def device(self) -> torch.device:
        return self._buf.device

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new uninitialized tensor of ``shape``/``dtype`` inside the arena, ``align``-aligned.

        Raises:
            ValueError: the arena is full; the message says how many bytes were asked and left.
        """
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * dtype.itemsize
        start = -(-self.used // self.align) * self.align
        if start + nbytes > self.nbytes:
            raise ValueError(
                f"arena of {self.nbytes} bytes is full: {nbytes} bytes asked at offset {start}; "
                f"size the arena with arena_bytes() over all parameters"
            )
        self.used = start + nbytes
        return self._buf[start : start + nbytes].view(dtype).view(tuple(int(s) for s in shape))

    def close(self) -> None:
        """Release what the arena holds beyond its tensors (shm: unlink the segment)."""


class TensorArena(Arena):
    """An arena in one ordinary torch allocation (host or CUDA)."""

    def __init__(self, nbytes: int, *, device: torch.device | str = "cpu", align: int = DEFAULT_ALIGN) -> None:
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes}")
        # Over-allocate so that the arena's first byte is aligned (CPU tensors are 64-aligned).
        raw = torch.empty(nbytes + align, dtype=torch.uint8, device=device)
        skip = -raw.data_ptr() % align
        super().__init__(raw[skip : skip + nbytes], align=align)


def arena_bytes(sizes: Sequence[int], *, align: int = DEFAULT_ALIGN) -> int:
    """Bytes an arena needs to hold tensors of ``sizes`` bytes, in order, each ``align``-aligned."""
    used = 0
    for n in sizes:
        used = -(-used // align) * align + int(n)
    return max(used, 1)
