"""The fingerprint's definition: a position-dependent 64-bit hash of every element, summed.

A tensor is viewed as ``n`` elements of its dtype's size ``s`` (1, 2 or 4 bytes), the element
``k`` as the unsigned integer ``bits_k`` of its ``s`` bytes (little-endian, zero-extended to 32
bits). With a 64-bit ``seed``::

    H(bits, k) = mix(((k mod 2^32) << 32 | bits) XOR seed XOR ((k >> 32) * C3))       (mod 2^64)
    fp(tensor) = sum over k of H(bits_k, k)                                            (mod 2^64)

``mix`` is an xor-shift / multiply finalizer (splitmix64's multipliers; its first and last
shifts are 32 so that on a GPU they cost one 32-bit xor each)::

    x ^= x >> 32;  x *= 0xbf58476d1ce4e5b9;  x ^= x >> 29;  x *= 0x94d049bb133111eb;  x ^= x >> 32

Every step is invertible, so for a fixed ``k`` (and ``k < 2^32``), ``bits -> H(bits, k)`` is a
bijection: one element that differs (a flipped bit, a write that did not happen over an old
value that differed, a foreign write) always changes the sum. Several differing elements change
it unless their hash differences cancel modulo 2^64 (chance about 2^-64 for a seed the writer
does not know). The element index is part of the hashed key, so the same bytes at another
offset hash differently (a run written at a wrong offset). And since the whole is a sum over
elements, partials over disjoint element ranges add up to it, in any order: each trainer rank
hashes exactly the elements it writes, the partials are summed, and the sum equals what the
engine computes over the parameter it holds.

This module holds the definition twice: :func:`element_hash` over Python integers (the reference
the tests check the others against) and :func:`hash_elements` over torch int64 tensors (any
device; the CPU path and the fallback of a GPU without Triton). The batched form, and the Triton
kernel, are :mod:`weightsync.fingerprint.batch`.
"""

from __future__ import annotations

import numpy as np
import torch

MASK32 = (1 << 32) - 1
MASK64 = (1 << 64) - 1
C1 = 0xBF58476D1CE4E5B9
C2 = 0x94D049BB133111EB
C3 = 0x9E3779B97F4A7C15
"""Folds the high half of an element index (parameters of 2^32 elements or more) into the key."""
DEFAULT_SEED = 0x5EED_F1A6_E7B1_7500
ELEMENT_SIZES = (1, 2, 4)
INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
"""The integer view of an element of each size (zero-extension masks the sign)."""


def check_seed(seed: int) -> int:
    """``seed`` if it is in ``[0, 2^63)`` (it travels as a JSON number and a signed kernel argument).

    Raises:
        ValueError: outside that range.
    """
    if not 0 <= int(seed) < 1 << 63:
        raise ValueError(f"a fingerprint seed is in [0, 2^63), got {seed}")
    return int(seed)


def mix64(x: int) -> int:
    """The finalizer on a Python integer (mod 2^64)."""
    x &= MASK64
    x ^= x >> 32
    x = (x * C1) & MASK64
    x ^= x >> 29
    x = (x * C2) & MASK64
    return x ^ (x >> 32)


def element_hash(bits: int, k: int, seed: int = DEFAULT_SEED) -> int:
    """``H(bits, k)`` of the module docstring, on Python integers (the reference)."""
    key = ((k & MASK32) << 32 | (bits & MASK32)) ^ seed ^ (((k >> 32) * C3) & MASK64)
    return mix64(key)


def _signed(c: int) -> int:
    """A 64-bit pattern as the torch int64 scalar of the same bits."""
    c &= MASK64
    return c - (1 << 64) if c >> 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def hash_elements(bits: torch.Tensor, k: torch.Tensor, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """``H(bits, k)`` element-wise as int64 bit patterns (torch's int64 arithmetic wraps modulo 2^64).

    Args:
        bits: int64, each in ``[0, 2^32)`` (an element's zero-extended bits).
        k: int64 element indices (``>= 0``), broadcastable with ``bits``.
        seed: see :func:`check_seed`.
    """
    key = ((k & MASK32) << 32) | bits
    key = key ^ _signed(seed) ^ ((k >> 32) * _signed(C3))
    x = key ^ _shr(key, 32)
    x = x * _signed(C1)
    x = x ^ _shr(x, 29)
    x = x * _signed(C2)
    return x ^ _shr(x, 32)


def hash_elements_np(bits: np.ndarray, k: np.ndarray, seed: int = DEFAULT_SEED) -> np.ndarray:
    """``H(bits, k)`` element-wise on uint64 numpy arrays (the CPU path: numpy's uint64 multiply is
    vectorized where torch's int64 one is not -- 0.5 ms against 3-9 ms per million elements on one
    core of the 2-core machine); ``bits`` is overwritten and returned.

    Args:
        bits: uint64, each in ``[0, 2^32)``.
        k: uint64 element indices, the same length.
        seed: see :func:`check_seed`.
    """
    x, t = bits, np.left_shift(k, np.uint64(32))
    x |= t
    x ^= np.uint64(seed)
    if len(k) and int(k.max()) >> 32:  # parameters of 2^32 elements or more
        np.multiply(np.right_shift(k, np.uint64(32)), np.uint64(C3), out=t)
        x ^= t
    for shift, mult in ((32, C1), (29, C2)):
        np.right_shift(x, np.uint64(shift), out=t)
        x ^= t
        x *= np.uint64(mult)
    np.right_shift(x, np.uint64(32), out=t)
    x ^= t
    return x


def element_bits(t: torch.Tensor) -> torch.Tensor:
    """The elements of a contiguous tensor as int64 zero-extended bits (one per element)."""
    esize = t.element_size()
    if esize not in ELEMENT_SIZES:
        raise ValueError(f"fingerprints cover elements of 1, 2 or 4 bytes; {t.dtype} has {esize}")
    raw = t.detach().reshape(-1).view(INT_DTYPES[esize]).to(torch.int64)
    return raw & ((1 << (8 * esize)) - 1)


def fingerprint_tensor(t: torch.Tensor, *, first: int = 0, seed: int = DEFAULT_SEED) -> int:
    """The fingerprint of every element of ``t`` (contiguous), its elements numbered from ``first``.

    ``first`` places ``t`` inside a larger parameter: the partial of elements ``[first, first +
    t.numel())``. Returns the unsigned 64-bit sum. One pass of torch ops over the whole tensor
    (tests and small tensors; batches of many ranges are :class:`~weightsync.fingerprint.batch.FingerprintBatch`).
    """
    bits = element_bits(t)
    k = torch.arange(first, first + bits.numel(), dtype=torch.int64, device=bits.device)
    return int(hash_elements(bits, k, check_seed(seed)).sum()) & MASK64


def zeros_fingerprint(first: int, count: int, seed: int = DEFAULT_SEED) -> int:
    """The partial of ``count`` zero elements numbered from ``first`` (any element size: zeros
    zero-extend alike), e.g. a parameter's padding rows."""
    k = torch.arange(first, first + count, dtype=torch.int64)
    return int(hash_elements(torch.zeros_like(k), k, check_seed(seed)).sum()) & MASK64


def to_hex(value: int) -> str:
    """A fingerprint as the 16 hex digits the engine's checker answers (signed int64 patterns too)."""
    return f"{int(value) & MASK64:016x}"
