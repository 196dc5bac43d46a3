"""Checking an update from the trainer side: the fingerprint every engine parameter must report.

After the write, each engine rank's parameters must hold exactly the bytes the plan put there. The
check is a fingerprint (:mod:`weightsync.fingerprint`): a seeded, position-dependent hash of every
element, summed, so that it composes:

* every trainer rank hashes exactly the bytes it wrote -- its share of the static plan, the
  direct runs from its parameters and the transformed ones from the packed staging -- into one
  int64 slot per (rollout rank, parameter), on its own device (:mod:`weightsync.sync.share_fingerprint`):
  in p2p while it sends; in broadcast by a hash-only pass over the same plan share for one engine
  (every engine receives the same bytes), packing into a scratch buffer where a transform applies;
* the slots of all trainer ranks are summed by one all-reduce of a small int64 vector (as 32-bit
  halves, so that no sum overflows), and the driving rank adds the padding (vocab padding rows,
  which the engine re-zeroes at the end of every session) as zeros;
* every engine rank hashes each of its non-derived, non-constant parameters where it lives (``/weights_checker``
  ``fingerprint``, with the same seed), and the driving rank names every tensor that differs, per
  engine and rank.

No weight is gathered, copied to the host or held twice. The seed is drawn per attempt by the
driving rank, so a writer that does not know it cannot make a wrong write add up.

What it proves: every parameter byte of every engine rank equals what the trainer ranks wrote
into it under the plan -- a flipped bit, a run written at a wrong offset, a write that did not
happen (over an old value that differed), a write by anyone else are all caught (each with
certainty when a single element differs; several at once with chance about 2^-64 of cancelling).
What it does not prove: that the plan is right (the plan verifier, :mod:`weightsync.plan.verify`,
and the run's first-update check against the checkpoint are that) -- a plan that routed a byte to
the wrong place would be hashed at that place on both sides.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from weightsync.fingerprint import to_hex, zeros_fingerprint
from weightsync.fingerprint.hash import MASK32
from weightsync.models.dtypes import torch_dtype
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.ops import CopyOp
from weightsync.sync.p2p_pack import DestParam, Packer, fp8_blocks
from weightsync.sync.params import padding_runs
from weightsync.sync.share_fingerprint import ShareFingerprint

if TYPE_CHECKING:
    from weightsync.sync.engines import Engines

log = logging.getLogger(__name__)

MAX_NAMED = 8
"""Differing tensors named per engine rank in a mismatch message."""


def fingerprint_slots(inputs: PlanInputs) -> dict[tuple[int, str], int]:
    """(rollout rank, parameter) -> slot, for every non-derived, non-constant parameter of every
    rollout rank (engine ``e``'s rank ``r`` is rollout rank ``e * tp + r``)."""
    keys = [(r, t.name) for r in range(inputs.num_dest) for t in inputs.dest_layout(r)
            if not t.derived and t.constant is None]
    return {k: i for i, k in enumerate(keys)}


class Verifier:
    """This trainer rank's part of the verification, and the comparison (module docstring)."""

    def __init__(self, inputs: PlanInputs, ops: Sequence[CopyOp], params: Mapping[str, torch.Tensor], *, rank: int,
                 pg: Any, bucket_bytes: int) -> None:
        """Args:
            inputs: both layouts.
            ops: this rank's share of the p2p plan (``plan_p2p_for_rank``).
            params: this rank's parameters by name (the ops' sources).
            rank: this trainer rank in ``pg``.
            pg: the trainer ranks' process group.
            bucket_bytes: the hash-only pass packs at most this much at a time.
        """
        self.inputs = inputs
        self.rank = rank
        self.pg = pg
        self.params = params
        self.slots = fingerprint_slots(inputs)
        self._names = [k for k, _ in sorted(self.slots.items(), key=lambda kv: kv[1])]
        self._padding = [(self.slots[(r, t.name)], first, count) for r in range(inputs.num_dest)
                         for t in inputs.dest_layout(r) for first, count in padding_runs(t)]
        tp = inputs.rollout.tp
        self._engine0_ops = [op for op in ops if op.dst_rank < tp]
        self._bucket_bytes = bucket_bytes
        self._share: ShareFingerprint | None = None
        self._packer: Packer | None = None
        self._scratch: torch.Tensor | None = None
        self.device = next(iter(params.values())).device if params else torch.device("cpu")

    def new_partials(self) -> torch.Tensor:
        """A zeroed slot vector on this rank's device (what the hashing adds into)."""
        return torch.zeros(len(self.slots), dtype=torch.int64, device=self.device)

    def _hash_only(self) -> tuple[ShareFingerprint, Packer]:
        if self._share is None or self._packer is None:
            tp = self.inputs.rollout.tp
            dests = {r: {t.name: DestParam(addr=0, shape=t.shape, dtype=torch_dtype(t.dtype))
                         for t in self.inputs.dest_layout(r) if not t.derived} for r in range(tp)}
            staged = [op for op in self._engine0_ops if op.transform is not None]
            packer = Packer(staged, self.params, dests, bucket_bytes=self._bucket_bytes,
                            fp8_blocks=fp8_blocks(self.inputs))
            self._scratch = torch.empty(packer.capacity, dtype=torch.uint8, device=self.device)
            scratch = self._scratch
            packer.compile(lambda i: scratch)
            self._share = ShareFingerprint(self._engine0_ops, self.params, dests, packer, self.slots, lambda i: scratch)
            self._packer = packer
        return self._share, self._packer

    def hash_share(self, partials: torch.Tensor, seed: int) -> None:
        """The hash-only pass (broadcast): add this rank's partials of engine 0's bytes into
        ``partials`` -- direct runs from the parameters, transformed ones packed into the scratch
        buffer bucket by bucket (built on first use)."""
        share, packer = self._hash_only()
        share.hash_direct(partials, seed)
        for i in range(packer.num_buckets):
            packer.pack(i)
            share.hash_bucket(i, partials, seed)

    def expected(self, partials: torch.Tensor, seed: int, *, same_for_every_engine: bool) -> \
            dict[int, dict[str, int]] | None:
        """Every rollout rank's expected fingerprints, on rank 0 of ``pg`` (None elsewhere); collective.

        Args:
            partials: this rank's slot vector (after the write's or the hash-only pass's hashing).
            seed: the seed they were hashed with.
            same_for_every_engine: the partials cover engine 0 only (broadcast's hash-only pass):
                every engine's rank ``r`` expects what engine 0's rank ``r`` does.

        Returns:
            ``{rollout rank: {parameter: unsigned 64-bit fingerprint}}`` without derived tensors.
        """
        v = partials.to("cuda" if dist.get_backend(self.pg) == "nccl" else "cpu")
        halves = torch.stack([v & MASK32, (v >> 32) & MASK32])  # each sum stays far below 2^63
        dist.all_reduce(halves, group=self.pg)
        if self.rank != 0:
            return None
        lo, hi = (h.cpu().numpy().astype(np.uint64) for h in halves)
        return self.combine(lo + (hi << np.uint64(32)), seed, same_for_every_engine=same_for_every_engine)

    def combine(self, total: np.ndarray, seed: int, *, same_for_every_engine: bool) -> dict[int, dict[str, int]]:
        """The expected fingerprints from the partials summed over every trainer rank (``total``,
        uint64 per slot): the padding's zeros added, per rollout rank and parameter (see
        :meth:`expected`)."""
        total = np.array(total, dtype=np.uint64)  # uint64 array arithmetic wraps modulo 2^64
        if self._padding:
            slots = np.array([s for s, _, _ in self._padding], dtype=np.int64)
            pads = np.array([zeros_fingerprint(f, n, seed) for _, f, n in self._padding], dtype=np.uint64)
            np.add.at(total, slots, pads)
        tp = self.inputs.rollout.tp
        out: dict[int, dict[str, int]] = {r: {} for r in range(self.inputs.num_dest)}
        for (r, name), value in zip(self._names, total.tolist(), strict=True):
            out[r][name] = value
        if same_for_every_engine:
            out = {r: out[r % tp] for r in out}
        return out

    def compare(self, engines: Engines, expected: Mapping[int, Mapping[str, int]], seed: int,
                answers: Mapping[int, Any] | None = None, only: Sequence[int] | None = None) -> dict[int, str]:
        """The engines' fingerprints (of the engines ``only``, default every one) against ``expected``.

        Args:
            engines: the engines (asked with one ``/weights_checker fingerprint`` call each, all at
                once, unless ``answers`` are given).
            expected: :meth:`expected`'s answer.
            seed: the seed the partials were hashed with.
            answers: engine index -> its fingerprints with that seed already (as
                ``end_weight_update`` with ``fingerprint_seed`` answers them); None: ask.
            only: the engines compared (indices); None: every one.

        Returns:
            Each engine that differs, did not answer, or answered another seed's fingerprints:
            why (what differs per rank, naming the tensors).
        """
        tp = self.inputs.rollout.tp
        which = list(range(len(engines.clients)) if only is None else only)
        bad: dict[int, str] = {}
        if answers is None:
            answers, bad = engines.each_of(which, lambda c: c.weights_checker("fingerprint", seed=seed),
                                           what="weights_checker fingerprint")
        for e in which:
            if e in bad:
                continue
            answer = answers.get(e)
            seeds = {x.get("seed") for x in answer["ranks"]} if isinstance(answer, dict) else set()
            if seeds != {seed}:
                bad[e] = f"{engines.where(e)} answered no fingerprints with this attempt's seed"
                continue
            assert isinstance(answer, dict)
            got_by_rank = {int(x["rank"]): x["fingerprints"] for x in answer["ranks"]}
            lines = []
            for r in range(tp):
                want, got = expected[e * tp + r], got_by_rank.get(r, {})
                diff = sorted([n for n, v in want.items() if got.get(n) != to_hex(v)]
                              + [n for n in got if n not in want])
                if diff:
                    more = f" and {len(diff) - MAX_NAMED} more" if len(diff) > MAX_NAMED else ""
                    lines.append(f"{engines.where(e)}, rank {r}: {len(diff)} of {len(want)} tensors differ: "
                                 f"{', '.join(diff[:MAX_NAMED])}{more}")
            if lines:
                bad[e] = "fingerprints differ: " + "; ".join(lines)
        return dict(sorted(bad.items()))

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the hash-only pass's packing scratch (0 until the first broadcast verification,
        and where nothing is transformed)."""
        return 0 if self._scratch is None else self._scratch.numel()

    def close(self) -> None:
        self._share = self._packer = self._scratch = None
