"""The transport interface: one-sided byte writes into another process's registered memory.

A transport moves bytes, nothing else: it knows no model, no parameter names beyond the labels
of the regions it is given, and no plan. Everything above it (sender, receiver) speaks in
*runs*: ``(src_addr, dst_addr, nbytes)`` triples, where ``src_addr`` is an address in the
writer's own registered memory and ``dst_addr`` is an address **in the receiver's address space**
(exactly the pointers the receiver publishes, e.g. through sglang's
``/get_remote_instance_transfer_engine_info``). Each backend translates ``dst_addr`` into what it
needs (a shared-memory mapping, an opened CUDA IPC pointer, a Mooncake segment offset).

The interface's parts live next to it by job: :mod:`~weightsync.transport.records` (what crosses
process boundaries), :mod:`~weightsync.transport.runs` (run arithmetic),
:mod:`~weightsync.transport.region_table` (region lookup), :mod:`~weightsync.transport.arena`
(destination memory), :mod:`~weightsync.transport.handles` (peers, batches, issued writes).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from weightsync.transport.arena import DEFAULT_ALIGN, Arena, TensorArena
from weightsync.transport.handles import MappedPeer, Peer, WriteBatch, WriteHandle
from weightsync.transport.records import HOST, PeerDescriptor, Region, Run, host_id
from weightsync.transport.region_table import RegionTable
from weightsync.transport.runs import as_runs, coalesce_runs, rebase_dst, strided_blocks


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

    Capabilities: what a backend can do is written as class attributes (below), and everything
    outside this package asks them, never the kind's name, so that a backend is added here and in
    one line of :mod:`~weightsync.transport.registry`. The receiver of an engine
    (``weightsync.sync.p2p_receiver``) registers through any one-sided backend that reaches other
    processes (:func:`~weightsync.transport.registry.receiver_kinds`), refuses one that cannot
    serve its memory (``supports_host_memory`` / ``supports_device_memory``), binds its CUDA
    device, and registers its served parameters in place unless ``dest_needs_staging`` (then it
    registers an inbox that it copies in when an update session ends). An engine binds its own
    address for a backend that ``opens_ports``, says ``sglang_native`` through sglang's fields,
    and asks every backend to :meth:`remove_leftovers` of its dead ranks; a sender writes to an
    engine that publishes only sglang's table with the ``sglang_native`` backend.
    :meth:`config_options` builds the constructor arguments from a
    :class:`~weightsync.transport.config.TransportConfig`.

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
    """Peers must be in this process (local)."""
    supports_host_memory: ClassVar[bool] = True
    supports_device_memory: ClassVar[bool] = False
    dest_needs_arena: ClassVar[bool] = False
    """Destination memory must come from :meth:`new_arena` of the receiving transport (shm)."""
    async_writes: ClassVar[bool] = True
    """:meth:`write` returns before the bytes have moved, so packing can overlap the wire."""
    uses_blocks: ClassVar[bool] = False
    """The backend copies :func:`strided_blocks` (2-D copies) rather than plain runs."""
    launches_on_device: ClassVar[bool] = False
    """:meth:`launch` takes device work that writes the peer in place of a copy (CUDA IPC: the
    caller's kernel runs on the transport's copy stream, e.g. a copy that also fingerprints)."""
    dest_needs_staging: ClassVar[bool] = False
    """Registered memory can be written by more than the peers given the descriptor (shm: any
    process of the user that learns the segment's name from ``/dev/shm``), so a receiver registers
    an inbox, not the memory it serves, and copies the inbox in when an update session ends."""
    opens_ports: ClassVar[bool] = False
    """The backend listens on network ports that peers connect to (mooncake: its RPC and data
    ports, confined to the interface holding the process's address and guarded by no token); each
    process passes the address peers reach it at (``TransportConfig.on_host``)."""
    sglang_native: ClassVar[bool] = False
    """The backend is sglang's own transfer engine (Mooncake): a peer that publishes only sglang's
    ``[session_id, weights_info]`` is written with it, and an engine registered with it serves
    sglang's remote-instance weight loader (one backend says so)."""

    @classmethod
    def serves(cls, device_type: str) -> bool:
        """Whether the backend moves memory of ``device_type`` (``cpu``: host memory, else device memory)."""
        return cls.supports_host_memory if device_type == "cpu" else cls.supports_device_memory

    @classmethod
    def device_memory_hint(cls) -> str:
        """What to install for device memory where the backend could serve it (appended to the refusal)."""
        return ""

    @classmethod
    def remove_leftovers(cls, pids: set[int] | None = None) -> list[str]:
        """Remove what registrations of processes that are gone left on this host (shm: segments in
        ``/dev/shm``, which outlive a process killed before it closed its transport).

        Args:
            pids: the owners to clean up after (an engine's dead ranks), or None: every owner that
                no longer exists.

        Returns:
            Names of what was removed (the default, for backends whose resources die with their
            process: nothing).
        """
        return []

    @classmethod
    def config_options(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor arguments of this backend, taken from the fields of a
        :class:`~weightsync.transport.config.TransportConfig` (``cfg``: field name -> value; what
        :meth:`TransportConfig.make <weightsync.transport.config.TransportConfig.make>` passes).

        Raises:
            ValueError: the backend cannot be built from a record (the default: dist, whose
                process group cannot be written down) or ``cfg`` lacks what it needs.
        """
        raise ValueError(
            f"a {cls.kind} transport cannot be made from a TransportConfig; "
            f"construct it with make_transport({cls.kind!r}, ...)"
        )

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
        if device == HOST and not self.serves("cpu"):
            raise ValueError(f"{self.kind} transport moves device memory only; region {name!r} is host memory")
        if device != HOST and not self.serves("cuda"):
            raise ValueError(f"{self.kind} transport moves host memory only here; region {name!r} is on "
                             f"cuda:{device}{self.device_memory_hint()}")
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
        arr, src_idx, dst_idx = self._located(peer, runs)
        arr = coalesce_runs(arr, keys=src_idx * max(len(peer.table), 1) + dst_idx)
        blocks = strided_blocks(arr) if self.uses_blocks else None
        return WriteBatch(peer=peer, runs=arr, blocks=blocks, nbytes=int(arr[:, 2].sum()))

    def _located(self, peer: Peer, runs: Sequence[Run] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``runs`` validated and translated (not coalesced), with each run's source and
        destination region index."""
        self._check_open()
        arr = as_runs(runs)
        src_idx = self._local_table.locate(arr[:, 0], arr[:, 2], what=f"{self.kind} write source (this process)")
        dst_idx = peer.table.locate(
            arr[:, 1], arr[:, 2], what=f"{self.kind} write destination on peer {peer.session_id!r}"
        )
        return self._translate(peer, arr, dst_idx), src_idx, dst_idx

    def translate(self, peer: Peer, runs: Sequence[Run] | np.ndarray) -> np.ndarray:
        """``runs`` as :meth:`prepare` checks and translates them -- destination addresses in this
        process's view -- one row per run, in order (nothing coalesced): for device work given to
        :meth:`launch`.

        Raises:
            ValueError: as :meth:`prepare`.
        """
        return self._located(peer, runs)[0]

    def launch(self, peer: Peer, work: Callable[[], None], nbytes: int) -> WriteHandle:
        """Issue ``work`` -- device work that writes ``nbytes`` into ``peer`` at addresses from
        :meth:`translate` -- where this transport issues its copies, ordered after the work already
        queued on torch's current stream; a handle for :meth:`wait` (``launches_on_device`` only).

        Raises:
            ValueError: this transport takes no device work.
        """
        if not self.launches_on_device:
            raise ValueError(f"the {self.kind} transport takes no device work; write runs instead")
        self._check_open()
        return self._launch(peer, work, nbytes)

    def _launch(self, peer: Peer, work: Callable[[], None], nbytes: int) -> WriteHandle:
        raise NotImplementedError

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
