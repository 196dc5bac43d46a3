"""Copy byte runs and fingerprint them in one pass: one read of every byte instead of two.

A :class:`CopyFingerprintBatch` is built once from *rows* ``(source address, destination address,
count, element size, first, slot)`` -- "copy the ``count`` elements of ``element size`` bytes at
the source address to the destination address; they are elements ``first ..`` of the parameter
whose fingerprint accumulates in ``slot``" -- with two uint8 tensors whose first bytes are the
lowest addresses the rows read and write (the kernel's pointers; any memory the device can
dereference, peer memory opened over CUDA IPC included). :meth:`CopyFingerprintBatch.run` copies
every row and adds every row's partial fingerprint (:mod:`weightsync.fingerprint.hash`, the same
values as :class:`~weightsync.fingerprint.batch.FingerprintBatch` over the source) into a slot
vector, in one Triton launch per alignment class on the current stream.

Tables as :class:`~weightsync.fingerprint.batch.FingerprintBatch` builds its own: cut where an
element index crosses a multiple of 2^32; a row whose source and destination agree modulo 16 gives
an unaligned head, a 16-byte aligned body and an unaligned tail (other rows stay whole,
unaligned); pieces of at most ``chunk_bytes``, one program each.
"""

from __future__ import annotations

import numpy as np
import torch

from weightsync.fingerprint.batch import (
    ALIGN,
    BLOCK,
    CHUNK_BYTES,
    COUNT,
    ESIZE,
    FIRST,
    NUM_WARPS,
    OFFSET,
    SLOT,
    SOURCE,
    cut_spans,
    split_aligned,
    split_at_index_period,
)
from weightsync.fingerprint.hash import ELEMENT_SIZES, check_seed

COPY_FIELDS = 6
"""Columns of a row: source address, destination address, count, element size, first, slot."""


class CopyFingerprintBatch:
    """Rows prepared once; :meth:`run` copies them and adds their fingerprints (module docstring)."""

    def __init__(self, rows: np.ndarray, src_base: torch.Tensor, dst_base: torch.Tensor, *, num_slots: int,
                 chunk_bytes: int = CHUNK_BYTES, block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
        """Args:
        rows: ``(N, 6)`` int64 ``[src address, dst address, count, element size, first, slot]``.
        src_base: uint8 tensor at or below every source address, covering every row's bytes.
        dst_base: the same for the destinations.
        num_slots: the length of the slot vector :meth:`run` accumulates into.
        chunk_bytes: bytes per program (a multiple of 64).
        block: elements per program iteration (a power of two).
        num_warps: warps per program.

        Raises:
            ValueError: a row outside its base tensor, not aligned to its element size, of another
                element size than 1, 2 or 4, or of a slot outside ``[0, num_slots)``.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, COPY_FIELDS)
        rows = rows[rows[:, 2] > 0]
        self.num_slots, self.block, self.num_warps = num_slots, block, num_warps
        self.src_base, self.dst_base = src_base, dst_base
        self.device = src_base.device
        self.nbytes = int((rows[:, 2] * rows[:, 3]).sum()) if len(rows) else 0
        _check(rows, src_base, dst_base, num_slots)
        # as fingerprint spans: the source address in OFFSET, the destination's distance from it in SOURCE
        spans = np.stack([rows[:, 1] - rows[:, 0], rows[:, 0], rows[:, 2], rows[:, 3], rows[:, 4], rows[:, 5]], axis=1)
        spans = split_at_index_period(spans)
        bases_aligned = src_base.data_ptr() % ALIGN == 0 and dst_base.data_ptr() % ALIGN == 0
        same = (spans[:, SOURCE] % ALIGN == 0) & bases_aligned
        aligned, head_tail = split_aligned(spans[same], spans[same, OFFSET])
        self.tables: list[tuple[torch.Tensor, bool]] = []
        for part, is_aligned in ((aligned, True), (np.concatenate([head_tail, spans[~same]]), False)):
            if not len(part):
                continue
            part = cut_spans(part, chunk_bytes)
            table = np.stack([part[:, OFFSET] - src_base.data_ptr(),
                              part[:, OFFSET] + part[:, SOURCE] - dst_base.data_ptr(),
                              part[:, COUNT], part[:, ESIZE], part[:, FIRST], part[:, SLOT]], axis=1)
            self.tables.append((torch.from_numpy(np.ascontiguousarray(table)).to(self.device), is_aligned))

    def run(self, out: torch.Tensor, seed: int) -> None:
        """Copy every row and add its partial fingerprint into ``out[slot]`` (enqueued on the current
        stream: the copy is done, and ``out`` readable, after a synchronization).

        Args:
            out: int64 slot vector on the device (at least ``num_slots`` long).
            seed: the fingerprint's seed (:func:`~weightsync.fingerprint.hash.check_seed`).
        """
        check_seed(seed)
        if out.dtype != torch.int64 or out.numel() < self.num_slots or not out.is_contiguous():
            raise ValueError(f"the slot vector must be contiguous int64 of at least {self.num_slots} elements")
        from weightsync.fingerprint import _kernel  # imports Triton: only where the kernel runs

        for table, aligned in self.tables:
            _kernel.launch(table, self.src_base, self.dst_base, out, seed, block=self.block, aligned=aligned,
                           num_warps=self.num_warps, copy=True)


def _check(rows: np.ndarray, src_base: torch.Tensor, dst_base: torch.Tensor, num_slots: int) -> None:
    if not len(rows):
        return
    if src_base.dtype != torch.uint8 or dst_base.dtype != torch.uint8:
        raise ValueError("the base tensors of a copy batch are uint8")
    esize = rows[:, 3]
    nbytes = rows[:, 2] * esize
    problems = [(~np.isin(esize, ELEMENT_SIZES), "element sizes other than 1, 2 or 4 bytes")]
    for col, base, what in ((0, src_base, "source"), (1, dst_base, "destination")):
        lo, hi = base.data_ptr(), base.data_ptr() + base.numel()
        problems += [((rows[:, col] < lo) | (rows[:, col] + nbytes > hi), f"{what} ranges outside their base"),
                     (rows[:, col] % np.maximum(esize, 1) != 0, f"{what} ranges not aligned to their elements")]
    problems.append(((rows[:, 5] < 0) | (rows[:, 5] >= num_slots) | (rows[:, 4] < 0),
                     f"slots outside [0, {num_slots}) or negative element indices"))
    for bad, what in problems:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"copy fingerprint batch: {int(bad.sum())} rows with {what}, e.g. {rows[i].tolist()}")
