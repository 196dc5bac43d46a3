"""Contract: the verification catches what a transport does wrong, names the tensor, and never lets
it be served; and an engine whose padding a foreign writer filled still verifies.

One trainer rank (a gloo group of one, in this process) and a ``weightsync serve`` engine
(Qwen3-4B tiny, TP 2, shm, dummy weights), updated through :class:`WeightUpdater` in p2p. Each
fault acts on the bytes the transport moves to one engine rank, inside one parameter, after the
trainer hashed what it meant to write: a byte of the engine's written copy flipped once every
write has landed; one run written one element further on; the runs of one parameter dropped.
Each update fails naming that parameter of that rank; the engine goes on serving its old version
(the update was pause-free: the fault was in the shadow); the next update, without the fault,
verifies and publishes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from tests import test_faults_update as faults
from tests import test_sync_updater_engine as base
from weightsync import UpdateError, UpdaterConfig, WeightUpdater
from weightsync.layout.sglang import engine_layout
from weightsync.models.parallel import RolloutParallel
from weightsync.sync.engine_client import EngineClient
from weightsync.sync.params import padding_runs
from weightsync.sync.tensor_sender import serialize_named_tensors
from weightsync.transport.handles import MappedPeer, WriteBatch
from weightsync.transport.runs import strided_blocks

group = base.group  # the fixture: a gloo group of this one trainer rank
RANK = 1
TARGET = "model.layers.1.mlp.down_proj.weight"
"""Written straight from the trainer's parameter (bf16, no transform), one run per row."""

engine = faults.engine  # the fixture: a weightsync serve engine of this module
_state = faults._state


def _local_span(peer: MappedPeer, addr: int, nbytes: int) -> tuple[int, int]:
    """Where this process sees ``[addr, addr + nbytes)`` of the peer (its mapping of the segment)."""
    i = int(peer.table.locate(np.array([addr]), np.array([nbytes]), what="test")[0])
    lo = int(peer.local_bases[i]) + addr - peer.table.regions[i].addr
    return lo, lo + nbytes


def _on_target(updater: WeightUpdater, edit: Callable[[np.ndarray, int, int, int], np.ndarray],
               after: Callable[[int, int], None] | None = None) -> Callable[[], None]:
    """During the next write: the runs of every batch to rollout rank ``RANK`` that land in
    ``TARGET`` go through ``edit(runs, lo, hi, itemsize)``; ``after(lo, hi)`` runs once every write
    has landed. Returns the undo."""
    sender = updater.p2p_sender
    assert sender is not None
    transport, dest = sender.transport, sender.dests[RANK]
    dp = dest.params[TARGET]
    nbytes = int(np.prod(dp.shape)) * dp.itemsize
    seen: dict[str, tuple[int, int]] = {}
    real_write, real_updater_write = transport.write, updater.write

    def write(peer: Any, batch: Any) -> Any:
        if isinstance(batch, WriteBatch) and peer.descriptor.session_id == dest.descriptor.session_id:
            lo, hi = seen.setdefault("span", _local_span(peer, dp.addr, nbytes))
            runs = edit(batch.runs.copy(), lo, hi, dp.itemsize)
            batch = replace(batch, runs=runs, blocks=strided_blocks(runs), nbytes=int(runs[:, 2].sum()))
        return real_write(peer, batch)

    def updater_write(*args: Any, **kwargs: Any) -> Any:
        out = real_updater_write(*args, **kwargs)
        if after is not None:
            after(*seen["span"])
        return out

    transport.write = write
    updater.write = updater_write

    def undo() -> None:
        vars(transport).pop("write", None)
        vars(updater).pop("write", None)

    return undo


def _inside(runs: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return (runs[:, 1] >= lo) & (runs[:, 1] < hi)


def _shift_one(runs: np.ndarray, lo: int, hi: int, itemsize: int) -> np.ndarray:
    """The first run into the target lands one element further on."""
    i = int(np.flatnonzero(_inside(runs, lo, hi))[0])
    runs[i, 1] += itemsize
    return runs


def _drop(runs: np.ndarray, lo: int, hi: int, itemsize: int) -> np.ndarray:
    """Every run into the target is left out (as if its ops were missing)."""
    return runs[~_inside(runs, lo, hi)]


def _flip(lo: int, hi: int) -> None:
    """One byte of the target in the engine's written copy, flipped after the write."""
    ctypes.c_uint8.from_address(lo + 3).value ^= 0x04


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["corrupted byte", "wrong offset", "missing op"])
def test_a_wrong_write_fails_the_update_naming_the_tensor(engine: str, group: object, fault: str) -> None:
    params = base.te_named_params(21)
    cfg = UpdaterConfig(mode="p2p", bucket_bytes=1 << 18, verify_every=1)
    with WeightUpdater(params, spec=base.SPEC, train=base.TRAIN, engine_urls=[engine], group=group,
                       config=cfg) as updater:
        assert updater.update(1).verified
        base._step(params, 2)
        edits = {"corrupted byte": (lambda runs, lo, hi, size: runs, _flip), "wrong offset": (_shift_one, None),
                 "missing op": (_drop, None)}
        undo = _on_target(updater, *edits[fault])
        try:
            with pytest.raises(UpdateError, match=rf"fingerprints differ: engine 0 at {engine}, rank {RANK}: "
                                                  rf"\d+ of \d+ tensors differ: .*{TARGET}") as err:
                updater.update(2)
        finally:
            undo()
        if fault != "wrong offset":  # a shifted run also writes into the parameter after it
            assert f"rank {RANK}: 1 of " in str(err.value), err.value
            assert f"tensors differ: {TARGET}" in str(err.value), err.value
        s = _state(engine)
        assert (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, "1"), s  # pause-free
        stats = updater.update(2)  # the next update rewrites everything and verifies
        assert stats.verified
        s = _state(engine)
        assert (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, "2"), s


@pytest.mark.timeout(300)
def test_an_update_after_a_foreign_write_of_padded_tensors_verifies(engine: str, group: object) -> None:
    """A writer of whole padded tensors (miles' ``update_weights_from_tensor`` ``direct``, sglang's
    way) fills rank 1's vocab padding rows; the engine re-zeroes them when its session ends, so
    the updater's next verified update (which expects zeros there) passes."""
    params = base.te_named_params(22)
    cfg = UpdaterConfig(mode="both", bucket_bytes=1 << 18, verify_every=1)
    with WeightUpdater(params, spec=base.SPEC, train=base.TRAIN, engine_urls=[engine], group=group,
                       config=cfg) as updater:
        assert updater.update(1).verified
        name = "model.embed_tokens.weight"
        layouts = [{t.name: t for t in engine_layout(base.SPEC, RolloutParallel(tp=2), r)} for r in range(2)]
        assert padding_runs(layouts[1][name]), "rank 1 holds vocab padding rows"
        whole = [torch.full(ts[name].shape, 0.5, dtype=torch.bfloat16).share_memory_() for ts in layouts]
        padded = [serialize_named_tensors([(name, t)]) for t in whole]
        client = EngineClient(engine)
        try:
            client.pause_generation()
            client.begin_weight_update()
            client.update_weights_from_tensor(padded, load_format="direct")
            client.end_weight_update()
            client.update_weight_version("foreign")
            client.continue_generation()
        finally:
            client.close()
        assert _state(engine)["weight_version"] == "foreign"
        for version in (2, 3):  # p2p, then broadcast
            stats = updater.update(version)
            assert stats.verified, stats
