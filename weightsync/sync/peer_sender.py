"""Engine -> engine: one rank of a donor engine writes its share of a copy into a joining engine.

A joining engine (another TP / EP / DP-attention layout allowed) gets the fleet's current version
from a healthy peer instead of from the trainer or from disk. The copy is planned with the same
planner as a trainer update (:func:`weightsync.plan.p2p.plan_p2p_for_rank`): the donor's ranks are
the sources -- each holds the sglang pieces of its own layout, one "trainer rank" per donor rank,
so the holder rule spreads replicated tensors over them -- and the joiner's ranks the one
destination engine. Untransformed ops only (both sides store the same dtypes; fp8 weights and their
scales are copied as stored), written one-sided by the same :class:`~weightsync.sync.p2p_sender.P2PSender`
as a trainer update, from the donor's served copy into the copy the joiner's session writes, with
the share's partial fingerprints hashed while it writes (:mod:`weightsync.sync.share_fingerprint`).
Summed over the donor's ranks (:func:`expected_fingerprints`), they are what every joiner rank
must report for the copy before it may serve it.

A donor rank runs its share in a thread of its own (:class:`PeerDonation`), so the rank goes on
executing its engine's commands (generation included) while the bytes move; the donor's rank 0
holds its flips and in-place writes meanwhile (:mod:`weightsync.engine.session_fleet`).

Typical usage (every donor rank; rank 0 then sums the partials)::

    donation = PeerDonation(engine.store, spec, donor_par, rank, joiner_par, joiner_ranks,
                            transport=TransportConfig(kind="shm"), seed=s, deadline_s=120.0)
    while (out := donation.result()) is None: ...
    expected = expected_fingerprints(spec, donor_par, joiner_par, [out, ...], seed=s)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from weightsync.fingerprint import to_hex
from weightsync.layout.sglang import engine_layout
from weightsync.models.parallel import RolloutParallel, TrainParallel, default_placement
from weightsync.models.spec import ModelSpec
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.p2p import plan_p2p_for_rank
from weightsync.sync.p2p_pack import fp8_blocks
from weightsync.sync.p2p_sender import P2PSender, dest_rank_from_info
from weightsync.sync.params import ParamStore
from weightsync.sync.verify import Verifier, fingerprint_slots
from weightsync.transport import TransportConfig

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20
"""Staging of a transformed op (none between engines of one model: both store the same dtypes)."""


def peer_inputs(spec: ModelSpec, donor: RolloutParallel, joiner: RolloutParallel) -> PlanInputs:
    """The planner's inputs of a copy between two engines of ``spec``: the donor's ranks as the
    sources (their sglang layouts), one joiner engine as the destination."""
    donors = tuple(tuple(engine_layout(spec, donor, r)) for r in range(donor.tp))
    joiner = replace(joiner, num_engines=1)
    sources, dests = default_placement(donor.tp, joiner.tp)
    return PlanInputs(spec=spec, train=TrainParallel(world_size=donor.tp), rollout=joiner, source_layouts=donors,
                      engine_layouts=tuple(tuple(engine_layout(spec, joiner, r)) for r in range(joiner.tp)),
                      train_devices=tuple(sources), rollout_devices=tuple(dests))


def expected_fingerprints(spec: ModelSpec, donor: RolloutParallel, joiner: RolloutParallel,
                          partials: Sequence[Sequence[int]], *, seed: int) -> list[dict[str, str]]:
    """What every joiner rank must report for the copy: the donor ranks' partials summed (modulo
    2^64), the vocab padding added as the zeros the joiner's ``end_weight_update`` writes.

    Returns:
        Per joiner rank, ``{parameter: 16 hex digits}`` (``/weights_checker fingerprint``'s form).
    """
    inputs = peer_inputs(spec, donor, joiner)
    total = np.zeros(len(fingerprint_slots(inputs)), dtype=np.uint64)
    for p in partials:
        total += np.array(p, dtype=np.uint64)  # uint64 arithmetic wraps modulo 2^64
    combined = Verifier(inputs, [], {}, rank=0, pg=None, bucket_bytes=1).combine(total, seed,
                                                                                 same_for_every_engine=False)
    return [{n: to_hex(v) for n, v in combined[r].items()} for r in range(joiner.tp)]


class PeerDonation:
    """One donor rank's share of a copy into a joiner, in a thread (module docstring)."""

    def __init__(self, store: ParamStore, spec: ModelSpec, donor: RolloutParallel, rank: int,
                 joiner: RolloutParallel, joiner_ranks: Sequence[Mapping[str, Any]], *,
                 transport: TransportConfig, seed: int, deadline_s: float) -> None:
        """Start the copy at once.

        Args:
            store: this donor rank's served parameters (they must not change until the copy ends).
            spec: the model (the joiner's tables are checked against its layout).
            donor: the donor engine's parallel sizes; ``rank`` is this rank in it.
            joiner: the joiner's parallel sizes.
            joiner_ranks: per joiner rank, ``{"session_id", "weights": the table of the copy its
                session writes, "descriptor"}``.
            transport: the transport to write with (the joiner's descriptors' kind).
            seed: the fingerprint's seed (the joiner's).
            deadline_s: how long the writes may take.
        """
        self._args = (store, spec, donor, rank, joiner, joiner_ranks, transport, seed, deadline_s)
        self._out: dict[str, Any] | None = None
        self._error: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"donate-rank{rank}", daemon=True)
        self._thread.start()

    def result(self) -> dict[str, Any] | None:
        """None while the copy runs; then ``{"partials", "nbytes", "num_ops", "seconds"}`` or
        ``{"error"}`` (the rank's failure, one line)."""
        if not self._done.is_set():
            return None
        return {"error": self._error} if self._error is not None else self._out

    def wait(self, timeout_s: float) -> bool:
        """Wait for the copy to end (True) or ``timeout_s`` (False)."""
        return self._done.wait(timeout_s)

    def _run(self) -> None:
        try:
            self._out = self._copy(*self._args)
        except Exception as exc:  # reported through result(); the rank goes on
            log.exception("[rank%d] donation failed", self._args[3])
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            self._done.set()

    @staticmethod
    def _copy(store: ParamStore, spec: ModelSpec, donor: RolloutParallel, rank: int, joiner: RolloutParallel,
              joiner_ranks: Sequence[Mapping[str, Any]], transport: TransportConfig, seed: int,
              deadline_s: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        if len(joiner_ranks) != joiner.tp:
            raise ValueError(f"the joiner published {len(joiner_ranks)} ranks for tp={joiner.tp}")
        inputs = peer_inputs(spec, donor, joiner)
        ops = list(plan_p2p_for_rank(inputs, src_rank=rank).ops)
        if any(op.transform is not None for op in ops):
            raise ValueError("the joiner stores some tensor in another dtype than this engine: not the same model")
        slots = fingerprint_slots(inputs)
        params = dict(store.items())
        partials = torch.zeros(len(slots), dtype=torch.int64, device=store.device)
        nbytes = 0
        if ops:
            needed = sorted({op.dst_rank for op in ops})
            dests = {r: dest_rank_from_info(r, joiner_ranks[r], inputs.dest_layout(r)) for r in needed}
            device = store.device.index if store.device.type == "cuda" else None
            sender = P2PSender(ops, params, transport.on_device(device).make(), dests,
                               bucket_bytes=DEFAULT_BUCKET_BYTES, fp8_blocks=fp8_blocks(inputs),
                               fingerprint_slots=slots)
            try:
                stats = sender.send(deadline_s=deadline_s, fingerprint=(partials, seed))
                nbytes = stats.nbytes
            finally:
                sender.close()
        values = partials.cpu().numpy().view(np.uint64)
        log.info("[rank%d] donated %d ops, %.1f MB in %.3f s", rank, len(ops), nbytes / 1e6, time.perf_counter() - t0)
        return {"partials": [int(v) for v in values], "nbytes": nbytes, "num_ops": len(ops),
                "seconds": time.perf_counter() - t0}
