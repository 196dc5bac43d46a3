"""Fingerprints of many element ranges of many tensors, summed into slots, in one pass.

A :class:`FingerprintBatch` is built once from *spans*: ``(source, byte offset, count, element
size, first, slot)`` -- "the ``count`` elements of ``element size`` bytes at ``byte offset`` of
tensor ``source`` are elements ``first ..`` of the parameter whose fingerprint accumulates in
``slot``". The source may be the parameter itself (the engine hashing what it holds; a trainer
rank hashing a run it writes straight from its own parameter) or any buffer holding the bytes that
land there (a trainer rank's packed staging bucket). :meth:`FingerprintBatch.run` adds every
span's partial (:mod:`weightsync.fingerprint.hash`) into an int64 vector of slots on the sources'
device; two batches run into the same vector add up, as partials of disjoint ranges do.

Two executions with the same results:

* ``kernel`` (a CUDA device with Triton): the spans are cut into chunks of at most
  ``chunk_bytes`` (and where an element index crosses a multiple of 2^32) and written once into a
  device table; one Triton launch per alignment class
  (16-byte aligned bodies, and the unaligned heads and tails around them: at most two launches
  per batch, whatever the number of tensors, ranges and dtypes) hashes every chunk and adds its
  sum into its slot with one atomic add (:mod:`weightsync.fingerprint._kernel`). Offsets are
  relative to one 16-byte aligned source's address, passed as the kernel's pointer.
* ``torch`` (a GPU without Triton) and ``numpy`` (the CPU): the spans, grouped by source and
  element size into slabs of at most :data:`SLAB` (torch) or :data:`NUMPY_SLAB` (numpy) elements,
  each gathered, hashed and summed into its slots by a fixed number of vectorized ops, however
  many spans it holds (:func:`~weightsync.fingerprint.hash.hash_elements` and ``index_add_``;
  :func:`~weightsync.fingerprint.hash.hash_elements_np` and ``reduceat``).

Legend: ``R`` spans, ``K`` chunks, ``S`` slots.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weightsync.fingerprint.hash import ELEMENT_SIZES, INT_DTYPES, check_seed, hash_elements, hash_elements_np

log = logging.getLogger(__name__)

SOURCE, OFFSET, COUNT, ESIZE, FIRST, SLOT = range(6)
SPAN_FIELDS = 6
"""Columns of a span row (int64)."""
METHODS = ("kernel", "torch", "numpy")
CHUNK_BYTES = 256 << 10
"""Bytes per Triton program (a multiple of 64, so an aligned body's chunks stay aligned): the best
of the H200 sweep over Qwen3-4B's parameters (1,635-1,640 GB/s against 1,605-1,628 at 64 KiB, with
the kernel of then), a quarter of the atomic adds."""
BLOCK = 1024
"""Elements per program iteration."""
NUM_WARPS = 4
SLAB = 1 << 20
"""Elements hashed per group of torch ops (bounds the temporaries: a few 8-byte vectors of this size)."""
NUMPY_SLAB = 1 << 15
"""Elements per group of numpy ops: temporaries that stay in a core's L2 cache (on the 2-core
machine, 1 << 14 to 1 << 16 hashed 87-99 M elements/s, 1 << 20 only 23 M)."""
ALIGN = 16
INDEX_PERIOD = 1 << 32
"""No kernel program hashes elements on both sides of a multiple of this index (the kernel folds
the index's high half into its seed once)."""


def triton_available() -> bool:
    """Whether Triton can be imported (the ``kernel`` method needs it, and a GPU unless Triton's
    interpreter runs it on the CPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_method(device: torch.device) -> str:
    """``kernel`` on a CUDA device where Triton is importable, ``torch`` on one without, ``numpy``
    on the CPU."""
    if device.type == "cpu":
        return "numpy"
    return "kernel" if triton_available() else "torch"


def cut_spans(spans: np.ndarray, max_bytes: int) -> np.ndarray:
    """Cut every span into pieces of at most ``max_bytes`` (whole elements; order kept)."""
    if len(spans) == 0:
        return spans.reshape(0, SPAN_FIELDS)
    limit = np.maximum(max_bytes // spans[:, ESIZE], 1)
    pieces = -(-spans[:, COUNT] // limit)
    idx = np.repeat(np.arange(len(spans)), pieces)
    k = np.arange(len(idx), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    out = spans[idx].copy()
    step = k * limit[idx]
    out[:, OFFSET] += step * spans[idx, ESIZE]
    out[:, FIRST] += step
    out[:, COUNT] = np.minimum(spans[idx, COUNT] - step, limit[idx])
    return out


def split_at_index_period(spans: np.ndarray, period: int = INDEX_PERIOD) -> np.ndarray:
    """Cut every span where its element index crosses a multiple of ``period`` (same elements;
    order kept): the kernel takes an index's high half as its program's."""
    if len(spans) == 0:
        return spans.reshape(0, SPAN_FIELDS)
    first, count = spans[:, FIRST], spans[:, COUNT]
    head = np.minimum(count, period - first % period)
    pieces = 1 + -(-(count - head) // period)
    idx = np.repeat(np.arange(len(spans)), pieces)
    k = np.arange(len(idx), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = np.where(k == 0, 0, head[idx] + (k - 1) * period)
    out = spans[idx].copy()
    out[:, OFFSET] += start * spans[idx, ESIZE]
    out[:, FIRST] += start
    out[:, COUNT] = np.where(k == 0, head[idx], np.minimum(period, count[idx] - start))
    return out


def split_aligned(spans: np.ndarray, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(aligned, unaligned)`` spans with the same elements: each span gives an unaligned head up
    to the first 16-byte boundary of its address (``addrs``, one per span), an aligned body of a
    multiple of 16 elements, and an unaligned tail."""
    if len(spans) == 0:
        return spans.reshape(0, SPAN_FIELDS), spans.reshape(0, SPAN_FIELDS)
    esize, count = spans[:, ESIZE], spans[:, COUNT]
    head = np.minimum(((-addrs) % ALIGN) // esize, count)
    body = (count - head) // ALIGN * ALIGN
    parts = []
    for start, n in ((0, head), (head, body), (head + body, count - head - body)):
        part = spans.copy()
        part[:, OFFSET] += start * esize
        part[:, FIRST] += start
        part[:, COUNT] = n
        parts.append(part[n > 0])
    return parts[1], np.concatenate([parts[0], parts[2]])


@dataclass(frozen=True, kw_only=True, slots=True)
class _Slab:
    """Chunks of one source and element size hashed by one group of host (numpy) or torch ops."""

    view: torch.Tensor
    """The source as integers of the element size."""
    rows: np.ndarray
    """``(R, 6)`` span rows, their offsets in elements of ``view``."""
    device_rows: torch.Tensor | None
    """``(R, 4)`` int64 ``[element offset, count, first, slot]`` on the device (``torch`` only)."""
    total: int
    mask: int


class FingerprintBatch:
    """Spans prepared once; :meth:`run` adds their partial fingerprints into slots (module docstring)."""

    def __init__(self, sources: Sequence[torch.Tensor], spans: np.ndarray, *, num_slots: int,
                 method: str | None = None, chunk_bytes: int = CHUNK_BYTES, block: int = BLOCK,
                 num_warps: int = NUM_WARPS) -> None:
        """Args:
        sources: the tensors the spans read (contiguous, one device; kept referenced, so they
            must stay allocated -- their contents may change between runs).
        spans: ``(R, 6)`` int64 rows ``[source, byte offset, count, element size, first, slot]``.
        num_slots: the length of the slot vector :meth:`run` accumulates into.
        method: one of :data:`METHODS`; default :func:`default_method` of the sources' device.
        chunk_bytes: bytes per Triton program (a multiple of 64).
        block: elements per Triton program iteration (a power of two).
        num_warps: warps per Triton program.

        Raises:
            ValueError: a span outside its source, not aligned to its element size, of another
                element size than 1, 2 or 4 bytes, or of a slot outside ``[0, num_slots)``;
                sources on several devices; an unknown method.
        """
        self.sources = [s.detach() for s in sources]
        spans = np.asarray(spans, dtype=np.int64).reshape(-1, SPAN_FIELDS)
        devices = {s.device for s in self.sources}
        if len(devices) > 1:
            raise ValueError(f"fingerprint sources must share one device, got {sorted(map(str, devices))}")
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self.method = method or default_method(self.device)
        if self.method not in METHODS:
            raise ValueError(f"fingerprint method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if chunk_bytes % 64:
            raise ValueError(f"chunk_bytes must be a multiple of 64, got {chunk_bytes}")
        self.num_slots = num_slots
        self.block, self.num_warps = block, num_warps
        spans = spans[spans[:, COUNT] > 0]
        self._check(spans)
        self.num_spans = len(spans)
        self.nbytes = int((spans[:, COUNT] * spans[:, ESIZE]).sum()) if len(spans) else 0
        self._tables: list[tuple[torch.Tensor, bool]] = []
        self._slabs: list[_Slab] = []
        if self.method == "kernel":
            self._build_tables(spans, chunk_bytes)
        else:
            self._build_slabs(spans)

    def _check(self, spans: np.ndarray) -> None:
        if not len(spans):
            return
        for s in self.sources:
            if not s.is_contiguous():
                raise ValueError("fingerprint sources must be contiguous")
        src = spans[:, SOURCE]
        if src.min() < 0 or src.max() >= len(self.sources):
            raise ValueError(f"a span names source {int(src.max())}; there are {len(self.sources)}")
        nbytes = np.array([s.numel() * s.element_size() for s in self.sources], dtype=np.int64)
        ptrs = np.array([s.data_ptr() for s in self.sources], dtype=np.int64)
        esize = spans[:, ESIZE]
        end = spans[:, OFFSET] + spans[:, COUNT] * esize
        problems = [
            (~np.isin(esize, ELEMENT_SIZES), "element sizes other than 1, 2 or 4 bytes"),
            ((spans[:, OFFSET] < 0) | (end > nbytes[src]), "ranges outside their source"),
            (((ptrs[src] + spans[:, OFFSET]) % np.maximum(esize, 1)) != 0, "ranges not aligned to their elements"),
            ((spans[:, SLOT] < 0) | (spans[:, SLOT] >= self.num_slots) | (spans[:, FIRST] < 0),
             f"slots outside [0, {self.num_slots}) or negative element indices"),
        ]
        for bad, what in problems:
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"fingerprint batch: {int(bad.sum())} spans with {what}, e.g. {spans[i].tolist()}")

    def _build_tables(self, spans: np.ndarray, chunk_bytes: int) -> None:
        if not len(spans):
            return
        spans = split_at_index_period(spans)
        ptrs = np.array([s.data_ptr() for s in self.sources], dtype=np.int64)
        used = np.unique(spans[:, SOURCE])
        aligned_sources = [int(i) for i in used if ptrs[i] % ALIGN == 0]
        base = min(aligned_sources or used.tolist(), key=lambda i: ptrs[i])
        self._base = self.sources[base].reshape(-1).view(torch.uint8)
        addrs = ptrs[spans[:, SOURCE]] + spans[:, OFFSET]
        if aligned_sources:
            aligned, unaligned = split_aligned(spans, addrs)
        else:
            aligned, unaligned = spans[:0], spans
        for rows, is_aligned in ((aligned, True), (unaligned, False)):
            if not len(rows):
                continue
            rows = cut_spans(rows, chunk_bytes)
            rel = ptrs[rows[:, SOURCE]] + rows[:, OFFSET] - ptrs[base]
            table = np.stack([rel, np.zeros_like(rel), rows[:, COUNT], rows[:, ESIZE], rows[:, FIRST], rows[:, SLOT]],
                             axis=1)  # the kernel's rows: no destination offset (nothing is copied)
            self._tables.append((torch.from_numpy(np.ascontiguousarray(table)).to(self.device), is_aligned))

    def _build_slabs(self, spans: np.ndarray) -> None:
        limit = NUMPY_SLAB if self.method == "numpy" else SLAB
        rows = cut_spans(spans, limit)  # pieces of at most `limit` elements, whatever their size
        rows = rows[np.lexsort((rows[:, ESIZE], rows[:, SOURCE]))]
        i = 0
        while i < len(rows):
            j, total = i, 0
            while (j < len(rows) and rows[j, SOURCE] == rows[i, SOURCE] and rows[j, ESIZE] == rows[i, ESIZE]
                   and (j == i or total + rows[j, COUNT] <= limit)):
                total += int(rows[j, COUNT])
                j += 1
            self._slabs.append(self._slab(rows[i:j], total))
            i = j

    def _slab(self, rows: np.ndarray, total: int) -> _Slab:
        src, esize = int(rows[0, SOURCE]), int(rows[0, ESIZE])
        raw = self.sources[src].reshape(-1).view(torch.uint8)
        lead = -raw.data_ptr() % esize  # where the source's first whole element of this size starts
        raw = raw[lead:]
        view = raw[: raw.numel() // esize * esize].view(INT_DTYPES[esize])
        rows = rows.copy()
        rows[:, OFFSET] = (rows[:, OFFSET] - lead) // esize  # from here on: element offsets into ``view``
        device_rows = None
        if self.method == "torch":
            cols = np.stack([rows[:, OFFSET], rows[:, COUNT], rows[:, FIRST], rows[:, SLOT]])
            device_rows = torch.from_numpy(np.ascontiguousarray(cols)).to(self.device)
        return _Slab(view=view, rows=rows, device_rows=device_rows, total=total, mask=(1 << (8 * esize)) - 1)

    def run(self, out: torch.Tensor, seed: int) -> None:
        """Add every span's partial fingerprint into ``out[slot]`` (enqueued on the current
        stream on a GPU: read ``out`` after a synchronization).

        Args:
            out: int64 slot vector on the sources' device (at least ``num_slots`` long).
            seed: the fingerprint's seed (:func:`~weightsync.fingerprint.hash.check_seed`).
        """
        check_seed(seed)
        if out.dtype != torch.int64 or out.numel() < self.num_slots or not out.is_contiguous():
            raise ValueError(f"the slot vector must be contiguous int64 of at least {self.num_slots} elements")
        if self.method == "kernel":
            from weightsync.fingerprint import _kernel  # imports Triton: only where the kernel runs

            for table, aligned in self._tables:
                _kernel.launch(table, self._base, self._base, out, seed, block=self.block, aligned=aligned,
                               num_warps=self.num_warps, copy=False)
            return
        if self.method == "torch":
            for slab in self._slabs:
                _run_slab_torch(slab, out, seed)
            return
        sums = np.zeros(self.num_slots, dtype=np.uint64)
        for slab in self._slabs:
            _run_slab_numpy(slab, sums, seed)
        out[: self.num_slots] += torch.from_numpy(sums.view(np.int64)).to(out.device)


def _run_slab_torch(slab: _Slab, out: torch.Tensor, seed: int) -> None:
    """Hash one slab with torch ops on its device (every element gathered by index)."""
    assert slab.device_rows is not None
    offset, count, first, slot = slab.device_rows
    dev = slab.view.device
    row = torch.repeat_interleave(torch.arange(len(count), device=dev), count, output_size=slab.total)
    local = torch.arange(slab.total, dtype=torch.int64, device=dev) - (torch.cumsum(count, 0) - count)[row]
    bits = slab.view[offset[row] + local].to(torch.int64) & slab.mask
    out.index_add_(0, slot[row], hash_elements(bits, first[row] + local, seed))


def _run_slab_numpy(slab: _Slab, sums: np.ndarray, seed: int) -> None:
    """Hash one slab with numpy on the host; ``sums`` (uint64) wraps modulo 2^64."""
    data = slab.view.numpy().view(_UNSIGNED[slab.view.element_size()])
    rows = slab.rows
    if len(rows) == 1:  # one contiguous range: no gather
        off, count, first = (int(x) for x in rows[0, [OFFSET, COUNT, FIRST]])
        h = hash_elements_np(data[off : off + count].astype(np.uint64),
                             np.arange(first, first + count, dtype=np.uint64), seed)
        np.add.at(sums, rows[:, SLOT], h.sum(dtype=np.uint64, keepdims=True))  # array arithmetic: wraps silently
        return
    counts = rows[:, COUNT]
    starts = np.cumsum(counts) - counts
    local = np.arange(slab.total, dtype=np.int64) - np.repeat(starts, counts)
    bits = data[np.repeat(rows[:, OFFSET], counts) + local].astype(np.uint64)
    h = hash_elements_np(bits, (np.repeat(rows[:, FIRST], counts) + local).astype(np.uint64), seed)
    np.add.at(sums, rows[:, SLOT], np.add.reduceat(h, starts))


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def whole_tensors(tensors: Sequence[torch.Tensor], *, method: str | None = None) -> FingerprintBatch:
    """A batch over every element of each tensor, tensor ``i`` into slot ``i`` (the engine's
    fingerprint of its parameters)."""
    spans = np.array([(i, 0, t.numel(), t.element_size(), 0, i) for i, t in enumerate(tensors)],
                     dtype=np.int64).reshape(-1, SPAN_FIELDS)
    return FingerprintBatch(list(tensors), spans, num_slots=len(tensors), method=method)
