"""The verifier accepts correct plans and names the cause of every planted fault.

Contract: :func:`weightsync.plan.api.verify_plan` raises ``PlanVerificationError`` whose
``problems`` carry the check that failed (``coverage``, ``overlap``, ``padding``, ``derived``,
``mapping``, ``source``, ``dtype``, ...) and a message naming the tensor concerned.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.plan_fakes import fake_inputs
from tests.plan_helpers import ops_to_table
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.api import build_plan, verify_plan
from weightsync.plan.inputs import build_inputs
from weightsync.plan.records import Plan
from weightsync.plan.verify import PlanVerificationError


def _with_ops(plan: Plan, ops) -> Plan:
    return dataclasses.replace(plan, table=ops_to_table(ops), _ops=[])


def _problems(plan: Plan, inputs) -> list[tuple[str, str]]:
    with pytest.raises(PlanVerificationError) as info:
        verify_plan(plan, inputs)
    return info.value.problems


@pytest.fixture(scope="module")
def fake():
    inputs = fake_inputs()
    return inputs, build_plan(inputs, "p2p")


@pytest.fixture(scope="module")
def kimi():
    """Kimi-K2 tiny (fp8 blocks, MLA derived w_kc/w_vc) on 2+8 ranks."""
    spec = get_model("Kimi-K2", "tiny")
    inputs = build_inputs(spec, TrainParallel(world_size=2, tp=1, ep=2), RolloutParallel(tp=4, dp=2, ep=4,
                          num_engines=2), trainer_layout=trainer_layout, engine_layout=engine_layout)
    return inputs, build_plan(inputs, "p2p")


@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
def test_correct_plans_verify(mode, kimi):
    inputs, _ = kimi
    report = verify_plan(build_plan(inputs, mode), inputs)
    assert report.num_ops > 0
    assert report.dest_elements > 0


def test_dropped_op_is_reported_as_not_written(fake):
    inputs, plan = fake
    ops = plan.ops
    victim = next(op for op in ops if op.dst_param == "w_pad")
    probs = _problems(_with_ops(plan, [op for op in ops if op is not victim]), inputs)
    assert [c for c, _ in probs] == ["coverage"]
    assert "not written" in probs[0][1]
    assert "w_pad" in probs[0][1]
    assert f"rollout rank {victim.dst_rank}" in probs[0][1]


def test_duplicated_op_is_reported_as_overlap(kimi):
    inputs, plan = kimi
    ops = plan.ops
    victim = next(op for op in ops if op.transform == "fp8_quant")
    probs = _problems(_with_ops(plan, [*ops, victim]), inputs)
    assert {c for c, _ in probs} == {"overlap"}
    assert "written more than once" in probs[0][1]
    assert victim.dst_param in probs[0][1]


def test_overlapping_op_is_reported(fake):
    inputs, plan = fake
    ops = plan.ops
    w = next(op for op in ops if op.dst_param == "w_pad" and op.dst_rank == 0)
    half = dataclasses.replace(w, global_box=((1, 3), (0, 16)), src_box=((1, 3), (0, 16)), dst_box=((1, 3), (0, 16)))
    probs = _problems(_with_ops(plan, [*ops, half]), inputs)
    assert {c for c, _ in probs} == {"overlap"}
    assert "w_pad on rollout rank 0 written more than once" in probs[0][1]


def test_write_into_padding_is_reported(fake):
    inputs, plan = fake
    ops = plan.ops
    w = next(op for op in ops if op.dst_param == "w_pad" and op.dst_rank == 0)
    pad = dataclasses.replace(w, global_box=((0, 1), (0, 16)), src_box=((0, 1), (0, 16)), dst_box=((4, 5), (0, 16)))
    probs = _problems(_with_ops(plan, [*ops, pad]), inputs)
    assert [c for c, _ in probs] == ["padding"]
    assert "w_pad" in probs[0][1]
    assert "padding" in probs[0][1]


def test_write_into_derived_tensor_is_reported(kimi):
    inputs, plan = kimi
    ops = plan.ops
    derived = next(t for t in inputs.engine_layouts[0] if t.derived)
    kv_b = next(op for op in ops if "kv_b_proj" in op.global_name and op.dst_rank == 0)
    bad = dataclasses.replace(kv_b, dst_param=derived.name)
    probs = _problems(_with_ops(plan, [*ops, bad]), inputs)
    assert [c for c, _ in probs] == ["derived"]
    assert derived.name in probs[0][1]
    assert "derived" in probs[0][1]


def test_wrong_destination_coordinates_are_reported(fake):
    inputs, plan = fake
    ops = list(plan.ops)
    i = next(k for k, op in enumerate(ops) if op.global_name == "q" and op.dst_rank == 1)
    op = ops[i]
    ops[i] = dataclasses.replace(op, dst_box=((0, 8), (8, 16)) if op.dst_box[1][0] == 0 else ((0, 8), (0, 8)))
    probs = _problems(_with_ops(plan, ops), inputs)
    assert "mapping" in {c for c, _ in probs}
    assert any("q_fp8" in m for c, m in probs if c == "mapping")


def test_source_that_does_not_hold_the_region_is_reported(fake):
    inputs, plan = fake
    ops = list(plan.ops)
    i = next(k for k, op in enumerate(ops) if op.global_name == "w" and op.dst_rank == 0)
    ops[i] = dataclasses.replace(ops[i], src_rank=1)  # rank 1 holds rows 4..8, not 0..4
    probs = _problems(_with_ops(plan, ops), inputs)
    assert [c for c, _ in probs] == ["source"]
    assert "trainer rank 1" in probs[0][1]
    assert "w_shard" in probs[0][1]


def test_missing_fp8_transform_is_a_dtype_error(kimi):
    inputs, plan = kimi
    ops = list(plan.ops)
    i = next(k for k, op in enumerate(ops) if op.transform == "fp8_quant")
    ops[i] = dataclasses.replace(ops[i], transform=None)
    probs = _problems(_with_ops(plan, ops), inputs)
    assert [c for c, _ in probs] == ["dtype"]
    assert ops[i].global_name in probs[0][1]


def test_unknown_parameter_and_rank_are_reported(fake):
    inputs, plan = fake
    ops = plan.ops
    bad_param = dataclasses.replace(ops[0], dst_param="nope")
    bad_rank = dataclasses.replace(ops[0], dst_rank=99)
    probs = _problems(_with_ops(plan, [*ops[1:], bad_param, bad_rank]), inputs)
    checks = {c for c, _ in probs}
    assert {"param", "rank", "coverage"} <= checks
    assert any("nope" in m for c, m in probs if c == "param")


def test_per_rank_plans_verify_their_own_share(kimi):
    from weightsync.plan.api import plan_for_rank

    inputs, _ = kimi
    verify_plan(plan_for_rank(inputs, dst_rank=5), inputs)
    verify_plan(plan_for_rank(inputs, src_rank=1), inputs)
