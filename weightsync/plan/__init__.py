"""The static shard-to-shard transfer plan: planner, verifier, cost model, serialization.

Typical usage::

    from weightsync.layout.megatron import trainer_layout
    from weightsync.layout.sglang import engine_layout
    from weightsync.plan import build_inputs, build_plan, plan_for_rank, verify_plan

    inputs = build_inputs(spec, train, rollout, trainer_layout=trainer_layout, engine_layout=engine_layout)
    plan = build_plan(inputs, "p2p")           # or "broadcast"
    verify_plan(plan, inputs)                  # raises PlanVerificationError
    mine = plan_for_rank(inputs, "p2p", src_rank=3).ops   # one sender's CopyOps, computed locally

Modules: :mod:`~weightsync.plan.ops` (CopyOp, byte runs, coalescing), :mod:`~weightsync.plan.cuts`
and :mod:`~weightsync.plan.cut_table` (cutting destination pieces along source pieces),
:mod:`~weightsync.plan.p2p` and :mod:`~weightsync.plan.broadcast` (the two modes),
:mod:`~weightsync.plan.verify`, :mod:`~weightsync.plan.cost`, :mod:`~weightsync.plan.serialize`;
the command is :mod:`~weightsync.cli.plan`.
"""

from weightsync.plan.api import (
    PlanSummary,
    build_plan,
    dest_bytes,
    plan_for_rank,
    plan_source_layouts,
    summarize,
    verify_plan,
)
from weightsync.plan.cost import CostEstimate, LinkBandwidth, estimate
from weightsync.plan.inputs import PlanInputs, build_inputs
from weightsync.plan.ops import TRANSFORMS, CopyOp, box_runs, coalesce_ops
from weightsync.plan.records import Bucket, Plan
from weightsync.plan.serialize import cached_plan, load_plan, save_plan
from weightsync.plan.verify import PlanVerificationError, VerifyReport

__all__ = [
    "TRANSFORMS",
    "Bucket",
    "CopyOp",
    "CostEstimate",
    "LinkBandwidth",
    "Plan",
    "PlanInputs",
    "PlanSummary",
    "PlanVerificationError",
    "VerifyReport",
    "box_runs",
    "build_inputs",
    "build_plan",
    "cached_plan",
    "coalesce_ops",
    "dest_bytes",
    "estimate",
    "load_plan",
    "plan_for_rank",
    "plan_source_layouts",
    "save_plan",
    "summarize",
    "verify_plan",
]
