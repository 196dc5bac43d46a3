"""Batched device copies: every run of one write batch in one or two kernel launches.

A write batch of a MoE model holds thousands of runs (Qwen3-30B-A3B at 32 layers: 12,867 ops,
one per expert projection), each a few MiB. Issued one ``cudaMemcpyAsync`` at a time from
Python, the issue cost (about 4 us a run through ctypes) exceeds the copy itself (about 1.6 us
for 3 MiB at 2 TB/s). Here the runs are prepared once into a device-resident table of
``(src_offset, dst_offset, nbytes)`` chunks and copied by one Triton kernel launch per alignment
class; the alternative, the CUDA runtime's own ``cudaMemcpyBatchAsync`` (CUDA 12.8 and later),
is :class:`MemcpyBatch`. Which one a :class:`~weightsync.transport._cuda.DeviceCopier` uses is
:data:`COPY_METHODS`, chosen by measurement (``scripts/bench_gpu.py``; BENCHMARKS.md).

Table layout: every run is cut into chunks of at most ``chunk`` bytes (one Triton program each);
a run whose source and destination share their offset modulo 16 is split into an unaligned head,
a 16-byte-aligned body and an unaligned tail, so that nearly every byte moves in 16-byte
vector accesses. Offsets are relative to two base addresses (the lowest source and destination
address of the batch, rounded down to 256 bytes), passed to the kernel as pointer arguments.

Legend: ``N`` runs, ``K`` chunks.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

COPY_METHODS = ("kernel", "memcpy_batch", "runs")
"""``kernel``: the Triton chunk-table copy; ``memcpy_batch``: ``cudaMemcpyBatchAsync``; ``runs``:
one ``cudaMemcpyAsync`` / ``cudaMemcpy2DAsync`` per run or 2-D block (the fallback)."""
COPY_METHOD_ENV = "WEIGHTSYNC_DEVICE_COPY"
"""Overrides the default method (one of :data:`COPY_METHODS`), for A/B measurements."""
DEFAULT_METHOD = "kernel"
MIN_BATCHED_RUNS = 8
"""Batches of fewer runs keep the per-run path: building a table costs more than it saves."""
ALIGN = 16
BASE_ALIGN = 256
CHUNK_BYTES = 16 << 10
"""Bytes per Triton program (``ITERS`` x ``BLOCK``). Swept on one H200 (scripts/bench_gpu.py,
BENCHMARKS.md) over Qwen3-4B's and Qwen3-30B-A3B's runs: 16 KiB programs of 4 KiB iterations and
4 warps were fastest (2,016 and 2,073 GB/s; 1 MiB programs: 1,735 and 1,748 GB/s)."""
BLOCK_BYTES = 4096


def copy_method(requested: str | None = None) -> str:
    """The method to use: ``requested``, else :data:`COPY_METHOD_ENV`, else :data:`DEFAULT_METHOD`.

    Raises:
        ValueError: an unknown method name.
    """
    method = requested or os.environ.get(COPY_METHOD_ENV) or DEFAULT_METHOD
    if method not in COPY_METHODS:
        raise ValueError(f"device copy method must be one of {', '.join(COPY_METHODS)}; got {method!r}")
    return method


def block_runs(blocks: np.ndarray) -> np.ndarray:
    """Expand :func:`~weightsync.transport.runs.strided_blocks` rows back into ``(N, 3)`` runs."""
    if len(blocks) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    s, d, w, h, sp, dp = (blocks[:, i] for i in range(6))
    row = np.arange(int(h.sum()), dtype=np.int64) - np.repeat(np.cumsum(h) - h, h)
    return np.stack([np.repeat(s, h) + row * np.repeat(sp, h), np.repeat(d, h) + row * np.repeat(dp, h),
                     np.repeat(w, h)], axis=1)


def split_aligned(runs: np.ndarray, align: int = ALIGN) -> tuple[np.ndarray, np.ndarray]:
    """``(aligned, unaligned)`` runs with the same bytes: each run whose source and destination
    agree modulo ``align`` gives an unaligned head, an aligned body (both addresses and the
    length multiples of ``align``) and an unaligned tail; other runs stay whole, unaligned."""
    if len(runs) == 0:
        return runs.reshape(0, 3), runs.reshape(0, 3)
    s, d, n = runs[:, 0], runs[:, 1], runs[:, 2]
    same = (s % align) == (d % align)
    head = np.where(same, (-s) % align, n)
    head = np.minimum(head, n)
    body = np.where(same, ((n - head) // align) * align, 0)
    tail = n - head - body
    parts = [
        np.stack([s, d, head], axis=1)[head > 0],
        np.stack([s + head, d + head, body], axis=1)[body > 0],
        np.stack([s + head + body, d + head + body, tail], axis=1)[tail > 0],
    ]
    return parts[1], np.concatenate([parts[0], parts[2]])


def chunk_runs(runs: np.ndarray, chunk: int) -> np.ndarray:
    """Cut every run into pieces of at most ``chunk`` bytes (order kept)."""
    if len(runs) == 0:
        return runs.reshape(0, 3)
    pieces = -(-runs[:, 2] // chunk)
    idx = np.repeat(np.arange(len(runs)), pieces)
    k = np.arange(len(idx), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    off = k * chunk
    n = np.minimum(runs[idx, 2] - off, chunk)
    return np.stack([runs[idx, 0] + off, runs[idx, 1] + off, n], axis=1)


def _triton():  # the kernels module (imports Triton), compiled on first use
    from weightsync.transport import _copy_kernel

    return _copy_kernel


def triton_available() -> bool:
    """Whether Triton can be imported (the ``kernel`` method needs it and a GPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkTable:
    """One alignment class of a batch: the device table and the base addresses it is relative to."""

    table: torch.Tensor
    """``(K, 3)`` int64 on the copy's device: source offset, destination offset, bytes."""
    src_arg: torch.Tensor
    """uint8 view of the source span from its 256-byte-aligned base (the kernel's pointer)."""
    dst_arg: torch.Tensor
    aligned: bool

    @property
    def num_chunks(self) -> int:
        return int(self.table.shape[0])


def _tables(runs: np.ndarray, device: torch.device, chunk: int) -> list[ChunkTable]:
    out = []
    for rows, aligned in zip(split_aligned(runs), (True, False), strict=True):
        if len(rows) == 0:
            continue
        rows = chunk_runs(rows, chunk)
        sb = int(rows[:, 0].min()) // BASE_ALIGN * BASE_ALIGN
        db = int(rows[:, 1].min()) // BASE_ALIGN * BASE_ALIGN
        rel = rows - np.array([sb, db, 0], dtype=np.int64)
        span_s = int((rel[:, 0] + rel[:, 2]).max())
        span_d = int((rel[:, 1] + rel[:, 2]).max())
        table = torch.from_numpy(np.ascontiguousarray(rel)).to(device)
        out.append(ChunkTable(table=table, src_arg=raw_view(sb, span_s, device), dst_arg=raw_view(db, span_d, device),
                              aligned=aligned))
    return out


def raw_view(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over raw memory (no ownership): the kernel's pointer argument. On the CPU
    (Triton's interpreter, for tests) host memory; else device memory of ``device``."""
    if device.type == "cpu":
        from weightsync.transport._host import host_tensor

        return host_tensor(addr, nbytes)
    return raw_device_tensor(addr, nbytes, device.index if device.index is not None else torch.cuda.current_device())


def raw_device_tensor(addr: int, nbytes: int, device: int) -> torch.Tensor:
    """A uint8 torch view of raw device memory (no ownership), via ``__cuda_array_interface__``."""

    class _Raw:
        __cuda_array_interface__ = {  # noqa: RUF012 -- a per-call record, never mutated
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
            "strides": None,
        }

    return torch.as_tensor(_Raw(), device=f"cuda:{device}")


class KernelBatch:
    """The runs of one write batch as device chunk tables, copied by :func:`_copy_kernel.launch`.

    Prepared once (the table crosses to the device once); :meth:`launch` enqueues the copy on
    the given stream and returns at once.
    """

    def __init__(self, runs: np.ndarray, device: torch.device, *, chunk: int = CHUNK_BYTES,
                 block: int = BLOCK_BYTES, num_warps: int = 4) -> None:
        """Args:
        runs: ``(N, 3)`` int64 ``[src, dst, nbytes]`` (addresses this process can dereference
            on ``device``: its own memory or IPC-opened peer memory).
        device: the GPU whose SMs copy.
        chunk: bytes per program (a multiple of ``block``).
        block: bytes per program iteration.
        num_warps: warps per program.
        """
        if chunk % block:
            raise ValueError(f"chunk ({chunk}) must be a multiple of block ({block})")
        self.device = device
        self.chunk, self.block, self.num_warps = chunk, block, num_warps
        self.nbytes = int(runs[:, 2].sum()) if len(runs) else 0
        self.num_runs = len(runs)
        self.tables = _tables(runs, device, chunk)

    def launch(self, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue the copy on ``stream`` (default: the current stream)."""
        kernels = _triton()
        ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
        with ctx:
            for t in self.tables:
                kernels.launch(t, chunk=self.chunk, block=self.block, num_warps=self.num_warps)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- cudaMemcpyBatchAsync --------------------------------------------------------------------

MEMCPY_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
MEM_LOCATION_TYPE_DEVICE = 1  # cudaMemLocationTypeDevice


class MemLocation(ctypes.Structure):
    """``cudaMemLocation``."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes`` (CUDA 12.8 and later)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


def bind_memcpy_batch(rt: ctypes.CDLL) -> tuple[object, bool] | None:
    """``(cudaMemcpyBatchAsync, has_fail_idx)`` of the loaded runtime, or None before CUDA 12.8.

    CUDA 12.8/12.9 declare a ``size_t *failIdx`` argument before the stream; CUDA 13 dropped it.
    """
    fn = getattr(rt, "cudaMemcpyBatchAsync", None)
    if fn is None:
        return None
    version = ctypes.c_int()
    rt.cudaRuntimeGetVersion(ctypes.byref(version))
    if version.value < 12080:
        return None
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    has_fail = version.value < 13000
    args = [ctypes.POINTER(vp), ctypes.POINTER(vp), ctypes.POINTER(sz), sz, ctypes.POINTER(MemcpyAttributes),
            ctypes.POINTER(sz), sz]
    fn.argtypes = [*args, ctypes.POINTER(sz), vp] if has_fail else [*args, vp]
    fn.restype = ctypes.c_int
    return fn, has_fail


class MemcpyBatch:
    """The runs of one write batch as the host arrays ``cudaMemcpyBatchAsync`` takes (built once)."""

    def __init__(self, runs: np.ndarray, device: int, binding: tuple[object, bool]) -> None:
        self.fn, self.has_fail = binding
        n = len(runs)
        self.count = n
        self.nbytes = int(runs[:, 2].sum()) if n else 0
        self._dst = (ctypes.c_void_p * n)(*runs[:, 1].tolist())
        self._src = (ctypes.c_void_p * n)(*runs[:, 0].tolist())
        self._sizes = (ctypes.c_size_t * n)(*runs[:, 2].tolist())
        loc = MemLocation(MEM_LOCATION_TYPE_DEVICE, device)
        self._attrs = (MemcpyAttributes * 1)(MemcpyAttributes(MEMCPY_SRC_ACCESS_ORDER_STREAM, loc, loc, 0))
        self._idx = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)

    def launch(self, stream: int) -> int:
        """Enqueue on the raw ``stream``; returns the CUDA error code (0 on success)."""
        if self.count == 0:
            return 0
        args = [self._dst, self._src, self._sizes, self.count, self._attrs, self._idx, 1]
        if self.has_fail:
            args.append(ctypes.byref(self._fail))
        return int(self.fn(*args, stream))  # type: ignore[operator]
