"""Triton kernel of :mod:`weightsync.quant.fp8_fused` (imported only when it runs: needs Triton).

One program per (task, block row, group of ``G`` column blocks): it loads a ``[B0, G * B1]``
tile of the source once, takes each ``[B0, B1]`` block's amax, and writes the fp8 values and
the block scales. Every arithmetic step is the one of :func:`weightsync.quant.fp8.quantize_block_fp8`
in the same float32 rounding: ``amax = max(max|x|, 1e-4)``; ``factor = rn(1 / amax) * 448``
(torch's ``448 / amax`` is ``amax.reciprocal() * 448``); ``q = fp8_rn(clamp(x * factor))``;
``scale_inv = rn(amax / 448)``. Masked lanes load zeros, which never raise an amax (as the
reference's zero padding).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-4)
TASK_FIELDS = 7
"""``src_offset (elements), src_pitch (elements), rows, cols, q_offset (bytes), scale_offset
(bytes), flags`` (bit 0: write q, bit 1: write the scales)."""


@triton.jit
def _quant_blocks(tasks, strips, src_base, out_base, B0: tl.constexpr, B1: tl.constexpr, G: tl.constexpr,
                  ALIGNED: tl.constexpr):
    sid = tl.program_id(0).to(tl.int64)
    gid = tl.program_id(1).to(tl.int64)
    task = tl.load(strips + sid * 2)
    brow = tl.load(strips + sid * 2 + 1)
    t = tasks + task * 7
    so = tl.load(t)
    pitch = tl.load(t + 1)
    rows = tl.load(t + 2)
    cols = tl.load(t + 3)
    qo = tl.load(t + 4)
    sco = tl.load(t + 5)
    flags = tl.load(t + 6)
    if ALIGNED:
        so = tl.multiple_of(so, 8)
        pitch = tl.multiple_of(pitch, 8)
        cols = tl.multiple_of(cols, 16)
        qo = tl.multiple_of(qo, 16)
    r = brow * B0 + tl.arange(0, B0)
    c = gid * (G * B1) + tl.arange(0, G * B1)
    m = (r < rows)[:, None] & (c < cols)[None, :]
    x = tl.load(src_base + so + r[:, None] * pitch + c[None, :], mask=m, other=0.0).to(tl.float32)
    x3 = tl.reshape(x, (B0, G, B1))
    amax = tl.max(tl.max(tl.abs(x3), axis=2), axis=0)
    amax = tl.maximum(amax, AMAX_FLOOR)
    one = tl.full((G,), 1.0, tl.float32)
    factor = tl.div_rn(one, amax) * FP8_MAX
    q3 = x3 * factor[None, :, None]
    q3 = tl.minimum(tl.maximum(q3, -FP8_MAX), FP8_MAX)
    q = tl.reshape(q3, (B0, G * B1)).to(tl.float8e4nv)
    qp = (out_base + qo).to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    tl.store(qp + r[:, None] * cols + c[None, :], q, mask=m & ((flags & 1) != 0))
    nbc = (cols + B1 - 1) // B1
    bc = gid * G + tl.arange(0, G)
    sp = (out_base + sco).to(tl.pointer_type(tl.float32), bitcast=True)
    scale = tl.div_rn(amax, tl.full((G,), FP8_MAX, tl.float32))
    tl.store(sp + brow * nbc + bc, scale, mask=(bc < nbc) & ((flags & 2) != 0) & (brow * B0 < rows))


def launch(tasks: Any, strips: Any, src: Any, out: Any, *, block: tuple[int, int], group: int, col_groups: int,
           aligned: bool, num_warps: int) -> None:
    """Run every task of the tables on the current stream (see :class:`~weightsync.quant.fp8_fused.FusedQuant`)."""
    _quant_blocks[(strips.shape[0], col_groups)](
        tasks, strips, src, out, B0=block[0], B1=block[1], G=group, ALIGNED=aligned, num_warps=num_warps
    )
