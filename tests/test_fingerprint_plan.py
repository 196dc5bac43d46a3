"""Contract: the trainer ranks' partial fingerprints of their plan shares, summed, equal every engine
rank's fingerprint of what a correct update leaves in it -- in p2p (hashed as sent: direct runs from
the parameters, transformed ones from the packed staging) and in broadcast (the hash-only pass over
engine 0's share) -- and a wrong byte in an engine's copy is named.

Trainer TP 2 -> two engines of TP 2, on CPU, for a dense bf16 model, a MoE and a block-fp8 MLA
model (casts, fp8 quantization and scales packed into staging). The trainer ranks run in this
process; their partials are summed here as the all-reduce sums them. The engine side is the
checker's ``fingerprint`` over a store filled as the update leaves it (the plan simulation's
expected values; padding zero), so both sides are computed independently.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.plan_simulate import _fill, engine_values, random_globals
from weightsync.engine.checker import WeightChecker
from weightsync.fingerprint import to_hex
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.dtypes import torch_dtype
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.inputs import PlanInputs, build_inputs
from weightsync.plan.p2p import plan_p2p_for_rank
from weightsync.sync.p2p_pack import DestParam, Packer, fp8_blocks
from weightsync.sync.params import ParamStore
from weightsync.sync.share_fingerprint import ShareFingerprint
from weightsync.sync.verify import Verifier

SEED = 0x1234_5678_9ABC
BUCKET = 1 << 14
"""Small buckets: the transformed ops span several staging buckets."""


def _inputs(model: str) -> PlanInputs:
    # Kimi-K2's MLA down projections (40 rows at tiny scale) split over TP 2 are not whole fp8
    # blocks: they stay whole on every rank, as in the plan simulation's fp8 grid
    train = TrainParallel(tp=2, world_size=2, mla_down_proj_replicated=model == "Kimi-K2")
    return build_inputs(get_model(model, "tiny"), train, RolloutParallel(tp=2, num_engines=2),
                        trainer_layout=trainer_layout, engine_layout=engine_layout)


def _p2p_partials(inputs: PlanInputs, shards: list[dict[str, torch.Tensor]], slots: dict) -> np.ndarray:
    """Every trainer rank's share hashed as the sender hashes it (staging in two halves), summed."""
    total = np.zeros(len(slots), dtype=np.uint64)
    dests = {r: {t.name: DestParam(addr=0, shape=t.shape, dtype=torch_dtype(t.dtype))
                 for t in inputs.dest_layout(r) if not t.derived} for r in range(inputs.num_dest)}
    for rank, params in enumerate(shards):
        ops = plan_p2p_for_rank(inputs, src_rank=rank).ops
        packer = Packer([op for op in ops if op.transform], params, dests, bucket_bytes=BUCKET,
                        fp8_blocks=fp8_blocks(inputs))
        halves = [torch.full((packer.capacity,), 0xA5, dtype=torch.uint8) for _ in range(2)]  # poisoned

        def half(i: int, halves: list[torch.Tensor] = halves) -> torch.Tensor:
            return halves[i % 2]

        packer.compile(half)
        share = ShareFingerprint(ops, params, dests, packer, slots, half)
        out = torch.zeros(len(slots), dtype=torch.int64)
        share.hash_direct(out, SEED)
        for i in range(packer.num_buckets):
            packer.pack(i)
            share.hash_bucket(i, out, SEED)
        total += out.numpy().view(np.uint64)
    return total


def _engine_fingerprints(inputs: PlanInputs, values: dict[str, torch.Tensor], rank: int,
                         corrupt: str | None = None) -> dict[str, str]:
    layout = list(inputs.dest_layout(rank))
    store = ParamStore(layout, torch.device("cpu"))
    for name, t in _fill(layout, values).items():
        store[name].copy_(t)
    if corrupt is not None:
        store[corrupt].view(-1).view(torch.uint8)[7] ^= 0x10
    return WeightChecker(store).fingerprint(SEED)["fingerprints"]


@pytest.mark.parametrize("model", ["Qwen3-4B", "Qwen3-30B-A3B", "Kimi-K2"])
@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
def test_summed_partials_equal_every_engine_rank(model: str, mode: str) -> None:
    inputs = _inputs(model)
    globals_ = random_globals(inputs, seed=3)
    shards = [_fill(ts, globals_) for ts in inputs.source_layouts]
    values = engine_values(inputs, globals_)
    if mode == "p2p":
        verifier = Verifier(inputs, [], {}, rank=0, pg=None, bucket_bytes=BUCKET)
        total = _p2p_partials(inputs, shards, verifier.slots)
    else:
        total = np.zeros(len(Verifier(inputs, [], {}, rank=0, pg=None, bucket_bytes=BUCKET).slots), dtype=np.uint64)
        for rank, params in enumerate(shards):
            verifier = Verifier(inputs, plan_p2p_for_rank(inputs, src_rank=rank).ops, params, rank=rank, pg=None,
                                bucket_bytes=BUCKET)
            out = verifier.new_partials()
            verifier.hash_share(out, SEED)
            total += out.numpy().view(np.uint64)
    expected = verifier.combine(total, SEED, same_for_every_engine=mode == "broadcast")
    staged = [op for r in range(2) for op in plan_p2p_for_rank(inputs, src_rank=r).ops if op.transform]
    assert bool(staged) == (model == "Kimi-K2"), "the fp8 model packs, the bf16 ones write straight"
    for rank in range(inputs.num_dest):
        got = _engine_fingerprints(inputs, values, rank)
        want = {n: to_hex(v) for n, v in expected[rank].items()}
        assert got == want, f"rollout rank {rank}: {sorted(n for n in want if got.get(n) != want[n])}"
    # one flipped bit in one engine rank's copy: that tensor, and only it, differs
    name = next(t.name for t in inputs.dest_layout(3) if not t.derived and "layers.1." in t.name)
    got = _engine_fingerprints(inputs, values, 3, corrupt=name)
    assert sorted(n for n, v in got.items() if v != to_hex(expected[3][n])) == [name]


def test_padding_counts_as_zeros_and_is_restored_by_zero_padding() -> None:
    """The vocab padding rows of the last rank of each engine (no piece covers them) are expected
    as zeros: a store whose padding holds anything else differs in exactly the padded tensors,
    and :meth:`ParamStore.zero_padding` (the engine's end of a session) makes it verify again."""
    inputs = _inputs("Qwen3-30B-A3B")
    globals_ = random_globals(inputs, seed=4)
    verifier = Verifier(inputs, [], {}, rank=0, pg=None, bucket_bytes=BUCKET)
    total = _p2p_partials(inputs, [_fill(ts, globals_) for ts in inputs.source_layouts], verifier.slots)
    expected = verifier.combine(total, SEED, same_for_every_engine=False)
    layout = list(inputs.dest_layout(3))
    store = ParamStore(layout, torch.device("cpu"))
    for name, t in _fill(layout, engine_values(inputs, globals_)).items():
        store[name].copy_(t)
    assert set(store.padding) == {"model.embed_tokens.weight", "lm_head.weight"}
    for name, runs in store.padding.items():  # a writer of whole padded tensors
        first, count = runs[0]
        store[name].view(-1)[first : first + count] = 1.0
    want = {n: to_hex(v) for n, v in expected[3].items()}
    got = WeightChecker(store).fingerprint(SEED)["fingerprints"]
    assert {n for n in want if got[n] != want[n]} == set(store.padding)
    assert store.zero_padding() == sum(n for runs in store.padding.values() for _, n in runs)
    assert WeightChecker(store).fingerprint(SEED)["fingerprints"] == want
