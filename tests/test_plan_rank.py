"""Per-rank plans, determinism, source choice and placement.

Contract: ``plan_for_rank(inputs, mode, src_rank=s)`` (or ``dst_rank=d``) returns exactly the
ops of the whole plan with that sender (receiver), in the same order, computed without the whole
plan; the choice among replicas is deterministic, prefers the cheapest link, spreads the bytes
over the replicas, and lets every trainer rank send.
"""

from __future__ import annotations

import pytest

from tests.plan_fakes import FAKE_ROLLOUT, FAKE_TRAIN, fake_inputs
from tests.plan_helpers import filter_ops
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.parallel import Device
from weightsync.models.parallel import RolloutParallel as R
from weightsync.models.parallel import TrainParallel as T
from weightsync.plan.api import build_plan, plan_for_rank
from weightsync.plan.inputs import build_inputs

CONFIGS = {
    "qwen3-moe-ep-etp-cp": ("Qwen3-30B-A3B", T(world_size=8, tp=2, ep=2, etp=2, cp=2), R(tp=4, ep=2, num_engines=2)),
    "glm5-dp-attention-pp": ("GLM-5", T(world_size=8, tp=2, pp=2, ep=2, etp=1), R(tp=4, dp=2, ep=4, num_engines=2)),
    "kimi-fp8": ("Kimi-K2", T(world_size=4, tp=1, ep=4), R(tp=4, dp=2, ep=4, num_engines=2)),
}


def _inputs(key: str):
    model, train, rollout = CONFIGS[key]
    return build_inputs(get_model(model, "tiny"), train, rollout, trainer_layout=trainer_layout,
                        engine_layout=engine_layout)


@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
@pytest.mark.parametrize("key", [*CONFIGS, "fake"])
def test_per_rank_plan_equals_filter_of_whole_plan(key, mode):
    inputs = fake_inputs() if key == "fake" else _inputs(key)
    whole = build_plan(inputs, mode)
    ops = whole.ops
    for s in range(inputs.train.world_size):
        mine = plan_for_rank(inputs, mode, src_rank=s)
        assert mine.ops == filter_ops(ops, src_rank=s), f"sender {s}"
        assert mine.sender_bytes[s] == whole.sender_bytes[s]
    for d in range(inputs.num_dest):
        mine = plan_for_rank(inputs, mode, dst_rank=d)
        assert mine.ops == filter_ops(ops, dst_rank=d), f"receiver {d}"
        assert mine.receiver_bytes[d] == whole.receiver_bytes[d]


def test_plan_for_rank_needs_exactly_one_rank():
    with pytest.raises(ValueError, match="exactly one"):
        plan_for_rank(fake_inputs(), "p2p")
    with pytest.raises(ValueError, match="outside"):
        plan_for_rank(fake_inputs(), "p2p", dst_rank=99)


def test_plans_are_deterministic():
    a, b = build_plan(_inputs("kimi-fp8"), "p2p"), build_plan(_inputs("kimi-fp8"), "p2p")
    assert a.ops == b.ops


@pytest.mark.parametrize("key", list(CONFIGS))
def test_every_trainer_rank_sends_and_replicas_share_the_load(key):
    inputs = _inputs(key)
    plan = build_plan(inputs, "p2p")
    assert all(b > 0 for b in plan.sender_bytes)
    assert plan.bytes_total == sum(plan.sender_bytes)


def test_replicas_split_a_tensor_evenly():
    """Qwen3-4B tiny on TP 1 x DP 4: every tensor has 4 holders; bytes per sender stay within 1.6x
    of the mean (whole tensors are assigned, so a perfect split is not possible)."""
    inputs = build_inputs(get_model("Qwen3-4B", "tiny"), T(world_size=4), R(tp=2, num_engines=2),
                          trainer_layout=trainer_layout, engine_layout=engine_layout)
    sent = build_plan(inputs, "p2p").sender_bytes
    mean = sum(sent) / len(sent)
    assert max(sent) <= 1.6 * mean
    assert min(sent) >= 0.4 * mean


def test_same_node_and_same_gpu_holders_are_preferred():
    # trainer rank 3 shares node 0 with the rollout ranks, rank 1 shares rollout rank 1's GPU
    train = [Device(1, 0), Device(0, 1), Device(1, 2), Device(0, 3)]
    rollout = [Device(0, 4), Device(0, 1), Device(0, 6), Device(0, 7)]
    inputs = fake_inputs(placement=(train, rollout))
    assert FAKE_TRAIN.world_size == len(train)
    assert FAKE_ROLLOUT.world_size == len(rollout)
    norm = [op for op in build_plan(inputs, "p2p").ops if op.global_name == "norm"]  # held by all 4 ranks
    assert {op.src_rank for op in norm if op.dst_rank == 1} == {1}
    assert {op.src_rank for op in norm if op.dst_rank != 1} == {1, 3}
