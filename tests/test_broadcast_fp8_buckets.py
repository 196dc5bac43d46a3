"""A broadcast bucket sends exactly what its announcement lists, also where the plan's bucket cut
puts an fp8 weight in one bucket and its ``weight_scale_inv`` in the next: the sender sends each fp8
weight's scale right after the bucket's weights, as :func:`announcement` announces it (before, the
scale was dropped and the engine waited for a tensor that never came)."""

from __future__ import annotations

import torch

from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.broadcast import plan_broadcast, wire_dtypes
from weightsync.plan.inputs import build_inputs
from weightsync.sync.broadcast_sender import BroadcastSender, announcement


def _sender(inputs) -> BroadcastSender:
    """The sender's conversion alone (no group, no parameters): what :meth:`_to_wire` reads."""
    sender = BroadcastSender.__new__(BroadcastSender)
    sender.inputs, sender.wire = inputs, wire_dtypes(inputs)
    return sender


def test_every_bucket_sends_what_it_announces_when_a_scale_is_cut_off() -> None:
    spec = get_model("Kimi-K2", "tiny")
    inputs = build_inputs(spec, TrainParallel(world_size=1), RolloutParallel(), trainer_layout=trainer_layout,
                          engine_layout=engine_layout)
    wire = wire_dtypes(inputs)
    assert any(d == "float8_e4m3fn" for d in wire.values()), "the model has fp8 weights"
    sender = _sender(inputs)
    buckets = plan_broadcast(inputs, bucket_bytes=16 << 10).buckets
    split = 0
    for b in buckets:
        names = list(b.names)
        weights = [n for n in names if inputs.globals[n].quant_of is None]
        split += sum(1 for n in weights if wire.get(n) == "float8_e4m3fn" and n + "_scale_inv" not in names)
        full = {n: torch.randn(inputs.globals[n].shape) for n in weights}
        sent = [name for name, _ in sender._to_wire(names, full)]
        assert sent == announcement(inputs, names)[0], f"bucket of {names[:3]}...: sent != announced"
    assert split > 0, "the cut put some fp8 weight and its scale in different buckets (the case under test)"
