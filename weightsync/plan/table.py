"""Columnar form of a list of ops: numpy arrays plus string tables.

The verifier, the statistics and the on-disk form of a plan work on this table rather than on
op objects, so that checks over a million ops are array operations. Boxes are stored
right-aligned in ``D`` dims (``lo``/``hi`` arrays of shape ``[n, D]``), leading dims padded
with ``[0, 1)``: a box keeps its row-major byte layout under that padding.

Legend: ``g`` = global box, ``s`` = source (local) box, ``d`` = destination (local) box.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.layout.box import Box
from weightsync.plan.ops import TRANSFORMS, CopyOp

MAX_DIMS = 3
"""Boxes have at most this many dims (a 2-D global box in a 3-D stacked-expert tensor)."""


def pad_box(box: Box, ndim: int = MAX_DIMS) -> tuple[int, ...]:
    """``(lo_0..lo_{D-1}, hi_0..hi_{D-1})`` of ``box`` right-aligned in ``ndim`` dims."""
    k = ndim - len(box)
    if k < 0:
        raise ValueError(f"box {box} has more than {ndim} dims")
    return (0,) * k + tuple(a for a, _ in box) + (1,) * k + tuple(b for _, b in box)


def unpad_box(lo: np.ndarray, hi: np.ndarray, nd: int) -> Box:
    d = len(lo)
    return tuple((int(lo[i]), int(hi[i])) for i in range(d - nd, d))


@dataclass(frozen=True, kw_only=True, eq=False)
class OpTable:
    """Ops as arrays. ``gid`` indexes ``global_names``; ``*_pid`` index ``param_names``."""

    global_names: tuple[str, ...]
    param_names: tuple[str, ...]
    gid: np.ndarray
    src_rank: np.ndarray
    src_pid: np.ndarray
    dst_rank: np.ndarray
    dst_pid: np.ndarray
    transform: np.ndarray
    """Index into :data:`weightsync.plan.ops.TRANSFORMS`."""
    zero_copy: np.ndarray
    g_lo: np.ndarray
    g_hi: np.ndarray
    g_nd: np.ndarray
    s_lo: np.ndarray
    s_hi: np.ndarray
    s_nd: np.ndarray
    d_lo: np.ndarray
    d_hi: np.ndarray
    d_nd: np.ndarray

    def __len__(self) -> int:
        return len(self.gid)

    def op(self, i: int) -> CopyOp:
        """Op ``i`` as a record."""
        return CopyOp(
            self.global_names[self.gid[i]],
            unpad_box(self.g_lo[i], self.g_hi[i], int(self.g_nd[i])),
            int(self.src_rank[i]),
            self.param_names[self.src_pid[i]],
            unpad_box(self.s_lo[i], self.s_hi[i], int(self.s_nd[i])),
            int(self.dst_rank[i]),
            self.param_names[self.dst_pid[i]],
            unpad_box(self.d_lo[i], self.d_hi[i], int(self.d_nd[i])),
            TRANSFORMS[int(self.transform[i])],
            bool(self.zero_copy[i]),
        )

    def ops(self) -> list[CopyOp]:
        """All ops as records, in table order."""
        gn, pn = self.global_names, self.param_names
        cols = [a.tolist() for a in (self.gid, self.src_rank, self.src_pid, self.dst_rank, self.dst_pid,
                                     self.transform, self.zero_copy, self.g_nd, self.s_nd, self.d_nd)]
        boxes = [a.tolist() for a in (self.g_lo, self.g_hi, self.s_lo, self.s_hi, self.d_lo, self.d_hi)]
        cache: dict[tuple, Box] = {}

        def box(lo: list[int], hi: list[int], nd: int) -> Box:
            key = (*lo, *hi, nd)
            got = cache.get(key)
            if got is None:
                k = len(lo) - nd
                got = cache[key] = tuple(zip(lo[k:], hi[k:], strict=True))
            return got

        out = []
        for i, (g, sr, sp, dr, dp, tr, zc, gnd, snd, dnd) in enumerate(zip(*cols, strict=True)):
            out.append(CopyOp(gn[g], box(boxes[0][i], boxes[1][i], gnd), sr, pn[sp], box(boxes[2][i], boxes[3][i], snd),
                              dr, pn[dp], box(boxes[4][i], boxes[5][i], dnd), TRANSFORMS[tr], zc))
        return out

    def select(self, mask: np.ndarray) -> OpTable:
        """The ops where ``mask`` holds (or at the given indexes), same name tables."""
        return OpTable(global_names=self.global_names, param_names=self.param_names,
                       **{k: getattr(self, k)[mask] for k in _ARRAY_FIELDS})

    def arrays(self) -> dict[str, np.ndarray]:
        """All array columns by name (the serialized form, with the two string tables)."""
        return {k: getattr(self, k) for k in _ARRAY_FIELDS}


_ARRAY_FIELDS = ("gid", "src_rank", "src_pid", "dst_rank", "dst_pid", "transform", "zero_copy", "g_lo", "g_hi",
                 "g_nd", "s_lo", "s_hi", "s_nd", "d_lo", "d_hi", "d_nd")


def table_from_arrays(global_names: Sequence[str], param_names: Sequence[str], arrays: dict[str, np.ndarray]
                      ) -> OpTable:
    """Inverse of :meth:`OpTable.arrays` (checks that every column is there)."""
    missing = [k for k in _ARRAY_FIELDS if k not in arrays]
    if missing:
        raise ValueError(f"op table is missing columns {missing}")
    return OpTable(global_names=tuple(global_names), param_names=tuple(param_names),
                   **{k: np.asarray(arrays[k]) for k in _ARRAY_FIELDS})
