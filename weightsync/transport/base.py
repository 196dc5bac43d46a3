"""The transport interface: one-sided byte writes into another process's registered memory.

A transport moves bytes, nothing else: it knows no model, no parameter names beyond the labels
of the regions it is given, and no plan. Everything above it (sender, receiver) speaks in
*runs*: ``(src_addr, dst_addr, nbytes)`` triples, where ``src_addr`` is an address in the
writer's own registered memory and ``dst_addr`` is an address **in the receiver's address space**
(exactly the pointers the receiver publishes, e.g. through sglang's
``/get_remote_instance_transfer_engine_info``). Each backend translates ``dst_addr`` into what it
needs (a shared-memory mapping, an opened CUDA IPC pointer, a Mooncake segment offset).

Records that cross process boundaries (:class:`Region`, :class:`PeerDescriptor`) are frozen and
JSON-serializable; everything else here is local to one process.
"""

from __future__ import annotations

import abc
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

Run = tuple[int, int, int]
"""``(src_addr, dst_addr, nbytes)``: one contiguous byte run of a write."""

HOST = -1
"""The ``device`` of host (CPU) memory in :class:`Region` and :meth:`Transport.register`."""

DEFAULT_ALIGN = 256
"""Byte alignment of arena allocations: CUDA's allocation granularity for vectorized access."""


def host_id() -> str:
    """An identifier of this machine boot: hostname plus the kernel's boot id.

    Same-host transports (shm, cuda_ipc) compare it to refuse peers on other machines early.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def deadline_after(seconds: float) -> float:
    """The absolute deadline (``time.monotonic()`` clock) ``seconds`` from now, for :meth:`Transport.wait`."""
    return time.monotonic() + seconds


# ----------------------------------------------------------------------------------------------
# Serialized records


@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    """One registered memory region as its owner publishes it (serialized, JSON-safe)."""

    name: str
    """Label given at registration (e.g. ``"params"`` or a parameter name); unique per owner."""
    addr: int
    """Start address in the owner's address space (a device pointer for GPU memory)."""
    nbytes: int
    """Length in bytes."""
    handle: str = ""
    """Backend-specific name of the memory that peers open: a shm segment name, a base64 CUDA IPC
    handle; empty when peers address ``addr`` directly (mooncake, dist, local)."""
    handle_offset: int = 0
    """Offset of ``addr`` from the start of the memory that ``handle`` names."""
    device: int = HOST
    """Owner's CUDA device ordinal, or :data:`HOST` for host memory."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("region name must be non-empty")
        if self.addr <= 0 or self.nbytes <= 0:
            raise ValueError(f"region {self.name!r}: addr and nbytes must be positive, got {self.addr}, {self.nbytes}")
        if self.handle_offset < 0:
            raise ValueError(f"region {self.name!r}: handle_offset must be >= 0, got {self.handle_offset}")

    @property
    def end(self) -> int:
        return self.addr + self.nbytes

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "addr": self.addr,
            "nbytes": self.nbytes,
            "handle": self.handle,
            "handle_offset": self.handle_offset,
            "device": self.device,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Region:
        return cls(
            name=str(data["name"]),
            addr=int(data["addr"]),
            nbytes=int(data["nbytes"]),
            handle=str(data.get("handle", "")),
            handle_offset=int(data.get("handle_offset", 0)),
            device=int(data.get("device", HOST)),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerDescriptor:
    """What a receiver publishes so that writers can reach its registered memory (JSON-safe)."""

    kind: str
    """The transport kind that produced it (a :class:`~weightsync.transport.TransportKind` value)."""
    session_id: str
    """How to reach the owner: ``"ip:port"`` (mooncake), a rank (dist), ``"shm:<pid>"`` ..."""
    host_id: str
    """:func:`host_id` of the owner's machine."""
    pid: int
    """Owner's process id."""
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"descriptor {self.session_id!r} has duplicate region names: {sorted(names)}")

    def region(self, name: str) -> Region:
        """The region called ``name``; raises ``KeyError`` listing the names there are."""
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"peer {self.session_id!r} has no region {name!r}; it has {[r.name for r in self.regions]}")

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "session_id": self.session_id,
            "host_id": self.host_id,
            "pid": self.pid,
            "regions": [r.to_json() for r in self.regions],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PeerDescriptor:
        return cls(
            kind=str(data["kind"]),
            session_id=str(data["session_id"]),
            host_id=str(data["host_id"]),
            pid=int(data["pid"]),
            regions=tuple(Region.from_json(r) for r in data["regions"]),
        )


# ----------------------------------------------------------------------------------------------
# Run arithmetic (pure functions over (N, 3) int64 arrays)


def as_runs(runs: Sequence[Run] | np.ndarray) -> np.ndarray:
    """Runs as a fresh ``(N, 3)`` int64 array ``[src, dst, nbytes]``.

    Raises:
        ValueError: wrong shape, or a run with ``nbytes <= 0`` or a non-positive address.
    """
    arr = np.array(runs, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"runs must be (src_addr, dst_addr, nbytes) triples; got an array of shape {arr.shape}")
    bad = np.flatnonzero((arr[:, 2] <= 0) | (arr[:, 0] <= 0) | (arr[:, 1] <= 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"run {i} = {tuple(int(x) for x in arr[i])}: addresses and nbytes must be positive")
    return arr


def coalesce_runs(runs: np.ndarray, keys: np.ndarray | None = None) -> np.ndarray:
    """Merge each run into the previous one when both its source and destination follow on.

    Order is kept, so the concatenated byte stream of the runs is unchanged. With ``keys``
    (one int per run), runs merge only when their keys are equal too: used to keep runs from
    crossing region boundaries.
    """
    if len(runs) <= 1:
        return runs.copy()
    src, dst, n = runs[:, 0], runs[:, 1], runs[:, 2]
    follows = (src[1:] == src[:-1] + n[:-1]) & (dst[1:] == dst[:-1] + n[:-1])
    if keys is not None:
        follows &= keys[1:] == keys[:-1]
    starts = np.concatenate(([True], ~follows))
    group = np.cumsum(starts) - 1
    out = runs[starts].copy()
    out[:, 2] = np.bincount(group, weights=n, minlength=len(out)).astype(np.int64)
    return out


BLOCK_FIELDS = ("src", "dst", "width", "height", "src_pitch", "dst_pitch")


def strided_blocks(runs: np.ndarray) -> np.ndarray:
    """Group consecutive runs of equal width and constant pitches into 2-D blocks.

    A box in a row-major tensor (a column slice of a row-parallel weight, say) is many equal runs
    at a constant stride on both sides; one 2-D copy (``cudaMemcpy2DAsync``, a strided numpy copy)
    moves it at a fraction of the per-run cost. Pitches are kept >= width so rows never overlap.

    Returns:
        ``(M, 6)`` int64 array with columns :data:`BLOCK_FIELDS`; a single run is a block of
        height 1 with pitches equal to its width.
    """
    blocks: list[list[int]] = []
    rows = runs.tolist()
    i = 0
    while i < len(rows):
        s, d, w = rows[i]
        h, sp, dp = 1, w, w
        if i + 1 < len(rows):
            s1, d1, w1 = rows[i + 1]
            sp1, dp1 = s1 - s, d1 - d
            if w1 == w and sp1 >= w and dp1 >= w:
                h, sp, dp = 2, sp1, dp1
                while i + h < len(rows):
                    sk, dk, wk = rows[i + h]
                    if wk != w or sk != s + h * sp or dk != d + h * dp:
                        break
                    h += 1
        blocks.append([s, d, w, h, sp, dp])
        i += h
    return np.array(blocks, dtype=np.int64).reshape(-1, 6)


def rebase_dst(runs: np.ndarray, table: RegionTable, local_bases: np.ndarray, dst_idx: np.ndarray) -> np.ndarray:
    """Runs with each destination moved from its region's published address to ``local_bases``.

    ``local_bases[i]`` is where this process sees the first byte of ``table.regions[i]`` (a shm
    mapping, an opened CUDA IPC pointer); ``dst_idx`` comes from :meth:`RegionTable.locate`.
    """
    out = runs.copy()
    out[:, 1] = local_bases[dst_idx] + (runs[:, 1] - table.starts[dst_idx])
    return out


class RegionTable:
    """Sorted, non-overlapping regions with vectorized lookup of the region holding each run."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self.regions = tuple(sorted(regions, key=lambda r: r.addr))
        self.starts = np.array([r.addr for r in self.regions], dtype=np.int64)
        self._ends = np.array([r.end for r in self.regions], dtype=np.int64)
        overlap = np.flatnonzero(self.starts[1:] < self._ends[:-1])
        if overlap.size:
            a, b = self.regions[int(overlap[0])], self.regions[int(overlap[0]) + 1]
            raise ValueError(
                f"regions {a.name!r} [{a.addr:#x}, {a.end:#x}) and {b.name!r} [{b.addr:#x}, {b.end:#x}) overlap"
            )

    def __len__(self) -> int:
        return len(self.regions)

    def locate(self, addrs: np.ndarray, nbytes: np.ndarray, *, what: str) -> np.ndarray:
        """Index (into ``self.regions``) of the region holding each ``[addr, addr + nbytes)``.

        Raises:
            ValueError: a run lies outside every region or crosses a region's end; the message
                names the run, the nearest region and ``what`` (e.g. "destination of peer X").
        """
        if not len(self.regions):
            if len(addrs):
                raise ValueError(f"{what}: no memory is registered; register it before writing")
            return np.zeros(0, dtype=np.int64)
        idx = np.searchsorted(self.starts, addrs, side="right") - 1
        safe = np.maximum(idx, 0)
        ok = (idx >= 0) & (addrs + nbytes <= self._ends[safe])
        bad = np.flatnonzero(~ok)
        if bad.size:
            i = int(bad[0])
            a, n = int(addrs[i]), int(nbytes[i])
            r = self.regions[int(safe[i])]
            if idx[i] >= 0 and a < r.end:
                where = f"crosses the end of region {r.name!r} [{r.addr:#x}, {r.end:#x}) by {a + n - r.end} bytes"
            else:
                where = f"lies outside every registered region (nearest: {r.name!r} [{r.addr:#x}, {r.end:#x}))"
            raise ValueError(
                f"{what}: run {i} [{a:#x}, {a + n:#x}) ({n} bytes) {where}; "
                f"{bad.size} of {len(addrs)} runs are out of bounds. Check the plan against the published regions."
            )
        return idx


# ----------------------------------------------------------------------------------------------
# Arenas: one allocation per process side, parameters handed out as aligned views


class Arena:
    """One block of memory from which parameters are carved as aligned tensor views.

    Allocating every parameter of an engine inside one arena means one registration, one
    published region, one IPC handle or shm segment to open, instead of one per parameter.
    """

    def __init__(self, storage: torch.Tensor, *, align: int = DEFAULT_ALIGN) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        if storage.data_ptr() % align:
            raise ValueError(f"arena memory at {storage.data_ptr():#x} is not {align}-byte aligned")
        self._buf = storage
        self.align = align
        self.used = 0

    @property
    def base(self) -> int:
        """Address of the first byte."""
        return self._buf.data_ptr()

    @property
    def nbytes(self) -> int:
        return self._buf.numel()

    @property
    def device(self) -> torch.device:
        return self._buf.device

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new uninitialized tensor of ``shape``/``dtype`` inside the arena, ``align``-aligned.

        Raises:
            ValueError: the arena is full; the message says how many bytes were asked and left.
        """
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * dtype.itemsize
        start = -(-self.used // self.align) * self.align
        if start + nbytes > self.nbytes:
            raise ValueError(
                f"arena of {self.nbytes} bytes is full: {nbytes} bytes asked at offset {start}; "
                f"size the arena with arena_bytes() over all parameters"
            )
        self.used = start + nbytes
        return self._buf[start : start + nbytes].view(dtype).view(tuple(int(s) for s in shape))

    def close(self) -> None:
        """Release what the arena holds beyond its tensors (shm: unlink the segment)."""


class TensorArena(Arena):
    """An arena in one ordinary torch allocation (host or CUDA)."""

    def __init__(self, nbytes: int, *, device: torch.device | str = "cpu", align: int = DEFAULT_ALIGN) -> None:
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes}")
        # Over-allocate so that the arena's first byte is aligned (CPU tensors are 64-aligned).
        raw = torch.empty(nbytes + align, dtype=torch.uint8, device=device)
        skip = -raw.data_ptr() % align
        super().__init__(raw[skip : skip + nbytes], align=align)


def arena_bytes(sizes: Sequence[int], *, align: int = DEFAULT_ALIGN) -> int:
    """Bytes an arena needs to hold tensors of ``sizes`` bytes, in order, each ``align``-aligned."""
    used = 0
    for n in sizes:
        used = -(-used // align) * align + int(n)
    return max(used, 1)


# ----------------------------------------------------------------------------------------------
# Handles and the interface


@dataclass(eq=False, kw_only=True)
class Peer:
    """A connected peer: its descriptor and what this process opened to reach it (local only)."""

    descriptor: PeerDescriptor
    table: RegionTable

    @property
    def session_id(self) -> str:
        return self.descriptor.session_id


@dataclass(eq=False, kw_only=True)
class MappedPeer(Peer):
    """A peer whose regions this process mapped at its own addresses (shm, cuda_ipc; local only)."""

    local_bases: np.ndarray
    """Per region of ``table``: where this process sees the region's first byte."""


@dataclass(eq=False, kw_only=True)
class WriteBatch:
    """A validated, coalesced write to one peer, ready to replay every step (local only).

    ``runs`` are in the backend's address space: destination addresses already translated.
    """

    peer: Peer
    runs: np.ndarray
    """``(N, 3)`` int64 ``[src, dst, nbytes]`` after coalescing and translation."""
    blocks: np.ndarray | None
    """``(M, 6)`` :func:`strided_blocks` of ``runs``, for backends that copy in 2-D."""
    nbytes: int

    @property
    def num_runs(self) -> int:
        return len(self.runs)


@dataclass(eq=False, kw_only=True)
class WriteHandle:
    """An issued write; pass it to :meth:`Transport.wait`. Subclasses carry the backend's token."""

    nbytes: int
    issued_at: float = field(default_factory=time.monotonic)
    done: bool = False


class Transport(abc.ABC):
    """Moves bytes one-sidedly into another process's registered memory.

    Lifecycle (each side owns one transport object; one object may play both roles):

    Receiver (owner of the destination memory, e.g. a rollout engine rank)::

        t = make_transport(kind, **cfg)
        arena = t.new_arena(nbytes, device=...)   # required when dest_needs_arena (shm);
        params = [arena.empty(shape, dtype) ...]  #   recommended for all: one region, one handle
        t.register("params", arena.base, arena.nbytes, device=...)   # once, before publishing
        desc = t.descriptor()                     # JSON via desc.to_json(); send to writers
        ...                                       # writers write; a one-sided receiver does
        t.close()                                 #   nothing (dist: post_recv() per write)

    Sender (writer, e.g. a trainer rank)::

        t = make_transport(kind, **cfg)
        t.register("staging", staging.data_ptr(), staging.nbytes, device=...)  # once
        peer = t.connect(PeerDescriptor.from_json(received))   # once per peer
        batch = t.prepare(peer, runs)     # optional: validate + coalesce once, replay each step
        h = t.write(peer, batch or runs)  # returns as soon as the write is issued (async_writes)
        t.wait(h, deadline_after(60.0))   # source memory must stay unchanged until this returns
        t.close()

    Rules: memory is registered once, never per step; every write's source lies in memory
    registered here and its destination in a region of the peer's descriptor, else
    ``ValueError`` naming the region; ``wait`` raises ``TimeoutError`` at the deadline, after
    which the destination bytes are undefined (the receiver must be treated as dirty) and the
    transport should be closed. ``close()`` is idempotent and releases every registration,
    mapping and segment; use the transport as a context manager or close it in ``finally``.
    Transports are not thread-safe: one thread drives each object.
    """

    kind: ClassVar[str]
    """The :class:`~weightsync.transport.TransportKind` value."""
    one_sided: ClassVar[bool] = True
    """Writes need no action by the receiver (False: dist, where it must post receives)."""
    same_host_only: ClassVar[bool] = False
    """Peers must be on this machine (shm, cuda_ipc)."""
    same_process_only: ClassVar[bool] = False
    """Peers must be in this process (local, mock)."""
    supports_host_memory: ClassVar[bool] = True
    supports_device_memory: ClassVar[bool] = False
    dest_needs_arena: ClassVar[bool] = False
    """Destination memory must come from :meth:`new_arena` of the receiving transport (shm)."""
    async_writes: ClassVar[bool] = True
    """:meth:`write` returns before the bytes have moved, so packing can overlap the wire."""
    uses_blocks: ClassVar[bool] = False
    """The backend copies :func:`strided_blocks` (2-D copies) rather than plain runs."""

    def __init__(self) -> None:
        self._local: list[Region] = []
        self._local_table = RegionTable(())
        self._closed = False

    # -- registration (both sides) ---------------------------------------------------------

    def new_arena(self, nbytes: int, *, device: torch.device | str = "cpu", align: int = DEFAULT_ALIGN) -> Arena:
        """Allocate destination memory that this backend can expose to peers.

        The default is an ordinary torch allocation; shm overrides it with a shared segment.
        The caller registers the arena afterwards and closes it (or lets :meth:`close` do it
        for backends that own their arenas).
        """
        return TensorArena(nbytes, device=device, align=align)

    def register(self, name: str, addr: int, nbytes: int, *, device: int = HOST) -> Region:
        """Register ``[addr, addr + nbytes)`` under ``name``; once per region, before use.

        Args:
            name: unique label of the region on this side.
            addr: start address (``tensor.data_ptr()``).
            nbytes: length in bytes.
            device: CUDA device ordinal of the memory, or :data:`HOST`.

        Returns:
            The region as it will be published.

        Raises:
            ValueError: duplicate name, overlap with a registered region, or memory the backend
                cannot serve (the message says which kind of memory it needs).
        """
        self._check_open()
        if any(r.name == name for r in self._local):
            raise ValueError(f"region {name!r} is already registered; register each region once")
        if device == HOST and not self.supports_host_memory:
            raise ValueError(f"{self.kind} transport moves device memory only; region {name!r} is host memory")
        if device != HOST and not self.supports_device_memory:
            raise ValueError(f"{self.kind} transport moves host memory only; region {name!r} is on cuda:{device}")
        region = self._register(Region(name=name, addr=addr, nbytes=nbytes, device=device))
        table = RegionTable([*self._local, region])  # raises on overlap before any state changes
        self._local.append(region)
        self._local_table = table
        return region

    def register_tensor(self, name: str, tensor: torch.Tensor) -> Region:
        """:meth:`register` the storage bytes of a contiguous tensor."""
        if not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} must be contiguous to be registered")
        device = tensor.get_device() if tensor.is_cuda else HOST
        return self.register(name, tensor.data_ptr(), tensor.numel() * tensor.element_size(), device=device)

    @abc.abstractmethod
    def _register(self, region: Region) -> Region:
        """Backend part of :meth:`register`: pin/export the memory; return the published region."""

    @property
    def regions(self) -> tuple[Region, ...]:
        """Regions registered on this side."""
        return tuple(self._local)

    # -- publishing and connecting ---------------------------------------------------------

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """How peers reach this process (published in the descriptor)."""

    def descriptor(self) -> PeerDescriptor:
        """What this side publishes: session id plus every registered region."""
        self._check_open()
        return PeerDescriptor(
            kind=self.kind, session_id=self.session_id, host_id=host_id(), pid=os.getpid(), regions=tuple(self._local)
        )

    def connect(self, descriptor: PeerDescriptor) -> Peer:
        """Open what is needed to write into the peer's regions; once per peer.

        Raises:
            ValueError: the descriptor comes from another transport kind, or from a peer this
                backend cannot reach (another host for shm/cuda_ipc, another process for local).
        """
        self._check_open()
        if descriptor.kind != self.kind:
            raise ValueError(
                f"peer {descriptor.session_id!r} published a {descriptor.kind!r} descriptor; this is a "
                f"{self.kind!r} transport: both sides must use the same transport kind"
            )
        if self.same_host_only and descriptor.host_id != host_id():
            raise ValueError(
                f"{self.kind} needs the peer on this host; peer {descriptor.session_id!r} is on "
                f"{descriptor.host_id!r}, this is {host_id()!r}: use mooncake between hosts"
            )
        if self.same_process_only and descriptor.pid != os.getpid():
            raise ValueError(
                f"{self.kind} needs the peer in this process; peer {descriptor.session_id!r} is pid "
                f"{descriptor.pid}, this is pid {os.getpid()}: use shm or cuda_ipc between processes"
            )
        return self._connect(descriptor)

    def _connect(self, descriptor: PeerDescriptor) -> Peer:
        """Backend part of :meth:`connect` (checks above already passed).

        The default opens nothing: backends that address the peer's published pointers directly
        (mooncake, dist, local) only need its region table; mapping backends override it.
        """
        return Peer(descriptor=descriptor, table=RegionTable(descriptor.regions))

    # -- writing ---------------------------------------------------------------------------

    def prepare(self, peer: Peer, runs: Sequence[Run] | np.ndarray) -> WriteBatch:
        """Validate, coalesce and translate ``runs`` once; the batch can be written every step.

        Raises:
            ValueError: a source run outside this side's registered regions, or a destination
                run outside the peer's regions (the message names the region).
        """
        self._check_open()
        arr = as_runs(runs)
        src_idx = self._local_table.locate(arr[:, 0], arr[:, 2], what=f"{self.kind} write source (this process)")
        dst_idx = peer.table.locate(
            arr[:, 1], arr[:, 2], what=f"{self.kind} write destination on peer {peer.session_id!r}"
        )
        arr = self._translate(peer, arr, dst_idx)
        arr = coalesce_runs(arr, keys=src_idx * max(len(peer.table), 1) + dst_idx)
        blocks = strided_blocks(arr) if self.uses_blocks else None
        return WriteBatch(peer=peer, runs=arr, blocks=blocks, nbytes=int(arr[:, 2].sum()))

    def _translate(self, peer: Peer, runs: np.ndarray, dst_idx: np.ndarray) -> np.ndarray:
        """Map destination addresses into this process's view: rebased for a :class:`MappedPeer`,
        unchanged for backends that address the receiver's pointers directly."""
        if isinstance(peer, MappedPeer):
            return rebase_dst(runs, peer.table, peer.local_bases, dst_idx)
        return runs

    def write(self, peer: Peer, runs: Sequence[Run] | np.ndarray | WriteBatch) -> WriteHandle:
        """Issue a write of ``runs`` (or a prepared batch) into ``peer``; see the class lifecycle.

        Returns:
            A handle for :meth:`wait`. With ``async_writes`` the bytes may still be moving.

        Raises:
            ValueError: as :meth:`prepare`, or a batch prepared for another peer.
        """
        batch = runs if isinstance(runs, WriteBatch) else self.prepare(peer, runs)
        if batch.peer is not peer:
            raise ValueError(f"write batch was prepared for peer {batch.peer.session_id!r}, not {peer.session_id!r}")
        self._check_open()
        return self._submit(batch)

    @abc.abstractmethod
    def _submit(self, batch: WriteBatch) -> WriteHandle:
        """Backend part of :meth:`write`."""

    def wait(self, handle: WriteHandle, deadline: float) -> None:
        """Block until the write completed.

        Args:
            handle: from :meth:`write`.
            deadline: absolute ``time.monotonic()`` time (see :func:`deadline_after`).

        Raises:
            TimeoutError: not complete by the deadline; destination bytes are then undefined.
            RuntimeError: the backend reported a failed transfer.
        """
        if handle.done:
            return
        self._wait(handle, deadline)
        handle.done = True

    @abc.abstractmethod
    def _wait(self, handle: WriteHandle, deadline: float) -> None:
        """Backend part of :meth:`wait`."""

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Release registrations, mappings and owned segments; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close()

    @abc.abstractmethod
    def _close(self) -> None:
        """Backend part of :meth:`close`; runs once."""

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.kind} transport is closed")

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def timeout_message(kind: str, handle: WriteHandle, deadline: float) -> str:
    """The common text of a deadline expiry."""
    waited = time.monotonic() - handle.issued_at
    return (
        f"{kind} write of {handle.nbytes} bytes not complete at its deadline "
        f"({waited:.3f} s after issue, deadline passed {time.monotonic() - deadline:.3f} s ago); "
        f"the destination is now undefined: mark the receiver dirty and close this transport"
    )
