"""Triton kernel of :func:`weightsync.quant.mla.derive_all` (imported only when it runs: needs Triton).

One program per (layer, head, column block of ``kv_lora_rank``): it reads the head's ``nope``
rows and ``v`` rows of ``kv_b_proj`` once, dequantizes them when fp8 (``q.float() * scale``,
rounded to the destination dtype, as :func:`weightsync.quant.fp8.dequantize_block_fp8`), and
writes ``w_kc[h, :, cols]`` and the transposed ``w_vc[h, cols, :]``.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

LAYER_FIELDS = 4
"""``kv_b offset, scale offset, w_kc offset, w_vc offset``, in elements of each base's dtype."""


@triton.jit
def _derive(table, kv, sc, kc, vc, H: tl.constexpr, N: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
            NP: tl.constexpr, VP: tl.constexpr, BC: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
            FP8: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    layer = pid // H
    h = pid % H
    cb = tl.program_id(1).to(tl.int64)
    kvo = tl.load(table + layer * 4)
    sco = tl.load(table + layer * 4 + 1)
    kco = tl.load(table + layer * 4 + 2)
    vco = tl.load(table + layer * 4 + 3)
    c = cb * BC + tl.arange(0, BC)
    cm = c < C
    nsc = (C + B1 - 1) // B1
    i = tl.arange(0, NP)
    rows = h * (N + V) + i
    m = (i < N)[:, None] & cm[None, :]
    x = tl.load(kv + kvo + rows[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
    if FP8:
        s = tl.load(sc + sco + (rows // B0)[:, None] * nsc + (c // B1)[None, :], mask=m, other=0.0)
        x = x * s
    tl.store(kc + kco + (h * N + i)[:, None] * C + c[None, :], x.to(kc.dtype.element_ty), mask=m)
    j = tl.arange(0, VP)
    rows = h * (N + V) + N + j
    m = (j < V)[:, None] & cm[None, :]
    y = tl.load(kv + kvo + rows[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
    if FP8:
        s = tl.load(sc + sco + (rows // B0)[:, None] * nsc + (c // B1)[None, :], mask=m, other=0.0)
        y = y * s
    tl.store(vc + vco + h * C * V + c[None, :] * V + j[:, None], y.to(vc.dtype.element_ty), mask=m)


def launch(table: Any, kv: Any, sc: Any, kc: Any, vc: Any, *, layers: int, heads: int, nope: int, v: int,
           rank: int, block: tuple[int, int], fp8: bool, block_cols: int = 64, num_warps: int = 4) -> None:
    """Derive every layer of ``table`` on the current stream."""
    grid = (layers * heads, triton.cdiv(rank, block_cols))
    _derive[grid](table, kv, sc, kc, vc, H=heads, N=nope, V=v, C=rank, NP=triton.next_power_of_2(nope),
                  VP=triton.next_power_of_2(v), BC=block_cols, B0=block[0], B1=block[1], FP8=fp8,
                  num_warps=num_warps)
