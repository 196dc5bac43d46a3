"""Cost model: bytes per link class and a time estimate from link bandwidths.

Every byte of a plan crosses one of three link classes, fixed by the placement of its sender
and receiver: ``local`` (same GPU: a device copy), ``node`` (same node: NVLink / CUDA IPC, or
shared memory on CPU hosts) and ``network`` (RDMA / TCP). A rank's time is the sum over link
classes of its bytes on that class divided by the class's bandwidth, on the sending and on the
receiving side; the estimate is the slowest rank. It ignores packing and latency, so it is a
floor that measured runs are compared with (DESIGN.md, "Performance method").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightsync.models.hf import DTYPE_BYTES
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.records import Mode, Plan

LINK_CLASSES = ("local", "node", "network")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkBandwidth:
    """Bytes per second of one rank's link of each class."""

    local: float = 2140e9
    """Same-GPU device copy (measured on H200, DESIGN.md)."""
    node: float = 396e9
    """Same-node GPU-to-GPU over NVLink through CUDA IPC (measured on H200, DESIGN.md)."""
    network: float = 50e9
    """One 400 Gb/s RDMA NIC per GPU (the reference clusters' H100 nodes)."""

    def __post_init__(self) -> None:
        for k in LINK_CLASSES:
            if getattr(self, k) <= 0:
                raise ValueError(f"bandwidth {k} must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class CostEstimate:
    """Bytes per link class and the estimated transfer time."""

    link_bytes: dict[str, int]
    """Link class -> bytes that cross it (all ranks)."""
    seconds: float
    """Estimated time: the slowest rank, sending or receiving."""
    slowest: str
    """Which rank sets it, e.g. ``"rollout rank 3 (receive)"``."""


def _dest_itemsize(plan: Plan, inputs: PlanInputs) -> np.ndarray:
    """Destination bytes per element of every op."""
    t = plan.table
    dtype_of: dict[tuple[int, str], int] = {
        (r, lt.name): DTYPE_BYTES[lt.dtype] for r, ts in enumerate(inputs.engine_layouts) for lt in ts
    }
    pairs = (t.dst_rank.astype(np.int64) % inputs.rollout.tp) * len(t.param_names) + t.dst_pid
    uniq, inv = np.unique(pairs, return_inverse=True)
    sizes = np.array([dtype_of[(int(u) // len(t.param_names), t.param_names[int(u) % len(t.param_names)])]
                      for u in uniq], dtype=np.int64)
    return sizes[inv] if len(uniq) else np.zeros(0, dtype=np.int64)


def link_class(inputs: PlanInputs, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Index into :data:`LINK_CLASSES` (0 local, 1 node, 2 network) of each (trainer rank, rollout
    rank) pair, from the placement: what a transport factory picks its backend by."""
    tn = np.array([d.node for d in inputs.train_devices])[src]
    tg = np.array([d.gpu for d in inputs.train_devices])[src]
    rn = np.array([d.node for d in inputs.rollout_devices])[dst]
    rg = np.array([d.gpu for d in inputs.rollout_devices])[dst]
    same_node = tn == rn
    return 2 - same_node.astype(np.int64) - (same_node & (tg == rg))


def estimate(plan: Plan, inputs: PlanInputs, bandwidth: LinkBandwidth | None = None) -> CostEstimate:
    """Bytes per link class and the time floor of ``plan`` on ``bandwidth``.

    For p2p every op's bytes go from its sender to its receiver. For broadcast every receiver
    gets each bucket from the bucket's stage source, and each source sends each bucket once.
    """
    bw = bandwidth or LinkBandwidth()
    rate = np.array([bw.local, bw.node, bw.network])
    n_src, n_dst = inputs.train.world_size, inputs.num_dest
    if plan.mode is Mode.P2P:
        t = plan.table
        nbytes = np.prod(t.d_hi.astype(np.int64) - t.d_lo, axis=1) * _dest_itemsize(plan, inputs)
        cls = link_class(inputs, t.src_rank, t.dst_rank)
        send_time = np.bincount(t.src_rank, weights=nbytes / rate[cls], minlength=n_src)
        recv_time = np.bincount(t.dst_rank, weights=nbytes / rate[cls], minlength=n_dst)
        link = np.bincount(cls, weights=nbytes, minlength=3)
    else:
        src = np.array([b.src_rank for b in plan.buckets], dtype=np.int64)
        size = np.array([b.nbytes for b in plan.buckets], dtype=np.float64)
        dst = np.arange(n_dst)
        cls = link_class(inputs, np.repeat(src, n_dst), np.tile(dst, len(src)))
        per = np.repeat(size, n_dst)
        recv_time = np.bincount(np.tile(dst, len(src)), weights=per / rate[cls], minlength=n_dst)
        link = np.bincount(cls, weights=per, minlength=3)
        # each source injects each bucket once, over its slowest class to a receiver
        worst = cls.reshape(len(src), n_dst).max(axis=1) if len(src) else np.zeros(0, dtype=np.int64)
        send_time = np.bincount(src, weights=size / rate[worst], minlength=n_src)
    i_s, i_r = int(np.argmax(send_time)), int(np.argmax(recv_time))
    if send_time[i_s] >= recv_time[i_r]:
        seconds, slowest = float(send_time[i_s]), f"trainer rank {i_s} (send)"
    else:
        seconds, slowest = float(recv_time[i_r]), f"rollout rank {i_r} (receive)"
    return CostEstimate(link_bytes={k: int(v) for k, v in zip(LINK_CLASSES, link, strict=True)}, seconds=seconds,
                        slowest=slowest)
