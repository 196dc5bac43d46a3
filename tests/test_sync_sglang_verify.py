"""Contract: the expected sglang checksums that trainer ranks compute from their plan shares alone
(:class:`~weightsync.sync.sglang_verify.ShareChecksum`, no gather) equal sglang's checksums of the
engine parameters holding the trainer's weights (laid out by the engine's loader, hashed whole as
on a GPU) -- with words split between two writers (a row-parallel weight whose per-rank columns
are an odd number of bf16 elements), vocab padding rows (zero), fp8 block weights (hashed
dequantized, scales not listed) and expert weights; and a parameter one byte off is named.

Two trainer ranks (gloo, spawned), one engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from weightsync.layout.box import box_slices
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.inputs import build_inputs
from weightsync.plan.p2p import plan_p2p_for_rank
from weightsync.sync.params import ParamStore, write_global
from weightsync.sync.sglang_checksum import checksums
from weightsync.sync.sglang_verify import ShareChecksum

CASES: list[tuple[str, dict[str, int], TrainParallel, RolloutParallel]] = [
    # down_proj's columns: 37 per trainer rank -> rows of 74 bytes, words split between the ranks
    ("Qwen3-4B", {"intermediate_size": 74}, TrainParallel(tp=2, world_size=2), RolloutParallel(tp=1)),
    ("Qwen3-4B", {}, TrainParallel(tp=2, world_size=2), RolloutParallel(tp=2)),
    ("Kimi-K2", {}, TrainParallel(tp=2, world_size=2, mla_down_proj_replicated=True), RolloutParallel(tp=1)),
    ("Qwen3-30B-A3B", {}, TrainParallel(tp=1, ep=2, world_size=2), RolloutParallel(tp=2, ep=2)),
]


def _spec(name: str, changes: dict[str, int]) -> Any:
    return dataclasses.replace(get_model(name, "tiny"), **changes)


def _globals(spec: Any) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {n: torch.randn(g.shape, generator=gen).to(getattr(torch, g.dtype))
            for n, g in global_tensors(spec).items() if g.quant_of is None}


def _rank_params(spec: Any, train: TrainParallel, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for t in trainer_layout(spec, train, rank):
        x = torch.zeros(t.shape, dtype=getattr(torch, t.dtype))
        for p in t.pieces:
            x[box_slices(p.local_box)] = full[p.global_name][box_slices(p.global_box)].reshape(
                x[box_slices(p.local_box)].shape)
        out[t.name] = x
    return out


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    pg = dist.new_group(backend="gloo")
    results = {}
    for k, (name, changes, train, rollout) in enumerate(CASES):
        spec = _spec(name, changes)
        inputs = build_inputs(spec, train, rollout, trainer_layout=trainer_layout, engine_layout=engine_layout)
        params = _rank_params(spec, train, rank, _globals(spec))
        ops = plan_p2p_for_rank(inputs, src_rank=rank).ops
        results[k] = ShareChecksum(inputs, ops, params, rank=rank, pg=pg).expected()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def from_shares(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[int, dict[str, str]]]:
    from weightsync.proc import free_port

    out = tmp_path_factory.mktemp("share") / "expected.pt"
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    return torch.load(Path(out), weights_only=False)


def _engine_checksums(spec: Any, rollout: RolloutParallel, r: int, full: dict[str, torch.Tensor]) -> dict[str, str]:
    store = ParamStore([t for t in engine_layout(spec, rollout, r) if not t.derived], torch.device("cpu"))
    for name, t in full.items():
        write_global(store, spec, name, lambda box, t=t: t[box_slices(box)])
    return checksums(list(store.items()), gpu=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{k}" for k, c in enumerate(CASES)])
def test_shares_add_up_to_sglangs_checksums(from_shares: dict[int, dict[int, dict[str, str]]], case: int) -> None:
    name, changes, _, rollout = CASES[case]
    spec = _spec(name, changes)
    full = _globals(spec)
    for r in range(rollout.tp):
        want = _engine_checksums(spec, rollout, r, full)
        assert from_shares[case][r] == want, f"rank {r}"
    if name == "Kimi-K2":
        assert not [n for n in from_shares[case][0] if n.endswith("_scale_inv")], "scales are not listed"
        assert any("kv_b_proj" in n for n in from_shares[case][0])


def test_a_byte_off_is_another_checksum(from_shares: dict[int, dict[int, dict[str, str]]]) -> None:
    name, changes, _, rollout = CASES[0]
    spec = _spec(name, changes)
    full = _globals(spec)
    down = "model.layers.1.mlp.down_proj.weight"
    full[down].view(torch.uint8).reshape(-1)[75] ^= 1  # inside a word the two trainer ranks share
    got = _engine_checksums(spec, rollout, 0, full)
    assert [n for n, v in from_shares[0][0].items() if got[n] != v] == [down]
