"""The Triton kernel of :class:`~weightsync.fingerprint.batch.FingerprintBatch` (imported only when
it runs: importing it needs Triton).

One program per chunk-table row ``(offset, count, element size, first, slot)``: it loads the
chunk's ``count`` elements (``BLOCK`` at a time, at ``base + offset`` bytes, as unsigned integers
of the row's element size, zero-extended), hashes each with its index ``first + e`` exactly as
:func:`weightsync.fingerprint.hash.hash_elements` does (uint64 arithmetic wraps modulo 2^64),
sums them and adds the sum to ``out[slot]`` with one 64-bit atomic add. The element size is a
runtime value, uniform within a program, so one launch covers a batch of mixed dtypes. In the
aligned class every offset is a multiple of 16 bytes from a 16-byte aligned base and every count
a multiple of 16 elements, which the ``multiple_of`` hints tell the compiler (wide loads).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from weightsync.fingerprint import hash as definition

ROW_FIELDS = 5
_C1 = tl.constexpr(definition.C1)
_C2 = tl.constexpr(definition.C2)
_C3 = tl.constexpr(definition.C3)


@triton.jit
def _mix(x):
    x = x ^ (x >> 32)
    x = x * _C1
    x = x ^ (x >> 29)
    x = x * _C2
    return x ^ (x >> 32)


@triton.jit
def _fingerprint_chunks(table, base, out, seed, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = table + pid * 5
    off = tl.load(row)
    n = tl.load(row + 1)
    esize = tl.load(row + 2)
    first = tl.load(row + 3)
    slot = tl.load(row + 4)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
        n = tl.multiple_of(n, 16)
    start = base + off
    s = seed.to(tl.int64).to(tl.uint64, bitcast=True)  # a small seed arrives as int32
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for i in range(0, n, BLOCK):
        e = i + lanes
        m = e < n
        if esize == 2:
            bits = tl.load(start.to(tl.pointer_type(tl.uint16)) + e, mask=m, other=0).to(tl.uint64)
        elif esize == 4:
            bits = tl.load(start.to(tl.pointer_type(tl.uint32)) + e, mask=m, other=0).to(tl.uint64)
        else:
            bits = tl.load(start + e, mask=m, other=0).to(tl.uint64)
        k = (first + e).to(tl.uint64)
        h = _mix((bits | (k << 32)) ^ s ^ ((k >> 32) * _C3))
        acc += tl.where(m, h, tl.zeros([BLOCK], dtype=tl.uint64))
    tl.atomic_add(out + slot, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def launch(table: Any, base: Any, out: Any, seed: int, *, block: int, aligned: bool, num_warps: int) -> None:
    """Hash every chunk of ``table`` (``(K, 5)`` int64 on the device) into ``out`` on the current stream."""
    _fingerprint_chunks[(int(table.shape[0]),)](table, base, out, seed, BLOCK=block, ALIGNED=aligned,
                                                  num_warps=num_warps)
