"""The colocated baseline's conversion and loading (in one process) leave the engine bit-exact.

Contract: the trainer's whole-tensor conversion of its shards into flat buckets (fp8 weights
quantized with their scales, tensors assembled from several pieces) followed by the engine's
loading rule on each bucket gives every engine parameter exactly the bytes of
:func:`~weightsync.launch.bench.data.expected_store`; every wire tensor fits its bucket; the
post-load derivation equals the per-layer reference. The CUDA IPC hand-over itself is exercised
by the GPU benchmark (``scripts/bench_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

from weightsync.engine.loader import run_post_load
from weightsync.launch.bench.colocated import TensorBuckets, TrainerBuckets, load_bucket
from weightsync.launch.bench.config import tensor_skip_reason
from weightsync.launch.bench.data import (
    GlobalData,
    compare,
    compare_derived,
    expected_store,
    fill_params,
    reference_derived,
)
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.inputs import build_inputs
from weightsync.sync.params import ParamStore


@pytest.mark.parametrize("model", ["Qwen3-30B-A3B", "Kimi-K2", "Qwen3-4B"])
def test_baseline_buckets_load_bit_exact(model: str) -> None:
    spec = get_model(model, "tiny")
    inputs = build_inputs(spec, TrainParallel(tp=1, world_size=1), RolloutParallel(tp=1),
                          trainer_layout=trainer_layout, engine_layout=engine_layout)
    device = torch.device("cpu")
    data = GlobalData(inputs.globals, seed=3, device=device)
    src_layout = list(inputs.source_layouts[0])
    trainer = ParamStore(src_layout, device)
    fill_params(data, src_layout, dict(trainer.items()))
    engine = ParamStore(list(inputs.dest_layout(0)), device)
    expected = expected_store(data, engine, spec)
    plan = TensorBuckets.build(inputs, bucket_bytes=64 << 10)
    assert len(plan.buckets) > 1
    for b in plan.buckets:
        assert all(w.offset % 256 == 0 for w in b)
        assert b[-1].offset + b[-1].nbytes <= plan.capacity
    conv = TrainerBuckets(plan, inputs, dict(trainer.items()), device)
    for i, bucket in enumerate(plan.buckets):
        load_bucket(engine, spec, bucket, conv.fill(i))
    assert compare(engine, expected) == []
    if engine.derived_names():
        run_post_load(engine, spec)
        reference_derived(expected, spec)
        assert compare_derived(engine, expected) == []


def test_skip_reason_names_the_fix() -> None:
    assert "--device cuda" in tensor_skip_reason("cpu", 1, 1)
    assert "--train tp=1 --rollout tp=1" in tensor_skip_reason("cuda", 2, 2)
    assert tensor_skip_reason("cuda", 1, 1) is None
