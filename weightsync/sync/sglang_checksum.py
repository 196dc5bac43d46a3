"""sglang's weight checksum (``/weights_checker`` ``checksum``), exactly: the hash, which tensors
are listed, and the answer's shape.

**The hash** (sglang 0.5.23 and 0.5.16 ``managers/mm_utils.py`` ``tensor_hash``): a tensor on a
GPU is hashed by ``kernels/ops/memory/gpu_tensor_hash.py`` ``gpu_tensor_hash``, a tensor on the
CPU by ``sha256`` of its raw bytes (the first 8 bytes, big-endian); either is printed as 16 hex
digits. ``gpu_tensor_hash`` is integer arithmetic only, so it is computed here with torch int64
operations, on any device, with the same value: the raw bytes zero-padded to 4-byte words ``v``
(little-endian); per word ``i`` (modulo 2^32)::

    p1 = (i * 0x27D4EB2D + s1) ^ rotl(i, 15);   k1 = fmix32(v ^ p1)
    p2 = (i * 0x165667B1 + s2) ^ rotl(i, 13);   k2 = fmix32(v ^ p2)

with ``s1 = 0x243F6A88``, ``s2 = (s1 * 0x9E3779B1) ^ 0xDEADBEEF`` (murmur3's ``fmix32``); per tile
of 8192 words ``h = fmix32(sum(k) mod 2^32 ^ 4n)`` for ``k1`` and ``k2`` (``n`` the tensor's word
count), tile value ``h1 << 32 | h2``; the tiles summed modulo 2^64; splitmix64's finalizer. Sums
within a tile compose: words hashed anywhere, by anyone, add up per tile (:class:`TileSums`).

**The listing** (``utils/weight_checker.py`` ``WeightChecker._compute_checksum``): every
parameter, in ``named_parameters()`` order, as stored -- except a block-fp8 weight, hashed after
``block_quant_dequant`` to bfloat16 with its ``weight_scale_inv`` (``Fp8BlockComparable``: block
``K // scale columns``, square; one float32 multiply, then rounding), whose scale is not listed;
names with a ``skip_tensor_list`` substring are left out (not quantized weights), and so are
non-persistent buffers and fp8 KV-cache scales (:func:`never_checked`).

**The answer**: ``ranks`` holds one entry per TP rank, each ``{checksums, per_gpu_checksum,
parallelism_info}`` where ``parallelism_info`` is a list of role dicts (0.5.23, miles' build,
this project's engine) or one object (0.5.16); :func:`checksums_by_rank` reads both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
TILE_WORDS = 8192
SEED = 0x243F6A88
S1 = SEED & MASK32
S2 = ((SEED * 0x9E3779B1) ^ 0xDEADBEEF) & MASK32
CHUNK_WORDS = 1 << 24
"""Words hashed per step (bounds the int64 temporaries: 128 MiB each)."""
SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32) without leaving int64 (c split in halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & MASK32) | (x >> (32 - r))


def word_keys(words: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k1, k2)`` of words ``words`` (int64 in [0, 2^32)) at word indices ``index`` (int64)."""
    i = index & MASK32
    k1 = _fmix32(words ^ (((_mul32(i, 0x27D4EB2D) + S1) & MASK32) ^ _rotl(i, 15)))
    k2 = _fmix32(words ^ (((_mul32(i, 0x165667B1) + S2) & MASK32) ^ _rotl(i, 13)))
    return k1, k2


def as_words(raw: torch.Tensor) -> torch.Tensor:
    """Raw bytes (uint8, any length) as int64 words in [0, 2^32), zero-padded to whole words."""
    pad = -raw.numel() % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int32).to(torch.int64) & MASK32


def num_words(nbytes: int) -> int:
    return -(-nbytes // 4)


def num_tiles(nbytes: int) -> int:
    return -(-num_words(nbytes) // TILE_WORDS)


def _splitmix64(x: int) -> int:
    x &= MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class TileSums:
    """Per-tile sums of ``k1`` and ``k2`` of one hashed tensor of ``nbytes`` bytes: add words in
    any order, from any number of places, then :meth:`value` is ``gpu_tensor_hash`` of the whole."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        self.nbytes = nbytes
        self.sums = torch.zeros(2, num_tiles(nbytes), dtype=torch.int64, device=device)

    def add(self, words: torch.Tensor, index: torch.Tensor) -> None:
        """Add words at their word indices (int64 tensors of one length, on this object's device)."""
        add_words(self.sums, words, index)

    def value(self) -> int:
        """The hash of the tensor (every word must have been added once)."""
        return finalize(self.sums, self.nbytes)


def add_words(sums: torch.Tensor, words: torch.Tensor, index: torch.Tensor, base: int | torch.Tensor = 0) -> None:
    """Add the words' ``k1``/``k2`` into ``sums[0|1, base + index // 8192]`` (int64, unreduced)."""
    for lo in range(0, words.numel(), CHUNK_WORDS):
        w, i = words[lo:lo + CHUNK_WORDS], index[lo:lo + CHUNK_WORDS]
        k1, k2 = word_keys(w, i)
        tile = base + torch.div(i, TILE_WORDS, rounding_mode="floor")
        sums[0].index_add_(0, tile, k1)
        sums[1].index_add_(0, tile, k2)


def finalize(sums: torch.Tensor, nbytes: int) -> int:
    """``gpu_tensor_hash`` from the per-tile sums of a tensor of ``nbytes`` bytes (tiles are
    ``sums[:, t]``, unreduced int64 sums of 32-bit keys)."""
    if nbytes == 0:
        return 0
    size = (4 * num_words(nbytes)) & MASK32
    h = _fmix32((sums.to(torch.int64) & MASK32) ^ size)
    total = (int(h[0].sum()) << 32) + int(h[1].sum())  # the tile values summed, as two halves
    return _splitmix64(total)


def gpu_tensor_hash(t: torch.Tensor) -> int:
    """sglang's ``gpu_tensor_hash`` of ``t`` (any device; computed where ``t`` lives)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    sums = TileSums(raw.numel(), device=raw.device)
    n = num_words(raw.numel())
    for lo in range(0, n, CHUNK_WORDS):
        hi = min(n, lo + CHUNK_WORDS)
        words = as_words(raw[4 * lo:4 * hi])
        sums.add(words, torch.arange(lo, hi, dtype=torch.int64, device=raw.device))
    return sums.value()


def sha256_hash(t: torch.Tensor) -> int:
    """sglang's CPU ``tensor_hash``: the first 8 bytes of sha256 of the raw bytes, big-endian."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return int.from_bytes(hashlib.sha256(memoryview(raw.numpy())).digest()[:8], "big")


def tensor_checksum(t: torch.Tensor, *, gpu: bool | None = None) -> str:
    """The 16 hex digits sglang reports for ``t``: hashed as on a GPU (``gpu``; default: where ``t`` is)."""
    on_gpu = t.is_cuda if gpu is None else gpu
    if on_gpu and not t.is_cuda and torch.cuda.is_available():
        t = t.cuda()
    return f"{(gpu_tensor_hash(t) if on_gpu else sha256_hash(t)):016x}"


def dequant_bf16(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """sglang's ``Fp8BlockComparable.dequantize``: ``block_quant_dequant`` to bfloat16, the block
    square and inferred from the last dims (``K // scale columns``).

    Raises:
        ValueError: the scale's columns do not divide the weight's (sglang asserts the same).
    """
    k, s_k = q.shape[-1], scale_inv.shape[-1]
    if k % s_k:
        raise ValueError(f"cannot infer the fp8 block of a weight {tuple(q.shape)} from its scale "
                         f"{tuple(scale_inv.shape)}")
    b = k // s_k
    s = scale_inv.to(torch.float32).repeat_interleave(b, dim=-2).repeat_interleave(b, dim=-1)
    return (q.to(torch.float32) * s[..., :q.shape[-2], :k]).to(torch.bfloat16)


def quantized_pairs(names: Iterable[str], dtypes: Mapping[str, torch.dtype]) -> dict[str, str]:
    """Block-fp8 weight -> its scale, as sglang's ``_build_quantized_set`` pairs them (a ``weight``
    whose ``weight_scale_inv`` sibling exists)."""
    names = set(names)
    out = {}
    for n in names:
        prefix, _, leaf = n.rpartition(".")  # sglang renames the module's own parameter name
        scale = (prefix + "." if prefix else "") + leaf.replace("weight", "weight" + SCALE_SUFFIX)
        if leaf.endswith("weight") and dtypes[n] == FP8 and scale in names:
            out[n] = scale
    return out


NOT_CHECKED = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu", "_weight_fp32")
"""Name parts sglang never checks: non-persistent buffers (0.5.23 ``utils/weight_checker.py``
``_NON_PERSISTENT_BUFFER_PATTERNS``; 0.5.16 adds ``_weight_fp32``)."""
KV_SCALES = (".k_scale", ".v_scale")
"""fp8 KV-cache scales: ``layers/quantization/kv_cache.py`` marks them ``_skip_weight_check``."""


def never_checked(name: str) -> bool:
    """A tensor sglang's checker leaves out whatever the request says."""
    return any(p in name for p in NOT_CHECKED) or name.endswith(KV_SCALES)


def listed(named: Sequence[tuple[str, torch.Tensor]], skip: Sequence[str] = ()) -> list[tuple[str, torch.Tensor]]:
    """The tensors sglang's checksum lists, in order, each as it is hashed (module docstring)."""
    tensors = dict(named)
    pairs = quantized_pairs(tensors, {n: t.dtype for n, t in tensors.items()})
    scales = set(pairs.values())
    out = []
    for name, t in named:
        if name in scales or (name not in pairs and never_checked(name)):
            continue
        if name in pairs:
            out.append((name, dequant_bf16(t, tensors[pairs[name]])))
        elif not any(s in name for s in skip):
            out.append((name, t))
    return out


def checksums(named: Sequence[tuple[str, torch.Tensor]], *, skip: Sequence[str] = (),
              gpu: bool | None = None) -> dict[str, str]:
    """sglang's ``checksums`` of a rank's parameters ``named`` (in ``named_parameters()`` order)."""
    return {name: tensor_checksum(t, gpu=gpu) for name, t in listed(named, skip)}


def per_gpu_checksum(sums: Mapping[str, str]) -> str:
    """``overall_checksum``: sha256 over the name-sorted names and values."""
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(name.encode())
        h.update(sums[name].encode())
    return h.hexdigest()


def checksums_by_rank(answer: Mapping[str, Any]) -> dict[int, dict[str, str]]:
    """``{tp_rank: {name: checksum}}`` of one engine's checksum answer, whichever release answered
    (``parallelism_info`` a list of role dicts or one object); a rank listed twice (each DP-attention
    group's leader answers for the whole TP group) keeps its first entry.

    Raises:
        ValueError: not a checksum answer (named what is missing).
    """
    if not answer.get("success", False) or not isinstance(answer.get("ranks"), list):
        raise ValueError(f"not a successful checksum answer: {str(dict(answer))[:300]}")
    out: dict[int, dict[str, str]] = {}
    for k, entry in enumerate(answer["ranks"]):
        info = entry.get("parallelism_info")
        roles = info if isinstance(info, list) else [info] if isinstance(info, dict) else []
        target = next((r for r in roles if r.get("role", "target") == "target"), None)
        rank = int(target["tp_rank"]) if target and "tp_rank" in target else k
        out.setdefault(rank, dict(entry["checksums"]))
    return out
