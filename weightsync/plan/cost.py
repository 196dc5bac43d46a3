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
from weightsync.plan.ops import TRANSFORMS
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


# -- the calibrated update model -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """Measured costs of one update's parts (BENCHMARKS.md, "One H200" and "2x NVIDIA H200").

    Defaults are the measurements; ``network`` is the reference clusters' NIC (not measured here).
    """

    local: float = 2.10e12
    """Same-GPU copy, bytes/s (2,094-2,131 GB/s on one H200, 2026-12-01)."""
    node: float = 391e9
    """GPU to GPU of one node over CUDA IPC / NVLink, bytes/s (390.6 GB/s, 2x H200, 2026-11-30)."""
    network: float = 50e9
    """One 400 Gb/s RDMA NIC per GPU, bytes/s (the reference's H100 clusters; assumed)."""
    per_op_s: float = 0.06e-6
    """Per plan op on the batched copy path: 15.03 ms for Qwen3-30B-A3B's 9,651 direct ops at 24
    layers against 14.40 ms for one copy of the bytes (0.065 us), 0.15 us for Qwen3-4B's 1,154."""
    per_update_s: float = 0.95e-3
    """Fixed cost of one timed update (barriers, issue, completion polls): p2p update minus the
    bytes at the same-GPU rate, Qwen3-4B 1.05 ms and Qwen3-30B-A3B 1.69 ms less its ops."""
    pack: float = 1.305e12
    """Fused fp8 packing, bytes of bf16 source per second (Kimi-K2's 2 layers: 35.1 GB in 26.9 ms)."""
    per_tensor_s: float = 40e-6
    """Baseline paths (colocated from_tensor, broadcast): converting and loading one whole tensor,
    beyond its bytes (Qwen3-30B-A3B 32 layers: 536 ms for 12,579 tensors, 39 us a tensor)."""
    per_bucket_s: float = 2.2e-3
    """Baseline paths: handing over one bucket (1.9-2.6 ms a bucket in the three colocated runs)."""
    post_load: float = 781e9
    """MLA post-load, bytes moved per second (61 Kimi-K2 layers in 1.97 ms)."""

    def __post_init__(self) -> None:
        for f in ("local", "node", "network", "pack", "post_load"):
            if getattr(self, f) <= 0:
                raise ValueError(f"calibration rate {f} must be positive")

    def rates(self) -> np.ndarray:
        return np.array([self.local, self.node, self.network])


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateEstimate:
    """A predicted update time and its parts (seconds, the slowest rank's)."""

    seconds: float
    wire_s: float
    """Bytes over their links (p2p: the slowest sender or receiver; broadcast: receiving)."""
    ops_s: float
    pack_s: float
    tensors_s: float
    """Per-tensor conversion/loading (baselines only)."""
    buckets_s: float
    post_load_s: float
    slowest: str


def _src_itemsize(plan: Plan, inputs: PlanInputs) -> np.ndarray:
    t = plan.table
    dtype_of = {(r, lt.name): DTYPE_BYTES[lt.dtype] for r, ts in enumerate(inputs.source_layouts) for lt in ts}
    n = len(t.param_names)
    pairs = t.src_rank.astype(np.int64) * n + t.src_pid
    uniq, inv = np.unique(pairs, return_inverse=True)
    sizes = np.array([dtype_of[(int(u) // n, t.param_names[int(u) % n])] for u in uniq], dtype=np.int64)
    return sizes[inv] if len(uniq) else np.zeros(0, dtype=np.int64)


def post_load_bytes(inputs: PlanInputs) -> int:
    """Bytes the slowest engine rank's post-load moves: each derived tensor written, and half as
    much again read (an fp8 ``kv_b_proj`` holds half the bytes of its bf16 ``w_kc`` + ``w_vc``)."""
    per_rank = [sum(lt.numel * DTYPE_BYTES[lt.dtype] for lt in ts if lt.derived) for ts in inputs.engine_layouts]
    return int(1.5 * max(per_rank, default=0))


def simulate_update(plan: Plan, inputs: PlanInputs, cal: Calibration | None = None) -> UpdateEstimate:
    """Predict one update of ``plan`` from measured costs (:class:`Calibration`).

    p2p: each trainer rank writes its ops' bytes over their link classes, pays :attr:`per_op_s`
    per op and packs its transformed ops' source bytes at :attr:`pack` while the packed buckets
    are written (the longer of the two counts); each rollout rank
    receives its bytes; the update is the slowest rank plus :attr:`per_update_s`. Broadcast (the
    reference's path): each rollout rank receives every bucket over its link from the stage
    source and loads each tensor (:attr:`per_tensor_s`, :attr:`per_bucket_s`); a stage source
    first gathers each of its buckets over the node's links. Both end with the post-load.
    """
    cal = cal or Calibration()
    rate = cal.rates()
    post = post_load_bytes(inputs) / cal.post_load
    n_src, n_dst = inputs.train.world_size, inputs.num_dest
    if plan.mode == "p2p":
        t = plan.table
        d_elems = np.prod(t.d_hi.astype(np.int64) - t.d_lo, axis=1)
        nbytes = d_elems * _dest_itemsize(plan, inputs)
        cls = link_class(inputs, t.src_rank, t.dst_rank)
        staged = t.transform != TRANSFORMS.index(None)
        secs = nbytes / rate[cls]
        wire_direct = np.bincount(t.src_rank, weights=np.where(staged, 0.0, secs), minlength=n_src)
        wire_staged = np.bincount(t.src_rank, weights=np.where(staged, secs, 0.0), minlength=n_src)
        wire_send = wire_direct + wire_staged
        wire_recv = np.bincount(t.dst_rank, weights=secs, minlength=n_dst)
        ops = np.bincount(t.src_rank, minlength=n_src) * cal.per_op_s
        packed = np.isin(t.transform, [TRANSFORMS.index("cast"), TRANSFORMS.index("fp8_quant")])
        s_elems = np.prod(t.s_hi.astype(np.int64) - t.s_lo, axis=1)
        pack = np.bincount(t.src_rank, weights=np.where(packed, s_elems * _src_itemsize(plan, inputs), 0) / cal.pack,
                           minlength=n_src)
        # packing bucket i + 1 overlaps the write of bucket i: the longer of the two counts
        send = wire_direct + np.maximum(pack, wire_staged) + ops
        i_s, i_r = int(np.argmax(send)), int(np.argmax(wire_recv))
        if send[i_s] >= wire_recv[i_r]:
            body, slowest = float(send[i_s]), f"trainer rank {i_s} (send)"
            wire_s, ops_s, pack_s = float(wire_send[i_s]), float(ops[i_s]), float(pack[i_s])
        else:
            body, slowest = float(wire_recv[i_r]), f"rollout rank {i_r} (receive)"
            wire_s, ops_s, pack_s = body, 0.0, 0.0
        return UpdateEstimate(seconds=body + cal.per_update_s + post, wire_s=wire_s, ops_s=ops_s, pack_s=pack_s,
                              tensors_s=0.0, buckets_s=0.0, post_load_s=post, slowest=slowest)
    src = np.array([b.src_rank for b in plan.buckets], dtype=np.int64)
    size = np.array([b.nbytes for b in plan.buckets], dtype=np.float64)
    ntensors = sum(len(b.names) for b in plan.buckets)
    dst = np.arange(n_dst)
    cls = link_class(inputs, np.repeat(src, n_dst), np.tile(dst, len(src)))
    recv = np.bincount(np.tile(dst, len(src)), weights=np.repeat(size, n_dst) / rate[cls], minlength=n_dst)
    worst = cls.reshape(len(src), n_dst).max(axis=1) if len(src) else np.zeros(0, dtype=np.int64)
    source = np.bincount(src, weights=size / cal.node + size / rate[worst], minlength=n_src)
    tensors_s = ntensors * cal.per_tensor_s
    buckets_s = len(plan.buckets) * cal.per_bucket_s
    i_r, i_s = int(np.argmax(recv)), int(np.argmax(source)) if len(source) else 0
    if len(source) and source[i_s] > recv[i_r]:
        wire_s, slowest = float(source[i_s]), f"trainer rank {i_s} (gather + send)"
    else:
        wire_s, slowest = float(recv[i_r]), f"rollout rank {i_r} (receive)"
    return UpdateEstimate(seconds=wire_s + tensors_s + buckets_s + post, wire_s=wire_s, ops_s=0.0, pack_s=0.0,
                          tensors_s=tensors_s, buckets_s=buckets_s, post_load_s=post, slowest=slowest)


REFERENCE_RESULTS_MS: dict[str, tuple[float, float]] = {
    "GLM-4.7-Flash": (2509, 4229),
    "GLM-5_4layer": (732, 1261),
    "Qwen3-30B-A3B": (2670, 2160),
    "GLM-4.5-Air": (5001, 2637),
    "Qwen3-235B-A22B": (10754, 3162),
    "GLM-5": (58302, 8480),
    "Kimi-K2": (53279, 7227),
}
"""The reference's published update times, ms, (broadcast, p2p): H100 + InfiniBand, 1 GB buckets
(Kimi-K2's p2p includes ~884 ms of post-load requantization)."""

REFERENCE_LINKS = Calibration(node=450e9, network=50e9)
"""The reference clusters' links for the full-size table: NVLink 450 GB/s, one 50 GB/s NIC per GPU;
per-op, pack, per-tensor and post-load costs as measured here."""
