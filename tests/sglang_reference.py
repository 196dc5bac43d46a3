"""sglang's checksum of a tensor, written out plainly in numpy: the reference the tests hold
weightsync's implementation and the fake sglang server (tests/sglang_fake.py) to.

sglang 0.5.23 (and 0.5.16, the same math) ``managers/mm_utils.py`` ``tensor_hash``: a CUDA tensor is
hashed by ``kernels/ops/memory/gpu_tensor_hash.py`` ``gpu_tensor_hash`` (Triton), a CPU tensor by
``sha256`` of its raw bytes (the first 8 bytes, big-endian). ``utils/weight_checker.py``
``_hash_tensor`` prints either as 16 hex digits.

``gpu_tensor_hash`` over the tensor's raw bytes, zero-padded to whole 4-byte words ``v[i]``
(little-endian), ``n`` words, all arithmetic modulo 2^32 unless said:

* ``p1 = (i * 0x27D4EB2D + s1) ^ rotl(i, 15)``, ``p2 = (i * 0x165667B1 + s2) ^ rotl(i, 13)``, with
  ``s1 = seed``, ``s2 = (seed * 0x9E3779B1) ^ 0xDEADBEEF`` and ``seed = 0x243F6A88``;
* ``k1 = fmix32(v ^ p1)``, ``k2 = fmix32(v ^ p2)`` (murmur3's finalizer);
* per tile of 8192 words: ``h = fmix32(sum(k) ^ 4n)`` for each of ``k1``, ``k2``; tile value
  ``h1 << 32 | h2``;
* the tiles summed modulo 2^64, then splitmix64's finalizer.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

SEED = 0x243F6A88
TILE_WORDS = 8192


def _fmix32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return x


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def gpu_hash_bytes(raw: bytes) -> int:
    """``gpu_tensor_hash`` of a tensor whose raw bytes are ``raw``."""
    b = np.frombuffer(raw, dtype=np.uint8)
    if b.size % 4:
        b = np.concatenate([b, np.zeros(4 - b.size % 4, dtype=np.uint8)])
    v = b.view("<u4").astype(np.uint32)
    n = int(v.size)
    if n == 0:
        return 0
    s1 = np.uint32(SEED & 0xFFFFFFFF)
    s2 = np.uint32(((SEED * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF)
    i = (np.arange(n, dtype=np.uint64) & 0xFFFFFFFF).astype(np.uint32)
    with np.errstate(over="ignore"):
        k1 = _fmix32(v ^ ((i * np.uint32(0x27D4EB2D) + s1) ^ _rotl(i, 15))).astype(np.uint64)
        k2 = _fmix32(v ^ ((i * np.uint32(0x165667B1) + s2) ^ _rotl(i, 13))).astype(np.uint64)
    size = np.uint32((4 * n) & 0xFFFFFFFF)
    total = 0
    for start in range(0, n, TILE_WORDS):
        h1 = np.uint32(int(k1[start:start + TILE_WORDS].sum()) & 0xFFFFFFFF) ^ size
        h2 = np.uint32(int(k2[start:start + TILE_WORDS].sum()) & 0xFFFFFFFF) ^ size
        h1, h2 = (int(_fmix32(np.array([h]))[0]) for h in (h1, h2))
        total = (total + ((h1 << 32) | h2)) & ((1 << 64) - 1)
    return _splitmix64(total)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes as stored (contiguous, row-major)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def sglang_checksum(t: torch.Tensor, *, gpu: bool) -> str:
    """What sglang's weight checker reports for ``t`` held on a GPU (``gpu``) or on the CPU."""
    if gpu:
        return f"{gpu_hash_bytes(raw_bytes(t)):016x}"
    return f"{int.from_bytes(hashlib.sha256(raw_bytes(t)).digest()[:8], 'big'):016x}"


def per_gpu_checksum(checksums: dict[str, str]) -> str:
    """sglang ``utils/weight_checker.py`` ``overall_checksum``: sha256 over the sorted names and values."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()
