"""The partial fingerprints of one trainer rank's plan share: exactly the bytes it writes, hashed.

Every op of the share writes a box of a destination parameter. An untransformed op's bytes are a
box of this rank's own parameter; a transformed op's bytes are its packed region of a staging
bucket (:class:`~weightsync.sync.p2p_pack.Packer`). Both are hashed as the destination elements
they become -- element ``k`` of the destination parameter at the index ``k`` it lands at -- into
the slot of that (rollout rank, parameter) (:mod:`weightsync.fingerprint`). Summed over the
trainer ranks, the slots equal what each engine rank computes over the parameters it holds,
padding aside (:class:`~weightsync.sync.verify.Verifier` adds it).

Built once per share: one :class:`~weightsync.fingerprint.FingerprintBatch` over the direct ops'
sources, and one per staging bucket over the staging tensor that bucket is packed into. The p2p
sender runs them while it sends (the direct batch once the direct writes are issued, each
bucket's right after it is packed); the verification's hash-only pass runs them over a scratch
staging (broadcast, where nothing is packed for the wire).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from weightsync.fingerprint import FingerprintBatch
from weightsync.plan.ops import CopyOp, box_runs
from weightsync.sync.p2p_pack import DestParam, Packer, pair_runs

Slots = Mapping[tuple[int, str], int]
"""(rollout rank, parameter) -> the index of its fingerprint in the slot vector."""


def _spans(pairs: np.ndarray, source: int, esize: int, slot: int) -> np.ndarray:
    """Span rows of paired ``(source offset, destination offset, nbytes)`` byte runs."""
    n = len(pairs)
    return np.stack([np.full(n, source), pairs[:, 0], pairs[:, 2] // esize, np.full(n, esize),
                     pairs[:, 1] // esize, np.full(n, slot)], axis=1)


class ShareFingerprint:
    """One trainer rank's partial fingerprints of its plan share (module docstring)."""

    def __init__(self, ops: Sequence[CopyOp], params: Mapping[str, torch.Tensor],
                 dests: Mapping[int, Mapping[str, DestParam]], packer: Packer, slots: Slots,
                 staging_of: Callable[[int], torch.Tensor]) -> None:
        """Args:
        ops: the share's ops (those with a transform must be the ones ``packer`` lays out).
        params: this rank's parameters by name.
        dests: rollout rank -> its parameters (shape and dtype).
        packer: the staging layout of the transformed ops.
        slots: where each destination parameter's fingerprint accumulates.
        staging_of: the staging tensor bucket ``i`` is packed into.
        """
        names = sorted({op.src_param for op in ops if op.transform is None})
        source = {n: i for i, n in enumerate(names)}
        rows = []
        for op in ops:
            if op.transform is not None:
                continue
            src, dp = params[op.src_param], dests[op.dst_rank][op.dst_param]
            esize = dp.itemsize
            s_runs, d_runs = box_runs(tuple(src.shape), op.src_box, esize), box_runs(dp.shape, op.dst_box, esize)
            pairs = pair_runs(s_runs, d_runs, 0, 0)
            rows.append(_spans(pairs, source[op.src_param], esize, slots[(op.dst_rank, op.dst_param)]))
        num_slots = len(slots)
        self.direct = FingerprintBatch([params[n].reshape(-1) for n in names], _stack(rows), num_slots=num_slots)
        self.buckets: list[FingerprintBatch] = []
        for i, bucket in enumerate(packer.buckets):
            rows = []
            for s in bucket:
                dp = packer.dest(s.op)
                pairs = pair_runs([(s.offset, s.nbytes)], box_runs(dp.shape, s.op.dst_box, dp.itemsize), 0, 0)
                rows.append(_spans(pairs, 0, dp.itemsize, slots[(s.op.dst_rank, s.op.dst_param)]))
            self.buckets.append(FingerprintBatch([staging_of(i)], _stack(rows), num_slots=num_slots))

    @property
    def nbytes(self) -> int:
        """Bytes hashed per pass (the share's destination bytes)."""
        return self.direct.nbytes + sum(b.nbytes for b in self.buckets)

    def hash_direct(self, out: torch.Tensor, seed: int) -> None:
        """Add the untransformed ops' partials (read from the parameters) into ``out``."""
        self.direct.run(out, seed)

    def hash_bucket(self, index: int, out: torch.Tensor, seed: int) -> None:
        """Add bucket ``index``'s partials (read from its staging, packed) into ``out``."""
        self.buckets[index].run(out, seed)


def _stack(rows: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros((0, 6), dtype=np.int64)
