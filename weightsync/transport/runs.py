"""Run arithmetic: pure functions over ``(N, 3)`` int64 arrays of ``[src, dst, nbytes]`` runs.

A transport validates a write's runs once (:func:`as_runs`), merges runs that follow on
(:func:`coalesce_runs`), groups equal strided runs into 2-D blocks for backends that copy in 2-D
(:func:`strided_blocks`) and moves destinations into its own view of a mapped peer
(:func:`rebase_dst`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from weightsync.transport.records import Run
from weightsync.transport.region_table import RegionTable


def as_runs(runs: Sequence[Run] | np.ndarray) -> np.ndarray:
    """Runs as a fresh ``(N, 3)`` int64 array ``[src, dst, nbytes]``.

    Raises:
        ValueError: wrong shape, or a run with ``nbytes <= 0`` or a non-positive address.
    """
    arr = np.array(runs, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"runs must be (src_addr, dst_addr, nbytes) triples; got an array of shape {arr.shape}")
    bad = np.flatnonzero((arr[:, 2] <= 0) | (arr[:, 0] <= 0) | (arr[:, 1] <= 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"run {i} = {tuple(int(x) for x in arr[i])}: addresses and nbytes must be positive")
    return arr


def coalesce_runs(runs: np.ndarray, keys: np.ndarray | None = None) -> np.ndarray:
    """Merge each run into the previous one when both its source and destination follow on.

    Order is kept, so the concatenated byte stream of the runs is unchanged. With ``keys``
    (one int per run), runs merge only when their keys are equal too: used to keep runs from
    crossing region boundaries.
    """
    if len(runs) <= 1:
        return runs.copy()
    src, dst, n = runs[:, 0], runs[:, 1], runs[:, 2]
    follows = (src[1:] == src[:-1] + n[:-1]) & (dst[1:] == dst[:-1] + n[:-1])
    if keys is not None:
        follows &= keys[1:] == keys[:-1]
    starts = np.concatenate(([True], ~follows))
    group = np.cumsum(starts) - 1
    out = runs[starts].copy()
    out[:, 2] = np.bincount(group, weights=n, minlength=len(out)).astype(np.int64)
    return out


BLOCK_FIELDS = ("src", "dst", "width", "height", "src_pitch", "dst_pitch")


def strided_blocks(runs: np.ndarray) -> np.ndarray:
    """Group consecutive runs of equal width and constant pitches into 2-D blocks.

    A box in a row-major tensor (a column slice of a row-parallel weight, say) is many equal runs
    at a constant stride on both sides; one 2-D copy (``cudaMemcpy2DAsync``, a strided numpy copy)
    moves it at a fraction of the per-run cost. Pitches are kept >= width so rows never overlap.

    Returns:
        ``(M, 6)`` int64 array with columns :data:`BLOCK_FIELDS`; a single run is a block of
        height 1 with pitches equal to its width.
    """
    blocks: list[list[int]] = []
    rows = runs.tolist()
    i = 0
    while i < len(rows):
        s, d, w = rows[i]
        h, sp, dp = 1, w, w
        if i + 1 < len(rows):
            s1, d1, w1 = rows[i + 1]
            sp1, dp1 = s1 - s, d1 - d
            if w1 == w and sp1 >= w and dp1 >= w:
                h, sp, dp = 2, sp1, dp1
                while i + h < len(rows):
                    sk, dk, wk = rows[i + h]
                    if wk != w or sk != s + h * sp or dk != d + h * dp:
                        break
                    h += 1
        blocks.append([s, d, w, h, sp, dp])
        i += h
    return np.array(blocks, dtype=np.int64).reshape(-1, 6)


def rebase_dst(runs: np.ndarray, table: RegionTable, local_bases: np.ndarray, dst_idx: np.ndarray) -> np.ndarray:
    """Runs with each destination moved from its region's published address to ``local_bases``.

    ``local_bases[i]`` is where this process sees the first byte of ``table.regions[i]`` (a shm
    mapping, an opened CUDA IPC pointer); ``dst_idx`` comes from :meth:`RegionTable.locate`.
    """
    out = runs.copy()
    out[:, 1] = local_bases[dst_idx] + (runs[:, 1] - table.starts[dst_idx])
    return out
