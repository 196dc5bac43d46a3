"""Direct writes that fingerprint what they copy: one read of each byte instead of two.

Where the transport runs device work on its copy stream (CUDA IPC,
``Transport.launches_on_device``) and Triton is importable, a p2p sender that hashes its writes
(:mod:`weightsync.sync.share_fingerprint`) replaces, for its untransformed ops, the transport's
copy plus the separate hash of the same source bytes by one kernel that copies each element and
hashes it on the way (:class:`~weightsync.fingerprint.copy_batch.CopyFingerprintBatch`): per copy
the engines publish and per rollout rank, the ops' runs with their destination addresses as the
transport maps them, each with the element size, index and slot the share's own fingerprint gives
it. The partials are the same values (both are the definition of :mod:`weightsync.fingerprint`).

Before it is used, :func:`self_check` copies and hashes a few bytes on the device and compares
with the definition; a device or Triton that fails it keeps the separate copy and hash (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from weightsync.fingerprint import DEFAULT_SEED, FingerprintBatch
from weightsync.fingerprint.batch import triton_available
from weightsync.fingerprint.copy_batch import CopyFingerprintBatch
from weightsync.plan.ops import CopyOp, box_runs
from weightsync.sync.p2p_pack import pair_runs
from weightsync.sync.share_fingerprint import Slots
from weightsync.transport import Peer, Transport
from weightsync.transport.cuda_batch import raw_view

log = logging.getLogger(__name__)

BASE_ALIGN = 256


def fusable(transport: Transport, device: torch.device) -> bool:
    """Whether direct writes through ``transport`` from ``device`` can copy and hash in one kernel."""
    return transport.launches_on_device and device.type == "cuda" and triton_available()


def fused_batches(transport: Transport, peers: Mapping[int, Peer], direct: Sequence[CopyOp],
                  params: Mapping[str, torch.Tensor], copies: Sequence[Mapping[int, Any]],
                  slots: Slots) -> list[dict[int, CopyFingerprintBatch]]:
    """Per published copy, per rollout rank: the direct ops' copy-and-hash batch.

    Args:
        transport: the sender's transport (``launches_on_device``).
        peers: rollout rank -> its connected peer.
        direct: the untransformed ops.
        params: this rank's parameters by name.
        copies: per copy, rollout rank -> what it published (``.params[name].addr``).
        slots: (rollout rank, parameter) -> slot.
    """
    device = next(iter(params.values())).device  # the CPU too: Triton's interpreter, for tests
    out = []
    for dests in copies:
        rows: dict[int, list[np.ndarray]] = {}
        for op in direct:
            src, dp = params[op.src_param], dests[op.dst_rank].params[op.dst_param]
            esize = src.element_size()
            pairs = pair_runs(box_runs(tuple(src.shape), op.src_box, esize), box_runs(dp.shape, op.dst_box, esize),
                              src.data_ptr(), dp.addr)
            local = transport.translate(peers[op.dst_rank], pairs)
            n = len(pairs)
            rows.setdefault(op.dst_rank, []).append(np.stack(
                [local[:, 0], local[:, 1], pairs[:, 2] // esize, np.full(n, esize), (pairs[:, 1] - dp.addr) // esize,
                 np.full(n, slots[(op.dst_rank, op.dst_param)])], axis=1))
        out.append({r: _batch(np.concatenate(rs).astype(np.int64), device, len(slots)) for r, rs in rows.items()})
    return out


def _batch(rows: np.ndarray, device: torch.device, num_slots: int) -> CopyFingerprintBatch:
    ends = rows[:, 2] * rows[:, 3]
    bases = []
    for col in (0, 1):
        lo = int(rows[:, col].min()) // BASE_ALIGN * BASE_ALIGN
        bases.append(raw_view(lo, int((rows[:, col] + ends).max()) - lo, device))
    return CopyFingerprintBatch(rows, bases[0], bases[1], num_slots=num_slots)


def self_check(device: torch.device) -> bool:
    """Copy and hash a few elements of each size on ``device`` (both alignment classes) and
    compare with the definition; False (logged) where the kernel cannot run or differs."""
    try:
        src = torch.arange(4096, device=device, dtype=torch.int32).view(torch.uint8)
        dst = torch.zeros_like(src)
        spans = np.array([(0, 0, 1000, 4, 0, 0), (0, 4096, 3001, 2, (1 << 32) - 7, 1), (0, 10_001, 999, 1, 5, 2)],
                         dtype=np.int64)
        shift = np.array([[0], [16], [200]], dtype=np.int64)  # same alignment, 16 bytes on, 8 bytes off
        rows = np.concatenate([src.data_ptr() + spans[:, [1]], dst.data_ptr() + spans[:, [1]] + shift, spans[:, 2:]],
                              axis=1)
        got, want = (torch.zeros(3, dtype=torch.int64, device=device) for _ in range(2))
        CopyFingerprintBatch(rows, src, dst, num_slots=3).run(got, DEFAULT_SEED)
        FingerprintBatch([src], spans, num_slots=3).run(want, DEFAULT_SEED)
        copied = all(torch.equal(src[o : o + n * e], dst[o + d : o + d + n * e])
                     for (_, o, n, e, _, _), d in zip(spans.tolist(), shift[:, 0].tolist(), strict=True))
        if copied and torch.equal(got, want):
            return True
        log.warning("the copy-and-hash kernel differs from the definition on %s: writes copy and hash apart", device)
    except Exception as exc:  # any failure to compile or run: the separate path stays
        log.warning("the copy-and-hash kernel does not run on %s (%s: %s): writes copy and hash apart", device,
                    type(exc).__name__, exc)
    return False
