"""Entry points of the planner: build a plan (or one rank's share), verify it, summarize it.

Typical usage::

    from weightsync.plan import build_inputs, build_plan, verify_plan, summarize
    inputs = build_inputs(spec, train, rollout, trainer_layout=..., engine_layout=...)
    plan = build_plan(inputs, Mode.P2P)
    report = verify_plan(plan, inputs)          # raises PlanVerificationError
    print(summarize(plan, inputs))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from weightsync.layout.box import LocalTensor, box_volume
from weightsync.models.hf import DTYPE_BYTES
from weightsync.plan.broadcast import DEFAULT_BUCKET_BYTES, gathered_layouts, plan_broadcast
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.p2p import plan_p2p, plan_p2p_for_rank
from weightsync.plan.records import Mode, Plan
from weightsync.plan.table import OpTable
from weightsync.plan.util import paused_gc
from weightsync.plan.verify import VerifyReport, verify_ops


def build_plan(inputs: PlanInputs, mode: Mode | str = Mode.P2P, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Plan:
    """The whole plan of ``mode`` (a :class:`~weightsync.plan.records.Mode` or its string).

    Args:
        inputs: planner inputs (:func:`weightsync.plan.inputs.build_inputs`).
        mode: transfer mode.
        bucket_bytes: broadcast bucket size.

    Returns:
        The plan.

    Raises:
        ValueError: unknown mode, or layouts that cannot be planned (message names the tensor).
    """
    mode = Mode.transfer(mode)
    with paused_gc():
        if mode is Mode.P2P:
            return plan_p2p(inputs)
        return plan_broadcast(inputs, bucket_bytes=bucket_bytes)


def plan_for_rank(inputs: PlanInputs, mode: Mode | str = Mode.P2P, *, src_rank: int | None = None,
                  dst_rank: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Plan:
    """One rank's share of :func:`build_plan`: the ops trainer ``src_rank`` sends or rollout
    ``dst_rank`` receives, equal to filtering the whole plan (same order), computed locally.

    Args:
        inputs: planner inputs.
        mode: transfer mode.
        src_rank: a trainer rank, or
        dst_rank: a rollout rank (exactly one).
        bucket_bytes: broadcast bucket size.

    Returns:
        A partial plan.
    """
    mode = Mode.transfer(mode)
    if (src_rank is None) == (dst_rank is None):
        raise ValueError("give exactly one of src_rank and dst_rank")
    with paused_gc():
        if mode is Mode.P2P:
            return plan_p2p_for_rank(inputs, src_rank=src_rank, dst_rank=dst_rank)
        return plan_broadcast(inputs, bucket_bytes=bucket_bytes, dst_rank=dst_rank, src_rank=src_rank)


def plan_source_layouts(plan: Plan, inputs: PlanInputs) -> tuple[tuple[LocalTensor, ...], ...]:
    """The source tensors the plan's ops read: trainer layouts (p2p) or gathered tensors (broadcast)."""
    return inputs.source_layouts if plan.mode is Mode.P2P else gathered_layouts(inputs)


def verify_plan(plan: Plan, inputs: PlanInputs, table: OpTable | None = None) -> VerifyReport:
    """Verify ``plan`` against the layouts (:mod:`weightsync.plan.verify`).

    A whole plan must cover every destination byte; a per-rank plan of ``dst_rank`` must cover
    that rank's; a per-rank plan of ``src_rank`` is checked op by op only.

    Raises:
        PlanVerificationError: naming each failed check and tensor.
    """
    if table is None:
        table = plan.table
    if plan.dst_rank is not None:
        coverage: Sequence[int] | None = [plan.dst_rank]
    elif plan.src_rank is not None:
        coverage = []
    else:
        coverage = None
    with paused_gc():
        return verify_ops(table, sources=plan_source_layouts(plan, inputs), engine_layouts=inputs.engine_layouts,
                          num_engines=inputs.rollout.num_engines, globals_=inputs.globals, coverage_ranks=coverage)


def shard_dest_bytes(tensors: Iterable[LocalTensor]) -> int:
    """Bytes of one rank's shard that come from global tensors (derived and padding excluded)."""
    return sum(
        sum(box_volume(p.global_box) for p in t.pieces) * DTYPE_BYTES[t.dtype] for t in tensors if not t.derived
    )


def dest_bytes(inputs: PlanInputs) -> int:
    """Bytes of all destination shards that come from global tensors (derived and padding excluded)."""
    return sum(shard_dest_bytes(tensors) for tensors in inputs.engine_layouts) * inputs.rollout.num_engines


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSummary:
    """The figures ``weightsync plan`` prints."""

    ops: int
    zero_copy_ops: int
    bytes_total: int
    """Bytes put on links to rollout ranks."""
    dest_bytes: int
    max_sender_bytes: int
    max_receiver_bytes: int
    senders: int
    """Trainer ranks that send anything."""
    gather_bytes: int


def summarize(plan: Plan, inputs: PlanInputs) -> PlanSummary:
    """Count ops and bytes of ``plan``."""
    return PlanSummary(
        ops=plan.num_ops,
        zero_copy_ops=int(plan.table.zero_copy.sum()),
        bytes_total=plan.bytes_total,
        dest_bytes=dest_bytes(inputs),
        max_sender_bytes=max(plan.sender_bytes, default=0),
        max_receiver_bytes=max(plan.receiver_bytes, default=0),
        senders=sum(1 for b in plan.sender_bytes if b),
        gather_bytes=plan.gather_bytes,
    )
