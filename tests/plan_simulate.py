"""Data simulation of a plan: run it on random tensors and compare with the engine layout, bit for bit.

1. Random global tensors in their real dtypes (bf16 weights, float32 router bias).
2. Source shards: every trainer rank's local tensors filled from them through the trainer
   layout (padding zero). For a broadcast plan the stage sources then *gather* full tensors from
   those shards (every element must be found on some rank) and convert them to the wire format
   (fp8 weights are block-quantized, ``scale_inv`` computed).
3. Execute the ops with array copies and the transforms of :mod:`weightsync.quant.fp8`.
4. Expected: every rollout rank's local tensors filled from the same global tensors through the
   engine layout; fp8 weights and scales from quantizing the whole global tensor. Padding and
   derived tensors stay zero on both sides.

Everything runs on CPU; meant for tiny and layers=N scales in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from weightsync.layout.box import LocalTensor, box_shape, box_slices
from weightsync.models.dtypes import torch_dtype
from weightsync.plan.api import plan_source_layouts
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.ops import CopyOp
from weightsync.plan.records import Mode, Plan
from weightsync.quant.fp8 import block_scale_inv, quantize_block_fp8


@dataclass(kw_only=True)
class SimulationReport:
    """Outcome of :func:`simulate`."""

    num_ops: int
    tensors_compared: int
    mismatches: list[str] = field(default_factory=list)
    """One line per destination tensor that differs from the expected one."""

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def raise_if_failed(self) -> None:
        if self.mismatches:
            shown = "\n  ".join(self.mismatches[:10])
            raise AssertionError(f"simulation: {len(self.mismatches)} destination tensors differ:\n  {shown}")



def random_globals(inputs: PlanInputs, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random values for every global tensor that has a source (scale tensors are derived)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, g in inputs.globals.items():
        if g.quant_of is not None:
            continue
        out[name] = torch.randn(g.shape, generator=gen, dtype=torch.float32).to(torch_dtype(g.dtype))
    return out


def _fill(tensors: Sequence[LocalTensor], values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Allocate ``tensors`` (zeros) and copy every piece from ``values``."""
    out = {}
    for t in tensors:
        buf = torch.zeros(t.shape, dtype=torch_dtype(t.dtype))
        if not t.derived:
            for p in t.pieces:
                value = values[p.global_name][box_slices(p.global_box)]
                buf[box_slices(p.local_box)] = value.reshape(box_shape(p.local_box))
        out[t.name] = buf
    return out


def engine_values(inputs: PlanInputs, globals_: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each global tensor in the form the engine stores it: fp8 weights quantized, scales computed."""
    fp8 = {p.global_name for ts in inputs.engine_layouts for t in ts if t.dtype == "float8_e4m3fn" for p in t.pieces}
    out = dict(globals_)
    for name, g in inputs.globals.items():
        if name in fp8:
            assert g.block is not None
            out[name] = quantize_block_fp8(globals_[name], g.block)[0]
        elif g.quant_of is not None:
            assert g.block is not None
            out[name] = block_scale_inv(globals_[g.quant_of], g.block)
    return out


def _gather(inputs: PlanInputs, shards: list[dict[str, torch.Tensor]], gathered: Sequence[Sequence[LocalTensor]]
            ) -> list[dict[str, torch.Tensor]]:
    """Broadcast sources: assemble each full tensor from the trainer shards, then convert it."""
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for rank, tensors in enumerate(inputs.source_layouts):
        for t in tensors:
            for p in t.pieces:
                g = inputs.globals[p.global_name]
                if p.global_name not in full:
                    full[p.global_name] = torch.zeros(g.shape, dtype=shards[rank][t.name].dtype)
                    seen[p.global_name] = torch.zeros(g.shape, dtype=torch.bool)
                region = shards[rank][t.name][box_slices(p.local_box)].reshape(box_shape(p.global_box))
                full[p.global_name][box_slices(p.global_box)] = region
                seen[p.global_name][box_slices(p.global_box)] = True
    out = []
    for tensors in gathered:
        vals = {}
        for t in tensors:
            g = inputs.globals[t.name]
            src = t.name if g.quant_of is None else g.quant_of
            if not bool(seen[src].all()):
                raise AssertionError(f"gather: the trainer shards do not cover {src}")
            if g.quant_of is not None:
                assert g.block is not None
                vals[t.name] = block_scale_inv(full[src], g.block)
            elif t.dtype == "float8_e4m3fn":
                assert g.block is not None
                vals[t.name] = quantize_block_fp8(full[src], g.block)[0]
            else:
                vals[t.name] = full[src].to(torch_dtype(t.dtype))
        out.append(vals)
    return out


def apply_op(op: CopyOp, src: torch.Tensor, dst: torch.Tensor, block: tuple[int, int] | None) -> None:
    """Execute one op: read ``src_box`` of ``src``, transform, write ``dst_box`` of ``dst``."""
    region = src[box_slices(op.src_box)]
    if op.transform == "fp8_scale":
        assert block is not None
        wshape = box_shape(op.src_box)[-2:]
        value = block_scale_inv(region.reshape(wshape), block)
    elif op.transform == "fp8_quant":
        assert block is not None
        value = quantize_block_fp8(region.reshape(box_shape(op.global_box)), block)[0]
    elif op.transform == "cast":
        value = region.to(dst.dtype)
    else:
        value = region
    dst[box_slices(op.dst_box)] = value.reshape(box_shape(op.dst_box))


def simulate(inputs: PlanInputs, plan: Plan, *, seed: int = 0) -> SimulationReport:
    """Execute ``plan`` on random data and compare every destination tensor bit for bit.

    Args:
        inputs: the planner inputs the plan was built from.
        plan: a whole plan (p2p or broadcast).
        seed: seed of the random global tensors.

    Returns:
        The report (``mismatches`` empty when every rollout rank got exactly its expected bytes).
    """
    if plan.is_partial:
        raise ValueError("simulate a whole plan, not one rank's share")
    globals_ = random_globals(inputs, seed)
    shards = [_fill(ts, globals_) for ts in inputs.source_layouts]
    expected_vals = engine_values(inputs, globals_)
    if plan.mode is Mode.BROADCAST:
        shards = _gather(inputs, shards, plan_source_layouts(plan, inputs))
    dest = [_zeros(inputs.dest_layout(d)) for d in range(inputs.num_dest)]
    for op in plan.ops:
        g = inputs.globals[op.global_name]
        apply_op(op, shards[op.src_rank][op.src_param], dest[op.dst_rank][op.dst_param], g.block)
    report = SimulationReport(num_ops=plan.num_ops, tensors_compared=0)
    for d in range(inputs.num_dest):
        layout = inputs.dest_layout(d)
        want = _fill(layout, expected_vals)
        for t in layout:
            report.tensors_compared += 1
            got, exp = dest[d][t.name], want[t.name]
            if not torch.equal(got.reshape(-1).view(torch.uint8), exp.reshape(-1).view(torch.uint8)):
                diff = int((got.reshape(-1).view(torch.uint8) != exp.reshape(-1).view(torch.uint8)).sum())
                report.mismatches.append(f"rollout rank {d} {t.name}: {diff} bytes differ")
    return report


def _zeros(tensors: Sequence[LocalTensor]) -> dict[str, torch.Tensor]:
    return {t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype)) for t in tensors}
