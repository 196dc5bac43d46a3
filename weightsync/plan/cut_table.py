"""The cuts of one engine rank as arrays, ready for the vectorized holder choice.

An engine rank's cuts are made once (:func:`build_cut_table`) and then expanded to every
engine: only the holder choice and the destination rank differ between engines, so the
per-op work is numpy. Holders are stored CSR-style: cut ``i`` owns holder rows
``h_start[i] : h_start[i] + h_count[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.layout.box import Box, LocalTensor
from weightsync.plan.cuts import Cut, Cutter, normalize_pieces
from weightsync.plan.ops import TRANSFORMS, box_is_contiguous
from weightsync.plan.table import MAX_DIMS, pad_box

D = MAX_DIMS


class NameTable:
    """Interned names and shared rows of one plan: global tensors first (model order), then
    parameters as they are met; and the holder rows of every cut made so far."""

    def __init__(self, global_names: Sequence[str]) -> None:
        self.globals = list(global_names)
        self.gid = {n: i for i, n in enumerate(self.globals)}
        self.params: list[str] = []
        self.pid: dict[str, int] = {}
        self.padded: dict[Box, tuple[int, ...]] = {}
        """Padded form of each box met (boxes recur across ranks)."""
        self._h_index: dict[tuple[int, Box, bool], int] = {}
        self._h_rows: list[tuple[int, ...]] = []
        self._h_boxes: list[tuple[int, ...]] = []
        self._holders: HolderTable | None = None

    def param(self, name: str) -> int:
        i = self.pid.get(name)
        if i is None:
            i = self.pid[name] = len(self.params)
            self.params.append(name)
        return i

    def global_id(self, name: str) -> int:
        i = self.gid.get(name)
        if i is None:
            i = self.gid[name] = len(self.globals)
            self.globals.append(name)
        return i

    def pad(self, box: Box) -> tuple[int, ...]:
        got = self.padded.get(box)
        if got is None:
            got = self.padded[box] = pad_box(box)
        return got

    def holder_start(self, cut: Cut) -> int:
        """First row of ``cut``'s holders in the shared holder table (added on first sight:
        replicated cuts recur on every rank and share rows)."""
        key = (id(cut.holders), cut.src_gbox, cut.transform is None)
        start = self._h_index.get(key)
        if start is None:
            start = self._h_index[key] = len(self._h_rows)
            for k, h in enumerate(cut.holders):
                sbox = cut.source_box(k)
                zc = cut.transform is None and box_is_contiguous(h.tensor.shape, sbox)
                self._h_rows.append((h.rank, self.param(h.tensor.name), zc, len(sbox)))
                self._h_boxes.append(self.pad(sbox))
            self._holders = None
        return start

    def holders(self) -> HolderTable:
        """The holder rows added so far, as arrays."""
        if self._holders is None:
            n = len(self._h_rows)
            h = np.array(self._h_rows, dtype=np.int64).reshape(n, 4)
            hb = np.array(self._h_boxes, dtype=np.int32).reshape(n, 2 * D)
            self._holders = HolderTable(rank=h[:, 0].astype(np.int32), pid=h[:, 1].astype(np.int32),
                                        zc=h[:, 2].astype(bool), s_nd=h[:, 3].astype(np.int8), s_lo=hb[:, :D],
                                        s_hi=hb[:, D:])
        return self._holders


@dataclass(eq=False)
class HolderTable:
    """Source side of cuts: one row per (cut class, holder)."""

    rank: np.ndarray
    pid: np.ndarray
    zc: np.ndarray
    """Zero-copy: untransformed and one contiguous run of the source tensor."""
    s_lo: np.ndarray
    s_hi: np.ndarray
    s_nd: np.ndarray


@dataclass(eq=False)
class CutTable:
    """Cuts of engine rank ``rank``; cut ``i`` has holder rows
    ``h_start[i] : h_start[i] + h_count[i]`` of the plan's :class:`HolderTable`."""

    rank: int
    j: np.ndarray
    """Index of the cut within its destination tensor."""
    gid: np.ndarray
    src_ord: np.ndarray
    """Ordinal of the source global tensor in the model's order (the choice rule's offset)."""
    dst_pid: np.ndarray
    transform: np.ndarray
    nbytes: np.ndarray
    g_lo: np.ndarray
    g_hi: np.ndarray
    g_nd: np.ndarray
    d_lo: np.ndarray
    d_hi: np.ndarray
    d_nd: np.ndarray
    h_start: np.ndarray
    h_count: np.ndarray

    def __len__(self) -> int:
        return len(self.gid)


def build_cut_table(tensors: Sequence[LocalTensor], rank: int, cutter: Cutter, names: NameTable,
                    only: set[int] | None = None) -> CutTable:
    """Cut every written tensor of one engine rank along the source pieces and tabulate the cuts.

    Args:
        tensors: the engine rank's layout.
        rank: the rank inside the engine.
        cutter: cuts pieces along the source pieces (shared by all ranks of a plan).
        names: the plan's name table (extended with new parameter names and holder rows).
        only: indexes of the tensors to cut (default: all).

    Returns:
        The table, cuts in layout order.
    """
    ordinal = names.gid
    tmap = {t: i for i, t in enumerate(TRANSFORMS)}
    pad = names.pad
    rows: list[tuple[int, ...]] = []
    boxes: list[tuple[int, ...]] = []
    for i, t in enumerate(tensors):
        if t.derived or (only is not None and i not in only):
            continue
        cuts: list[Cut] = []
        for p in normalize_pieces(t):
            cuts.extend(cutter.cut(t, p))
        dpid = names.param(t.name)
        for j, cut in enumerate(cuts):
            rows.append((j, names.global_id(cut.global_name), ordinal[cut.src_global], dpid, tmap[cut.transform],
                         cut.nbytes, len(cut.global_box), len(cut.dst_box), names.holder_start(cut),
                         len(cut.holders)))
            boxes.append(pad(cut.global_box) + pad(cut.dst_box))
    r = np.array(rows, dtype=np.int64).reshape(len(rows), 10)
    rb = np.array(boxes, dtype=np.int32).reshape(len(boxes), 4 * D)
    return CutTable(
        rank=rank, j=r[:, 0], gid=r[:, 1].astype(np.int32), src_ord=r[:, 2], dst_pid=r[:, 3].astype(np.int32),
        transform=r[:, 4].astype(np.int8), nbytes=r[:, 5], g_nd=r[:, 6].astype(np.int8),
        d_nd=r[:, 7].astype(np.int8), h_start=r[:, 8], h_count=r[:, 9],
        g_lo=rb[:, 0:D], g_hi=rb[:, D:2 * D], d_lo=rb[:, 2 * D:3 * D], d_hi=rb[:, 3 * D:],
    )
