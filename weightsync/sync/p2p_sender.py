"""The p2p sender: one trainer rank replays its share of the static plan into live engine memory.

Each op of the plan copies a box of one of this rank's parameters into a box of a parameter of
one rollout rank. The sender compiles its ops once against the addresses the engines publish
(``/get_remote_instance_transfer_engine_info``):

* untransformed ops become byte runs straight from parameter memory into the destination
  (no staging, no extra copy), one prepared write batch per destination rank;
* transformed ops (cast, fp8 block quantization and its scales) are packed on this rank into
  a registered staging buffer, in buckets of at most ``bucket_bytes``
  (:class:`~weightsync.sync.p2p_pack.Packer`); two staging halves alternate so that packing
  bucket ``i + 1`` overlaps the write of bucket ``i``.

Every step only replays: ``send()`` issues the direct batches, then packs and writes the
buckets, then waits for everything before it returns (the trainer may change its weights
only after that). Memory is registered once, in :meth:`P2PSender.__init__`. Given fingerprint
slots, ``send(fingerprint=...)`` also hashes what it writes, on the device, while it writes
(:mod:`weightsync.sync.share_fingerprint`): the direct runs once they are issued, each staging
bucket once it is packed. Over CUDA IPC (with Triton) the direct runs are copied and hashed by one
kernel instead, one read of each byte (:mod:`weightsync.sync.fused_write`).

An engine that holds a shadow copy publishes the addresses of both its copies; a pause-free
update writes the copy the engine's session names (``begin_weight_update``'s ``target_copy``),
which alternates when the engine publishes by swapping. The sender compiles its ops once per
copy (``shadow_dests``) and ``send(targets=...)`` picks, per rollout rank, the copy to write; the
fingerprint hashes destination offsets within a parameter, the same in either copy.

Typical usage::

    sender = P2PSender(ops, params, transport, peers, bucket_bytes=1 << 30)
    stats = sender.send(deadline_s=60.0)      # every step (fingerprint=(slot vector, seed) to hash too)
    sender.close()
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from weightsync.layout.box import LocalTensor
from weightsync.plan.ops import CopyOp, box_runs
from weightsync.sync.fused_write import fusable, fused_batches, self_check
from weightsync.sync.p2p_pack import DestParam, Packer, Staged, pair_runs
from weightsync.sync.share_fingerprint import ShareFingerprint, Slots
from weightsync.transport import Peer, PeerDescriptor, Transport, WriteBatch, WriteHandle, deadline_after
from weightsync.transport.records import Region
from weightsync.transport.registry import sglang_kind

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class DestRank:
    """What one rollout rank publishes: its transport descriptor and its parameters."""

    rank: int
    descriptor: PeerDescriptor
    params: Mapping[str, DestParam]


@dataclass(frozen=True, kw_only=True, slots=True)
class SendStats:
    """Timings and bytes of one :meth:`P2PSender.send`."""

    total_s: float
    pack_s: float
    """Time spent packing and transforming into staging (on this rank's critical path)."""
    wire_s: float
    """The rest: issuing writes and waiting for them."""
    bytes_direct: int
    bytes_staged: int
    bytes_by_dest: dict[int, int]
    """Bytes written into each rollout rank (not those skipped or failed)."""
    failed: dict[int, str] = field(default_factory=dict)
    """Rollout ranks whose writes failed (``send(tolerate=True)``), with the error."""

    @property
    def nbytes(self) -> int:
        """Bytes written (every rank's, less those skipped or failed)."""
        return sum(self.bytes_by_dest.values())


SGLANG_TRANSPORT: str = sglang_kind().value
"""The transport of an engine that publishes only sglang's ``[session_id, weights_info]``: the
backend that is sglang's own transfer engine (``Transport.sglang_native``), whose session id sglang
publishes as it is and whose pointers are the parameters'."""


def sglang_descriptor(session_id: str, weights: Mapping[str, Sequence[int]]) -> PeerDescriptor:
    """The descriptor of an engine that publishes only sglang's transfer-engine info: one Mooncake
    region per published parameter, at its pointer (so a write outside every parameter is refused
    before it is issued)."""
    regions = tuple(
        Region(name=name, addr=int(ptr), nbytes=int(numel) * int(esize))
        for name, (ptr, numel, esize) in weights.items()
        if int(numel) > 0
    )
    return PeerDescriptor(kind=SGLANG_TRANSPORT, session_id=session_id, host_id="", pid=0, regions=regions)


def dest_rank_from_info(rank: int, info: Mapping[str, object], layout: Sequence[LocalTensor]) -> DestRank:
    """Check what rollout rank ``rank`` published against the layout the plan expects.

    Args:
        rank: the rollout rank.
        info: ``{"session_id": str, "weights": {name: [ptr, numel, element_size]}, "descriptor":
            PeerDescriptor JSON or None}``: the engine's ``/get_remote_instance_transfer_engine_info``
            answer. Without a descriptor (a real sglang engine publishes none) the peer is reached
            over Mooncake at ``session_id``, each parameter at its published pointer.
        layout: the rank's local tensors as the plan computed them.

    Returns:
        The rank's destination. Derived tensors of the layout (MLA ``w_kc``/``w_vc``: the engine
        recomputes them in ``end_weight_update``; sglang does not publish them) are not in it,
        whether published or not, so no op can write them.

    Raises:
        ValueError: a parameter the plan writes is missing, or published with another number of
            elements or element size than the plan expects (named), or the engine publishes
            parameters the layout does not have (another model or layout); nothing is written.
    """
    weights = info["weights"]
    assert isinstance(weights, Mapping)
    problems: list[str] = []
    params: dict[str, DestParam] = {}
    derived = {t.name for t in layout if t.derived}
    for t in layout:
        if t.derived:
            continue
        pub = weights.get(t.name)
        dtype = getattr(torch, t.dtype)
        if pub is None:
            problems.append(f"missing {t.name}")
            continue
        ptr, numel, esize = (int(x) for x in pub)
        if numel != t.numel or esize != dtype.itemsize:
            want = f"{t.numel} x {dtype.itemsize} B"
            problems.append(f"{t.name}: published numel={numel} x {esize} B, plan expects {want}")
            continue
        params[t.name] = DestParam(addr=ptr, shape=t.shape, dtype=dtype)
    extra = sorted(set(weights) - {t.name for t in layout})
    if extra:
        problems.append(f"unexpected parameters {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    if problems:
        raise ValueError(
            f"rollout rank {rank} does not have the layout the plan expects (another model or parallel layout?): "
            + "; ".join(problems[:10])
        )
    desc = info.get("descriptor")
    if desc is None:
        published = {n: v for n, v in weights.items() if n not in derived}
        descriptor = sglang_descriptor(str(info["session_id"]), published)  # type: ignore[arg-type]
    else:
        assert isinstance(desc, Mapping)
        descriptor = PeerDescriptor.from_json(dict(desc))
    return DestRank(rank=rank, descriptor=descriptor, params=params)


class P2PSender:
    """Replays one trainer rank's ops every step (see the module docstring)."""

    def __init__(
        self,
        ops: Sequence[CopyOp],
        params: Mapping[str, torch.Tensor],
        transport: Transport,
        dests: Mapping[int, DestRank],
        *,
        bucket_bytes: int,
        source_regions: Sequence[tuple[str, torch.Tensor]] | None = None,
        fp8_blocks: Mapping[str, tuple[int, int]] | None = None,
        fingerprint_slots: Slots | None = None,
        shadow_dests: Mapping[int, DestRank] | None = None,
    ) -> None:
        """Register memory, connect to every destination and compile the ops.

        Args:
            ops: this rank's ops (all with the same ``src_rank``).
            params: this rank's parameters by name (contiguous tensors that stay allocated).
            transport: the transport to write with (not yet holding registrations of ours).
            dests: rollout rank -> what it published, for every rank the ops write to.
            bucket_bytes: staging bucket size (``BUCKET_SIZE_GB``); staging holds two buckets.
            source_regions: memory to register as the write source (e.g. the arena holding
                every parameter); default: each parameter an op reads, registered on its own.
            fp8_blocks: global weight name -> fp8 block, for ops that quantize.
            fingerprint_slots: (rollout rank, parameter) -> slot, for :meth:`send` to hash what it
                writes (:mod:`weightsync.sync.share_fingerprint`); None: never hashes.
            shadow_dests: rollout rank -> its second copy's table (copy 1; the same descriptor),
                for every rank in ``dests``; None: the engines publish one copy.

        Raises:
            ValueError: an op names a parameter that does not exist on either side, or a box
                that does not fit it (the message names the parameter).
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.transport = transport
        self.params = params
        self.copies = [dests] + ([shadow_dests] if shadow_dests is not None else [])
        """Per copy, what every rollout rank published for it (copy 0: sglang's table)."""
        self.dests = dests
        for copy in self.copies:
            self._check_ops(ops, copy)
        direct = [op for op in ops if op.transform is None]
        self.bucket_bytes = bucket_bytes
        tables = {r: d.params for r, d in dests.items()}
        self.packer = Packer([op for op in ops if op.transform is not None], params, tables,
                             bucket_bytes=bucket_bytes, fp8_blocks=fp8_blocks)
        self._buckets = self.packer.buckets
        self._staging = [torch.empty(self.packer.capacity, dtype=torch.uint8, device=self._device())
                         for _ in range(2)]
        self.packer.compile(lambda i: self._staging[i % 2])
        self._register_sources(direct, source_regions)
        self._peers: dict[int, Peer] = {r: transport.connect(d.descriptor) for r, d in dests.items()}
        self._direct = [self._rotate(self._compile_direct(direct, copy), ops) for copy in self.copies]
        self._bucket_runs = [[self._compile_bucket(b, copy, half=i % 2) for i, b in enumerate(self._buckets)]
                             for copy in self.copies]
        self.fingerprint = None if fingerprint_slots is None else ShareFingerprint(
            ops, params, tables, self.packer, fingerprint_slots, lambda i: self._staging[i % 2])
        """The share's partial fingerprints, hashed by :meth:`send` when asked (None without slots)."""
        self._fused = None
        if fingerprint_slots is not None and direct and fusable(transport, self._device()) and self_check(
                self._device()):
            self._fused = fused_batches(transport, self._peers, direct, params, self.copies, fingerprint_slots)
        """Per copy, per rollout rank: the direct writes that also hash (:mod:`~weightsync.sync.fused_write`)."""
        self.bytes_direct = sum(b.nbytes for b in self._direct[0].values())
        self.bytes_staged = sum(s.nbytes for b in self._buckets for s in b)

    @property
    def staging_bytes(self) -> int:
        """Bytes of the two staging halves this rank holds (0 when nothing is transformed)."""
        return sum(s.numel() for s in self._staging)

    @property
    def num_buckets(self) -> int:
        """Staging buckets replayed every step (0 when every op is written straight from parameters)."""
        return len(self._buckets)

    # -- compile (once) -----------------------------------------------------------------------

    def _device(self) -> torch.device:
        for t in self.params.values():
            return t.device
        return torch.device("cpu")

    def _check_ops(self, ops: Sequence[CopyOp], dests: Mapping[int, DestRank]) -> None:
        for op in ops:
            src = self.params.get(op.src_param)
            if src is None:
                raise ValueError(f"plan reads {op.src_param!r}, which this trainer rank does not hold")
            if not src.is_contiguous():
                raise ValueError(f"source parameter {op.src_param!r} must be contiguous")
            dest = dests.get(op.dst_rank)
            if dest is None:
                raise ValueError(f"plan writes rollout rank {op.dst_rank}, which published nothing")
            dp = dest.params.get(op.dst_param)
            if dp is None:
                raise ValueError(f"rollout rank {op.dst_rank} has no parameter {op.dst_param!r}")
            sides = ((op.src_box, tuple(src.shape), op.src_param), (op.dst_box, dp.shape, op.dst_param))
            for box, shape, what in sides:
                if len(box) != len(shape) or any(a < 0 or b > d for (a, b), d in zip(box, shape, strict=True)):
                    raise ValueError(f"plan box {box} does not fit {what!r} of shape {shape}")

    def _register_sources(
        self, direct: Sequence[CopyOp], source_regions: Sequence[tuple[str, torch.Tensor]] | None
    ) -> None:
        if source_regions is None:
            names = sorted({op.src_param for op in direct})
            source_regions = [(n, self.params[n]) for n in names]
        for name, t in source_regions:
            self.transport.register_tensor(f"src:{name}", t)
        for i, s in enumerate(self._staging):
            if s.numel():
                self.transport.register_tensor(f"staging{i}", s)

    def _compile_direct(self, direct: Sequence[CopyOp], dests: Mapping[int, DestRank]) -> dict[int, WriteBatch]:
        per_dest: dict[int, list[np.ndarray]] = defaultdict(list)
        for op in direct:
            src = self.params[op.src_param]
            dp = dests[op.dst_rank].params[op.dst_param]
            isz = src.element_size()
            if src.dtype != dp.dtype:
                raise ValueError(f"{op.src_param} ({src.dtype}) -> {op.dst_param} ({dp.dtype}) needs a transform")
            s_runs = box_runs(tuple(src.shape), op.src_box, isz)
            d_runs = box_runs(dp.shape, op.dst_box, isz)
            per_dest[op.dst_rank].append(pair_runs(s_runs, d_runs, src.data_ptr(), dp.addr))
        return {r: self.transport.prepare(self._peers[r], np.concatenate(rs)) for r, rs in per_dest.items()}

    @staticmethod
    def _rotate(batches: dict[int, WriteBatch], ops: Sequence[CopyOp]) -> dict[int, WriteBatch]:
        """Order the per-destination batches starting at a receiver that depends on this sender,
        so that the senders of a plan (ordered by destination) do not all start on the same one."""
        order = sorted(batches)
        if not order or not ops:
            return batches
        k = ops[0].src_rank % len(order)
        return {r: batches[r] for r in order[k:] + order[:k]}

    def _compile_bucket(self, bucket: Sequence[Staged], dests: Mapping[int, DestRank],
                        half: int) -> dict[int, WriteBatch]:
        base = self._staging[half].data_ptr()
        per_dest: dict[int, list[np.ndarray]] = defaultdict(list)
        for s in bucket:
            dp = dests[s.op.dst_rank].params[s.op.dst_param]
            d_runs = box_runs(dp.shape, s.op.dst_box, dp.itemsize)
            per_dest[s.op.dst_rank].append(pair_runs([(s.offset, s.nbytes)], d_runs, base, dp.addr))
        return {r: self.transport.prepare(self._peers[r], np.concatenate(rs)) for r, rs in per_dest.items()}

    # -- replay (every step) ------------------------------------------------------------------

    def send(self, *, deadline_s: float = 300.0, fingerprint: tuple[torch.Tensor, int] | None = None,
             targets: Mapping[int, int] | None = None, skip: Collection[int] = (),
             tolerate: bool = False) -> SendStats:
        """Write every op of this rank once; returns when all bytes have landed.

        Args:
            deadline_s: how long the writes may take.
            targets: rollout rank -> the copy to write there (default: copy 0 everywhere).
            fingerprint: ``(slot vector, seed)``: also add the partial fingerprint of every byte
                written into the slot vector (int64 on this rank's device), hashed from the
                parameters and the packed staging while the writes are in flight. Needs
                ``fingerprint_slots`` at construction.
            skip: rollout ranks not written (engines dropped from the fleet's updates).
            tolerate: a rank whose write fails or misses the deadline is not written further and
                is named in :attr:`SendStats.failed`, while the other ranks are written to the end;
                False: the first failure raises.

        Raises:
            TimeoutError: a write did not complete within ``deadline_s`` (engines must then be
                treated as dirty: the caller keeps them paused); not with ``tolerate``.
            ValueError: a fingerprint asked of a sender built without slots, or a target copy the
                engine did not publish.
        """
        if fingerprint is not None and self.fingerprint is None:
            raise ValueError("this sender was built without fingerprint slots")
        t0 = time.perf_counter()
        deadline = deadline_after(deadline_s)
        pick = self._picker(targets or {})
        failed: dict[int, str] = {}
        skipped = set(skip)

        def guarded(r: int, fn: Callable[[], T]) -> T | None:
            if r in skipped or r in failed:
                return None
            try:
                return fn()
            except Exception as exc:  # a failed rank: the others are written on (tolerate)
                if not tolerate:
                    raise
                failed[r] = f"{type(exc).__name__}: {exc}"
                return None

        def write(r: int, batch: WriteBatch) -> tuple[int, WriteHandle | None]:
            return r, guarded(r, lambda: self.transport.write(self._peers[r], batch))

        def wait(handles: Sequence[tuple[int, WriteHandle | None]]) -> None:
            for r, h in handles:
                if h is not None:
                    guarded(r, lambda h=h: self.transport.wait(h, deadline))

        direct = {r: pick(r, self._direct) for r in self._direct[0] if r not in skipped}
        pending: list[tuple[int, WriteHandle | None]]
        if fingerprint is not None and self._fused is not None:  # each copy hashes what it copies
            fused = {r: pick(r, self._fused) for r in direct}
            def launch(r: int, f: Any) -> WriteHandle:
                return self.transport.launch(self._peers[r], partial(f.run, *fingerprint), f.nbytes)

            pending = [(r, guarded(r, lambda r=r, f=f: launch(r, f))) for r, f in fused.items()]
        else:
            pending = [write(r, b) for r, b in direct.items()]
            if fingerprint is not None:
                self.fingerprint.hash_direct(*fingerprint)  # type: ignore[union-attr]
        in_flight: list[list[tuple[int, WriteHandle | None]]] = [[], []]
        pack_s = 0.0
        for i in range(len(self._buckets)):
            half = i % 2
            wait(in_flight[half])  # the half we pack into must have been written out
            tp = time.perf_counter()
            self.packer.pack(i)
            if self._staging[half].is_cuda:
                torch.cuda.current_stream().synchronize()
            pack_s += time.perf_counter() - tp
            in_flight[half] = [write(r, pick(r, [c[i] for c in self._bucket_runs])) for r in self._bucket_runs[0][i]
                               if r not in skipped]
            if fingerprint is not None:  # on the current stream: before the next pack into this half
                self.fingerprint.hash_bucket(i, *fingerprint)  # type: ignore[union-attr]
        wait(pending + in_flight[0] + in_flight[1])
        if fingerprint is not None and fingerprint[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the hashes read weights the caller may change next
        total = time.perf_counter() - t0
        by_dest: dict[int, int] = defaultdict(int)
        for r, b in self._direct[0].items():
            by_dest[r] += b.nbytes
        for runs in self._bucket_runs[0]:
            for r, b in runs.items():
                by_dest[r] += b.nbytes
        by_dest = {r: n for r, n in by_dest.items() if r not in skipped and r not in failed}
        return SendStats(total_s=total, pack_s=pack_s, wire_s=total - pack_s, bytes_direct=self.bytes_direct,
                         bytes_staged=self.bytes_staged, bytes_by_dest=by_dest, failed=failed)

    def _picker(self, targets: Mapping[int, int]) -> Callable[[int, Sequence[Mapping[int, WriteBatch]]], WriteBatch]:
        """``pick(rank, per_copy_batches)``: the batch of the copy ``targets`` names for ``rank``."""
        bad = {r: c for r, c in targets.items() if not 0 <= c < len(self.copies)}
        if bad:
            raise ValueError(f"rollout ranks {sorted(bad)} asked for copies {sorted(set(bad.values()))}; this sender "
                             f"compiled {len(self.copies)} (the engines published that many)")
        return lambda r, per_copy: per_copy[targets.get(r, 0)][r]

    def close(self) -> None:
        """Release registrations and connections (idempotent)."""
        self.transport.close()
