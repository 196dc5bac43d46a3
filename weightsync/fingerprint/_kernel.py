"""The Triton kernels of :class:`~weightsync.fingerprint.batch.FingerprintBatch` and of
:class:`~weightsync.fingerprint.copy_batch.CopyFingerprintBatch` (imported only when they run:
importing them needs Triton); the second is the first with a store of every element it loads.

One program per chunk-table row ``(source offset, destination offset, count, element size, first,
slot)``: it loads the chunk's ``count`` elements (``BLOCK`` at a time, at ``src_base + source
offset`` bytes, as unsigned integers of the row's element size, zero-extended) -- and, with
``COPY``, stores each at ``dst_base + destination offset`` as it is loaded -- hashes each with its
index ``first + e`` to the value :func:`weightsync.fingerprint.hash.hash_elements` gives, sums them
and adds the sum to ``out[slot]`` with one 64-bit atomic add. The element size is a runtime value,
uniform within a program, so one launch covers a batch of mixed dtypes. In the aligned class every
offset is a multiple of 16 bytes from 16-byte aligned bases and every count a multiple of 16
elements, which the ``multiple_of`` hints tell the compiler (16-byte loads and stores).

Cheaper arithmetic, the same values (the kernel is bound by integer instructions, not by memory):

* the 64-bit state is two uint32 halves ``(lo, hi)``: ``x ^= x >> 32`` is one 32-bit xor, a
  multiply by a constant is one 32 x 32 -> 64-bit multiply of ``lo`` by its low half plus the two
  cross products into the high word (the 64-bit product's low 64 bits), ``x >> 29`` one funnel
  shift;
* a row never crosses a multiple of 2^32 in element index (the table builder cuts there), so the
  index's high half and ``(k >> 32) * C3`` are folded into the seed once per program, and the low
  half is ``first_lo + e`` in 32 bits;
* whole blocks are hashed unmasked; only the last, partial one is masked.

Compiled for sm_90 (Triton 3.9), the unmasked loop is 19.5 SASS instructions per element, where
the kernel in 64-bit arithmetic was 28.5.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from weightsync.fingerprint import hash as definition

_MASK32 = definition.MASK32
_C1_LO = tl.constexpr(definition.C1 & _MASK32)
_C1_HI = tl.constexpr(definition.C1 >> 32)
_C2_LO = tl.constexpr(definition.C2 & _MASK32)
_C2_HI = tl.constexpr(definition.C2 >> 32)
_C3 = tl.constexpr(definition.C3)


@triton.jit
def _mul(lo, hi, c_lo: tl.constexpr, c_hi: tl.constexpr):
    """``(lo, hi) * (c_hi << 32 | c_lo)`` modulo 2^64, in uint32 halves (products wrap modulo 2^32)."""
    wide = lo.to(tl.uint64) * c_lo  # one 32 x 32 -> 64-bit multiply: the low half and its carry word
    return wide.to(tl.uint32), (wide >> 32).to(tl.uint32) + lo * c_hi + hi * c_lo


@triton.jit
def _hash(bits, k_lo, s_lo, s_hi):
    """``H(bits, k)`` as uint64, from the element's bits and the low half of its index (uint32),
    and the program's seed halves (the seed with the index's high half folded in)."""
    hi = k_lo ^ s_hi
    lo = (bits ^ s_lo) ^ hi  # the key, then x ^= x >> 32
    lo, hi = _mul(lo, hi, _C1_LO, _C1_HI)
    lo, hi = lo ^ ((lo >> 29) | (hi << 3)), hi ^ (hi >> 29)
    lo, hi = _mul(lo, hi, _C2_LO, _C2_HI)
    lo = lo ^ hi
    return (hi.to(tl.uint64) << 32) | lo.to(tl.uint64)


@triton.jit
def _load(ptr, e, n, MASKED: tl.constexpr):
    """``ptr[e]`` zero-extended to uint32 (those past ``n`` read as 0 when ``MASKED``)."""
    if MASKED:
        return tl.load(ptr + e, mask=e < n, other=0).to(tl.uint32)
    return tl.load(ptr + e).to(tl.uint32)


@triton.jit
def _bits(start, e, esize, n, MASKED: tl.constexpr):
    """The elements ``e`` of ``esize`` bytes at ``start`` as zero-extended uint32."""
    if esize == 2:
        bits = _load(start.to(tl.pointer_type(tl.uint16)), e, n, MASKED)
    elif esize == 4:
        bits = _load(start.to(tl.pointer_type(tl.uint32)), e, n, MASKED)
    else:
        bits = _load(start, e, n, MASKED)
    return bits


@triton.jit
def _copy_bits(src, dst, e, esize, n, MASKED: tl.constexpr):
    """Copy the elements ``e`` of ``esize`` bytes from ``src`` to ``dst``; their bits as uint32."""
    if esize == 2:
        bits = _copy_load(src.to(tl.pointer_type(tl.uint16)), dst.to(tl.pointer_type(tl.uint16)), e, n, MASKED)
    elif esize == 4:
        bits = _copy_load(src.to(tl.pointer_type(tl.uint32)), dst.to(tl.pointer_type(tl.uint32)), e, n, MASKED)
    else:
        bits = _copy_load(src, dst, e, n, MASKED)
    return bits


@triton.jit
def _copy_load(src, dst, e, n, MASKED: tl.constexpr):
    if MASKED:
        x = tl.load(src + e, mask=e < n, other=0)
        tl.store(dst + e, x, mask=e < n)
    else:
        x = tl.load(src + e)
        tl.store(dst + e, x)
    return x.to(tl.uint32)


@triton.jit
def _chunks(table, src_base, dst_base, out, seed, BLOCK: tl.constexpr, ALIGNED: tl.constexpr, COPY: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = table + pid * 6
    so = tl.load(row)
    do = tl.load(row + 1)
    n = tl.load(row + 2)
    esize = tl.load(row + 3)
    first = tl.load(row + 4)
    slot = tl.load(row + 5)
    if ALIGNED:
        so = tl.multiple_of(so, 16)
        do = tl.multiple_of(do, 16)
        n = tl.multiple_of(n, 16)
    src = src_base + so
    dst = dst_base + do
    # the index's high half is the program's (rows do not cross 2^32): folded into the seed once
    s = seed.to(tl.int64).to(tl.uint64, bitcast=True) ^ ((first >> 32).to(tl.uint64) * _C3)
    s_lo = (s & 0xFFFFFFFF).to(tl.uint32)
    s_hi = (s >> 32).to(tl.uint32)
    first_lo = (first & 0xFFFFFFFF).to(tl.uint32)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    whole = n // BLOCK * BLOCK
    for i in range(0, whole, BLOCK):
        e = i + lanes
        if COPY:
            bits = _copy_bits(src, dst, e, esize, n, False)
        else:
            bits = _bits(src, e, esize, n, False)
        acc += _hash(bits, first_lo + e.to(tl.uint32), s_lo, s_hi)
    if whole < n:
        e = whole + lanes
        if COPY:
            bits = _copy_bits(src, dst, e, esize, n, True)
        else:
            bits = _bits(src, e, esize, n, True)
        acc += tl.where(e < n, _hash(bits, first_lo + e.to(tl.uint32), s_lo, s_hi), tl.zeros([BLOCK], dtype=tl.uint64))
    tl.atomic_add(out + slot, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def launch(table: Any, src_base: Any, dst_base: Any, out: Any, seed: int, *, block: int, aligned: bool,
           num_warps: int, copy: bool) -> None:
    """Hash (and with ``copy``, copy) every chunk of ``table`` on the current stream: ``(K, 6)``
    int64 ``[src offset, dst offset, count, element size, first, slot]`` on the device, offsets in
    bytes from ``src_base`` / ``dst_base`` (``dst_base`` unused without ``copy``), no row crossing
    a multiple of 2^32 in element index."""
    _chunks[(int(table.shape[0]),)](table, src_base, dst_base, out, seed, BLOCK=block, ALIGNED=aligned, COPY=copy,
                                    num_warps=num_warps)
