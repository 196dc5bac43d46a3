"""Packing a trainer rank's transformed ops into staging buckets (the p2p sender's, and the
verification's hash-only pass over the same plan share).

An op with a transform (cast, fp8 block quantization and its scales) cannot be written from
parameter memory: its destination bytes are computed into a staging buffer first. A
:class:`Packer` lays this rank's transformed ops out in buckets of at most ``bucket_bytes``
(every packed region 256-byte aligned), and packs bucket ``i`` into the staging tensor it is
given for it (fp8 ops as fused quantization tables, :mod:`weightsync.quant.fp8_fused`; casts and
boxes those tables cannot express one at a time). The layout is a pure function of the ops and
the destination shapes, so two packers of the same share put every op at the same offset.

Typical usage::

    packer = Packer(staged_ops, params, dests, bucket_bytes=1 << 30)
    staging = [torch.empty(packer.capacity, dtype=torch.uint8) for _ in range(2)]
    packer.compile(lambda i: staging[i % 2])
    for i in range(packer.num_buckets):
        packer.pack(i)          # the bytes of bucket i, at each op's offset, in staging[i % 2]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weightsync.layout.box import box_shape, box_slices, box_volume
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.ops import CopyOp
from weightsync.quant.fp8 import block_scale_inv, quantize_block_fp8
from weightsync.quant.fp8_fused import FusedQuant, QuantTask


@dataclass(frozen=True, kw_only=True, slots=True)
class DestParam:
    """One parameter of a rollout rank as the engine publishes it (address in the engine; 0 where
    only the shape and dtype matter)."""

    addr: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Staged:
    """A transformed op: packed at ``offset`` of its bucket's staging, ``nbytes`` long."""

    op: CopyOp
    offset: int
    nbytes: int


def fp8_blocks(inputs: PlanInputs) -> dict[str, tuple[int, int]]:
    """Global weight name -> its fp8 block, for every weight the engines store block-quantized."""
    return {g.name: g.block for g in inputs.globals.values() if g.block is not None and g.quant_of is None}


def pair_runs(src: list[tuple[int, int]], dst: list[tuple[int, int]], src_base: int, dst_base: int) -> np.ndarray:
    """Pair two run lists of equal total length into ``(src_addr, dst_addr, nbytes)`` rows."""
    out: list[tuple[int, int, int]] = []
    i = j = 0
    so, sl = src[0]
    do, dl = dst[0]
    while True:
        n = min(sl, dl)
        out.append((src_base + so, dst_base + do, n))
        so, sl, do, dl = so + n, sl - n, do + n, dl - n
        if sl == 0:
            i += 1
            if i == len(src):
                break
            so, sl = src[i]
        if dl == 0:
            j += 1
            do, dl = dst[j]
    return np.array(out, dtype=np.int64).reshape(-1, 3)


def scales_after_weights(staged: Sequence[CopyOp]) -> list[CopyOp]:
    """The staged ops with each ``fp8_scale`` op right after the ``fp8_quant`` op of the same
    source box, so that both land in one bucket and the fused packing reads the box once.

    The plan lists a parameter's values before its scales (all experts' ``w13_weight`` boxes,
    then their scales): bucketed in that order, a scale op is packed in another bucket than its
    weight and reads the bf16 source a second time (Kimi-K2, two layers: 68 GB read instead of
    34). The staging order is free: every op has its own region and runs.
    """
    scales: dict[tuple[str, int, tuple[tuple[int, int], ...]], list[CopyOp]] = defaultdict(list)
    for op in staged:
        if op.transform == "fp8_scale":
            scales[(op.src_param, op.dst_rank, op.src_box)].append(op)
    out: list[CopyOp] = []
    for op in staged:
        if op.transform == "fp8_scale":
            continue
        out.append(op)
        if op.transform == "fp8_quant":
            out.extend(scales.pop((op.src_param, op.dst_rank, op.src_box), []))
    out.extend(op for ops in scales.values() for op in ops)  # scales whose weight another rank sends
    return out


class Packer:
    """The staging layout of one rank's transformed ops, and their packing (module docstring)."""

    def __init__(self, ops: Sequence[CopyOp], params: Mapping[str, torch.Tensor],
                 dests: Mapping[int, Mapping[str, DestParam]], *, bucket_bytes: int,
                 fp8_blocks: Mapping[str, tuple[int, int]] | None = None) -> None:
        """Args:
        ops: this rank's transformed ops (checked against ``params`` and ``dests`` already).
        params: this rank's parameters by name.
        dests: rollout rank -> its parameters (shape and dtype).
        bucket_bytes: the most a bucket holds (an op larger than it gets a bucket of its own).
        fp8_blocks: global weight name -> fp8 block, for ops that quantize.
        """
        self.params = params
        self.dests = dests
        self.fp8_blocks = dict(fp8_blocks or {})
        self.bucket_bytes = bucket_bytes
        self.buckets = self._make_buckets(scales_after_weights(ops))
        # a bucket ends where its last packed region ends (regions start 256-byte aligned)
        self.capacity = max((b[-1].offset + b[-1].nbytes for b in self.buckets), default=0)
        """Bytes one staging tensor needs to hold any bucket."""
        self._packs: list[tuple[list[FusedQuant], list[Staged], torch.Tensor]] = []

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def dest(self, op: CopyOp) -> DestParam:
        return self.dests[op.dst_rank][op.dst_param]

    def _make_buckets(self, staged: Sequence[CopyOp]) -> list[list[Staged]]:
        buckets: list[list[Staged]] = []
        cur: list[Staged] = []
        used = 0
        for op in staged:
            n = box_volume(op.dst_box) * self.dest(op).itemsize
            if cur and used + n > self.bucket_bytes:
                buckets.append(cur)
                cur, used = [], 0
            cur.append(Staged(op=op, offset=used, nbytes=n))
            used += -(-n // 256) * 256  # keep every packed region 256-byte aligned
        if cur:
            buckets.append(cur)
        return buckets

    def compile(self, staging_of: Callable[[int], torch.Tensor]) -> None:
        """Prepare the packing of every bucket into ``staging_of(bucket index)`` (a uint8 tensor
        of at least :attr:`capacity` bytes that stays allocated)."""
        self._packs = [(*self._compile_pack(b, staging_of(i)), staging_of(i)) for i, b in enumerate(self.buckets)]

    def _compile_pack(self, bucket: Sequence[Staged], staging: torch.Tensor) -> tuple[list[FusedQuant], list[Staged]]:
        """The bucket's fp8 ops as fused quantization tables (one per fp8 block size), and the ops
        packed one at a time (casts, and boxes the tables cannot express).

        An ``fp8_scale`` op whose weight box is quantized by an ``fp8_quant`` op of the same bucket
        joins that op's task, so the source is read once for the values and the scales.
        """
        tasks: dict[tuple[int, int], list[QuantTask]] = defaultdict(list)
        rest: list[Staged] = []
        quant_at: dict[tuple[str, tuple[tuple[int, int], ...]], tuple[tuple[int, int], int]] = {}
        scales: list[tuple[Staged, torch.Tensor, torch.Tensor]] = []
        for s in bucket:
            op = s.op
            dp = self.dest(op)
            src = self._quant_source(op) if op.transform in ("fp8_quant", "fp8_scale") else None
            if src is None:
                rest.append(s)
                continue
            block = self._block(op)
            out = staging[s.offset : s.offset + s.nbytes].view(dp.dtype)
            if op.transform == "fp8_quant" and dp.dtype == torch.float8_e4m3fn:
                quant_at[(op.src_param, op.src_box)] = (block, len(tasks[block]))
                tasks[block].append(QuantTask(src=src, q=out.view(src.shape)))
            elif op.transform == "fp8_scale" and dp.dtype == torch.float32:
                nr, nc = -(-src.shape[0] // block[0]), -(-src.shape[1] // block[1])
                if out.numel() != nr * nc:
                    rest.append(s)
                    continue
                scales.append((s, src, out.view(nr, nc)))
            else:
                rest.append(s)
        for s, src, out in scales:
            block = self._block(s.op)
            hit = quant_at.pop((s.op.src_param, s.op.src_box), None)
            if hit is not None and hit[0] == block:
                t = tasks[block][hit[1]]
                tasks[block][hit[1]] = QuantTask(src=t.src, q=t.q, scale=out)
            else:
                tasks[block].append(QuantTask(src=src, scale=out))
        return [FusedQuant(ts, block) for block, ts in tasks.items()], rest

    def _quant_source(self, op: CopyOp) -> torch.Tensor | None:
        """The op's source box as a 2-D view of the parameter (None when it is not one)."""
        view = self.params[op.src_param][box_slices(op.src_box)]
        if view.dim() < 2 or any(d != 1 for d in view.shape[:-2]):
            return None
        view = view.reshape(view.shape[-2:])
        return view if view.shape[1] <= 1 or view.stride(1) == 1 else None

    def _block(self, op: CopyOp) -> tuple[int, int]:
        block = self.fp8_blocks.get(op.global_name.removesuffix("_scale_inv"))
        if block is None:
            raise ValueError(f"no fp8 block size known for {op.global_name}; pass fp8_blocks to the sender")
        return block

    def pack(self, index: int) -> None:
        """Pack bucket ``index`` into its staging (enqueued on the current stream on a GPU)."""
        fused, rest, staging = self._packs[index]
        for f in fused:
            f.run()
        for s in rest:
            op = s.op
            dp = self.dest(op)
            src = self.params[op.src_param][box_slices(op.src_box)]
            if op.transform == "cast":
                out = src.to(dp.dtype)
            elif op.transform in ("fp8_quant", "fp8_scale"):
                block = self._block(op)
                if op.transform == "fp8_quant":
                    out, _ = quantize_block_fp8(src.reshape(box_shape(op.src_box)[-2:]), block)
                else:
                    out = block_scale_inv(src.reshape(box_shape(op.src_box)[-2:]), block)
            else:
                raise ValueError(f"unknown transform {op.transform!r} on {op.global_name}")
            view = staging[s.offset : s.offset + s.nbytes].view(dp.dtype)
            view.copy_(out.reshape(-1))
