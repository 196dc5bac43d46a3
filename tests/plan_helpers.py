"""Test-side helpers over a plan's ops: per-rank filtering, a columnar table built from a list of
ops, and the byte runs of untransformed ops.

Second implementations of what the planner computes on its own path (per-rank plans, op tables),
so that tests can compare the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from weightsync.layout.box import Box
from weightsync.plan.ops import TRANSFORMS, CopyOp, box_runs
from weightsync.plan.table import MAX_DIMS, OpTable, pad_box


def filter_ops(ops: Sequence[CopyOp], *, src_rank: int | None = None, dst_rank: int | None = None) -> list[CopyOp]:
    """The ops of one rank, in plan order."""
    return [op for op in ops if (src_rank is None or op.src_rank == src_rank)
            and (dst_rank is None or op.dst_rank == dst_rank)]


def ops_to_table(ops: Sequence[CopyOp], global_names: Sequence[str] = ()) -> OpTable:
    """Build the columnar table of ``ops``.

    Args:
        ops: the ops.
        global_names: optional initial global name table (e.g. the model's order), so that ids are
            stable across plans of the same model.

    Returns:
        The table.
    """
    gmap = {n: i for i, n in enumerate(global_names)}
    pmap: dict[str, int] = {}
    tmap = {t: i for i, t in enumerate(TRANSFORMS)}
    boxes: dict[Box, tuple[int, ...]] = {}
    ints: list[tuple[int, ...]] = []
    bx: list[tuple[int, ...]] = []
    for op in ops:
        g = gmap.get(op.global_name)
        if g is None:
            g = gmap[op.global_name] = len(gmap)
        sp = pmap.get(op.src_param)
        if sp is None:
            sp = pmap[op.src_param] = len(pmap)
        dp = pmap.get(op.dst_param)
        if dp is None:
            dp = pmap[op.dst_param] = len(pmap)
        gb = boxes.get(op.global_box)
        if gb is None:
            gb = boxes[op.global_box] = pad_box(op.global_box)
        sb = boxes.get(op.src_box)
        if sb is None:
            sb = boxes[op.src_box] = pad_box(op.src_box)
        db = boxes.get(op.dst_box)
        if db is None:
            db = boxes[op.dst_box] = pad_box(op.dst_box)
        ints.append((g, op.src_rank, sp, op.dst_rank, dp, tmap[op.transform], op.zero_copy,
                     len(op.global_box), len(op.src_box), len(op.dst_box)))
        bx.append(gb + sb + db)
    n = len(ints)
    ia = np.array(ints, dtype=np.int64).reshape(n, 10)
    ba = np.array(bx, dtype=np.int32).reshape(n, 6 * MAX_DIMS)
    D = MAX_DIMS
    return OpTable(
        global_names=tuple(gmap),
        param_names=tuple(pmap),
        gid=ia[:, 0].astype(np.int32),
        src_rank=ia[:, 1].astype(np.int32),
        src_pid=ia[:, 2].astype(np.int32),
        dst_rank=ia[:, 3].astype(np.int32),
        dst_pid=ia[:, 4].astype(np.int32),
        transform=ia[:, 5].astype(np.int8),
        zero_copy=ia[:, 6].astype(bool),
        g_nd=ia[:, 7].astype(np.int8),
        s_nd=ia[:, 8].astype(np.int8),
        d_nd=ia[:, 9].astype(np.int8),
        g_lo=ba[:, 0:D], g_hi=ba[:, D:2 * D],
        s_lo=ba[:, 2 * D:3 * D], s_hi=ba[:, 3 * D:4 * D],
        d_lo=ba[:, 4 * D:5 * D], d_hi=ba[:, 5 * D:6 * D],
    )


def write_runs(ops: Iterable[CopyOp], src_shape: dict[tuple[int, str], tuple[int, ...]],
               dst_shape: dict[tuple[int, str], tuple[int, ...]], itemsize: dict[tuple[int, str], int]
               ) -> list[tuple[int, int, int]]:
    """Byte runs ``(src_offset, dst_offset, length)`` of untransformed ops between one
    (src param, dst param) pair, with runs that continue each other merged.

    Args:
        ops: untransformed ops, all from one source param to one destination param.
        src_shape: ``(rank, param) -> shape`` of sources.
        dst_shape: ``(rank, param) -> shape`` of destinations.
        itemsize: ``(rank, param) -> bytes per element`` of sources.

    Returns:
        Runs sorted by destination offset.
    """
    runs: list[tuple[int, int, int]] = []
    for op in ops:
        if op.transform is not None:
            raise ValueError(f"write_runs: op on {op.global_name} has transform {op.transform}")
        isz = itemsize[(op.src_rank, op.src_param)]
        s_runs = box_runs(src_shape[(op.src_rank, op.src_param)], op.src_box, isz)
        d_runs = box_runs(dst_shape[(op.dst_rank, op.dst_param)], op.dst_box, isz)
        runs.extend(_pair_runs(s_runs, d_runs))
    runs.sort(key=lambda r: r[1])
    out: list[tuple[int, int, int]] = []
    for r in runs:
        if out and out[-1][0] + out[-1][2] == r[0] and out[-1][1] + out[-1][2] == r[1]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + r[2])
        else:
            out.append(r)
    return out


def _pair_runs(s_runs: list[tuple[int, int]], d_runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Split two run lists of equal total length into common pieces (src, dst, len)."""
    out = []
    i = j = 0
    so, sl = s_runs[0] if s_runs else (0, 0)
    do, dl = d_runs[0] if d_runs else (0, 0)
    while i < len(s_runs) and j < len(d_runs):
        n = min(sl, dl)
        out.append((so, do, n))
        so, sl, do, dl = so + n, sl - n, do + n, dl - n
        if sl == 0:
            i += 1
            if i < len(s_runs):
                so, sl = s_runs[i]
        if dl == 0:
            j += 1
            if j < len(d_runs):
                do, dl = d_runs[j]
    return out
