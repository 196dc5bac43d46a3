"""The Triton copy kernel over a chunk table (imported by :mod:`~weightsync.transport.cuda_batch`
only when a batched copy runs: importing it needs Triton).

One program per table row ``(src_offset, dst_offset, nbytes)``, ``nbytes <= ITERS * BLOCK``; the
loop is static (masked iterations past ``nbytes`` move nothing). In the aligned class every
offset and length is a multiple of 16 and the bases are 256-byte aligned, which the
``multiple_of`` hints tell the compiler, so loads and stores are 16 bytes wide.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl


@triton.jit
def _copy_chunks(table, src_base, dst_base, ITERS: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    so = tl.load(table + pid * 3)
    do = tl.load(table + pid * 3 + 1)
    n = tl.load(table + pid * 3 + 2)
    if ALIGNED:
        so = tl.multiple_of(so, 16)
        do = tl.multiple_of(do, 16)
        n = tl.multiple_of(n, 16)
    offs = tl.arange(0, BLOCK)
    for i in tl.static_range(ITERS):
        o = i * BLOCK + offs
        m = o < n
        x = tl.load(src_base + so + o, mask=m)
        tl.store(dst_base + do + o, x, mask=m)


def launch(t: Any, *, chunk: int, block: int, num_warps: int) -> None:
    """Copy every chunk of the :class:`~weightsync.transport.cuda_batch.ChunkTable` ``t`` on the
    current stream."""
    _copy_chunks[(t.num_chunks,)](
        t.table,
        t.src_arg,
        t.dst_arg,
        ITERS=chunk // block,
        BLOCK=block,
        ALIGNED=t.aligned,
        num_warps=num_warps,
    )
