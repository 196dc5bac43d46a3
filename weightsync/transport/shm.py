"""Same-host CPU transport: the receiver's parameters live in named shared memory.

The receiver allocates its CPU parameter storage inside a :class:`SharedArena` (a file in
``/dev/shm`` mapped ``MAP_SHARED``) and publishes the segment name; a writer on the same host
maps the segment once and writes with memcpy on a worker thread (see ``_host.py`` for the
measured copy rates). This is the CPU analogue of ``cuda_ipc``: on the 2-core machines Mooncake
``tcp`` moved 0.34 GB/s on loopback against about 15 GB/s for memcpy, so same-host CPU traffic
never goes through sockets.

Segments are named ``<prefix>-<owner pid>-n<pid namespace>-<random>``. The owner unlinks its
segments on :meth:`ShmTransport.close` (and at garbage collection or interpreter exit if never
closed); :func:`remove_stale_segments` removes those of owners that died without cleaning up
(SIGKILL), and only those of this pid namespace (a pid of another namespace sharing ``/dev/shm``
says nothing about its owner here); :func:`remove_segments` those of given owners (an engine's
dead ranks).

Who can write: a segment is mode 0600, so processes of other users cannot open it; any process of
the owner's user that knows its name can map it and write. The engine therefore serves from
memory of its own and treats its segment as an inbox that only an update session copies in
(:mod:`weightsync.sync.p2p_receiver`).

Typical usage (receiver)::

    with ShmTransport() as t:
        arena = t.new_arena(arena_bytes(sizes))
        params = {n: arena.empty(shape, dtype) for n, (shape, dtype) in specs.items()}
        t.register("params", arena.base, arena.nbytes)
        publish(t.descriptor().to_json())
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from weightsync.transport._host import HostCopier, wait_futures
from weightsync.transport.arena import DEFAULT_ALIGN, Arena
from weightsync.transport.base import Transport
from weightsync.transport.handles import MappedPeer, WriteBatch, WriteHandle, timeout_message
from weightsync.transport.records import PeerDescriptor, Region
from weightsync.transport.region_table import RegionTable

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
DEFAULT_PREFIX = "weightsync"


def shm_available() -> bool:
    """True when ``/dev/shm`` exists and is writable (Linux)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def _map(path: Path, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``path`` mapped MAP_SHARED; the mapping lives as long as the tensor."""
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def _populate(mapping: torch.Tensor) -> bool:
    """Pre-fault a fresh mapping's page tables (once, at connect) so that the first write runs at
    copy speed: measured on the 2-core machine, a first 256 MiB write into an unpopulated mapping
    moved 1.2 GB/s, into a populated one 4.8 GB/s (populating took 0.13 s). False where the
    kernel lacks MADV_POPULATE_WRITE (the first write then pays the faults)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(mapping.data_ptr(), mapping.numel(), MADV_POPULATE_WRITE) == 0


def _unlink_quietly(path: Path) -> None:
    # Runs from close() and from the weakref finalizer, possibly after the other already ran.
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class SharedArena(Arena):
    """An arena in a new ``/dev/shm`` segment, for memory that writers on this host fill.

    Parameters carved with :meth:`empty` stay valid after :meth:`close`: closing unlinks the
    segment name (so nothing leaks in ``/dev/shm``), while the mapping lasts as long as any tensor
    view of it. Writers must have mapped the segment before the owner closes it.
    """

    def __init__(self, nbytes: int, *, prefix: str = DEFAULT_PREFIX, align: int = DEFAULT_ALIGN) -> None:
        if nbytes <= 0:
            raise ValueError(f"shared arena size must be positive, got {nbytes}")
        self.segment = f"{prefix}-{os.getpid()}-n{_pid_namespace()}-{secrets.token_hex(6)}"
        self.path = SHM_DIR / self.segment
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)
        try:
            super().__init__(_map(self.path, nbytes), align=align)
        except BaseException:
            self._finalizer()
            raise

    def close(self) -> None:
        """Unlink the segment; idempotent. Existing tensor views stay usable."""
        self._finalizer()


def list_segments(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of the shm segments with ``prefix`` that exist now (for leak checks)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.glob(f"{prefix}-*"))


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where ``/proc`` does not say)."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return 0
    return int(link[link.index("[") + 1 : -1])


def segment_owner(name: str, prefix: str = DEFAULT_PREFIX) -> tuple[int, int | None] | None:
    """``(owner pid, pid namespace or None for a name without one)`` of segment ``name``, or None
    when the name is not one of this prefix's."""
    if not name.startswith(prefix + "-"):
        return None
    fields = name[len(prefix) + 1 :].split("-")
    try:
        pid = int(fields[0])
        ns = int(fields[1][1:]) if len(fields) > 2 and fields[1].startswith("n") else None
    except ValueError:
        return None
    return pid, ns


def _local_segments(prefix: str) -> list[tuple[str, int]]:
    """``(name, owner pid)`` of the segments of this pid namespace (and of names of the older
    form without one, whose namespace is unknown)."""
    mine = _pid_namespace()
    owners = [(name, segment_owner(name, prefix)) for name in list_segments(prefix)]
    return [(name, owner[0]) for name, owner in owners if owner is not None and owner[1] in (None, mine)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True


def remove_segments(pids: set[int], prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Unlink the segments of this pid namespace owned by ``pids`` (processes that are gone:
    an engine's dead ranks). Deletes files in ``/dev/shm``.

    Returns:
        The names removed.
    """
    removed = [name for name, pid in _local_segments(prefix) if pid in pids]
    for name in removed:
        _unlink_quietly(SHM_DIR / name)
    return removed


def remove_stale_segments(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Unlink segments whose owner process (the pid in the name) no longer exists.

    Deletes files in ``/dev/shm``; only segments of this pid namespace are considered (and names
    of the older form without one: call this where every owner runs in this namespace, one
    launcher per host).

    Returns:
        The names removed.
    """
    return remove_segments({pid for _, pid in _local_segments(prefix) if not _alive(pid)}, prefix)


@dataclass(eq=False, kw_only=True)
class ShmPeer(MappedPeer):
    """A peer whose segments this process has mapped (local only)."""

    mappings: dict[str, torch.Tensor]
    """Segment name -> uint8 tensor over this process's mapping of it (keeps it mapped)."""


@dataclass(eq=False, kw_only=True)
class ShmHandle(WriteHandle):
    futures: list[Future[None]]


class ShmTransport(Transport):
    """Same-host CPU writes into a receiver's :class:`SharedArena` (see module docstring)."""

    kind: ClassVar[str] = "shm"
    same_host_only: ClassVar[bool] = True
    dest_needs_arena: ClassVar[bool] = True
    uses_blocks: ClassVar[bool] = True
    dest_needs_staging: ClassVar[bool] = True

    @classmethod
    def config_options(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return {"num_threads": cfg["shm_threads"]}

    @classmethod
    def remove_leftovers(cls, pids: set[int] | None = None) -> list[str]:
        """:func:`remove_stale_segments` (``pids`` None) or :func:`remove_segments` of ``pids``."""
        return remove_stale_segments() if pids is None else remove_segments(pids)

    def __init__(self, *, num_threads: int = 1, prefix: str = DEFAULT_PREFIX) -> None:
        """Args:
        num_threads: copy threads per writer (1 is fastest on the 2-core machines; more pay
            off where one core cannot saturate memory bandwidth).
        prefix: segment name prefix in ``/dev/shm``.
        """
        super().__init__()
        if not shm_available():
            raise RuntimeError(f"shm transport needs a writable {SHM_DIR}")
        self.prefix = prefix
        self._arenas: list[SharedArena] = []
        self._copier = HostCopier(num_threads, name="weightsync-shm")
        self._peers: list[ShmPeer] = []

    @property
    def session_id(self) -> str:
        return f"shm:{os.getpid()}:{id(self):x}"

    def new_arena(self, nbytes: int, *, device: torch.device | str = "cpu", align: int = DEFAULT_ALIGN) -> SharedArena:
        """A :class:`SharedArena` owned by this transport (unlinked on :meth:`close`)."""
        self._check_open()
        if torch.device(device).type != "cpu":
            raise ValueError(f"shm arenas hold host memory; got device {device!r}: use cuda_ipc for GPU memory")
        arena = SharedArena(nbytes, prefix=self.prefix, align=align)
        self._arenas.append(arena)
        return arena

    def _register(self, region: Region) -> Region:
        for arena in self._arenas:
            if arena.base <= region.addr and region.end <= arena.base + arena.nbytes:
                return replace(region, handle=arena.segment, handle_offset=region.addr - arena.base)
        return region  # source-only memory: writable by this side, not published to peers

    def descriptor(self) -> PeerDescriptor:
        """Publishes only regions inside this transport's shared arenas (peers can map those)."""
        desc = super().descriptor()
        return replace(desc, regions=tuple(r for r in desc.regions if r.handle))

    def _connect(self, descriptor: PeerDescriptor) -> ShmPeer:
        mappings: dict[str, torch.Tensor] = {}
        for r in descriptor.regions:
            if not r.handle:
                raise ValueError(f"region {r.name!r} of peer {descriptor.session_id!r} names no shm segment")
            if r.handle not in mappings:
                path = SHM_DIR / r.handle
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    raise ValueError(
                        f"shm segment {r.handle!r} of peer {descriptor.session_id!r} does not exist: the owner "
                        f"closed it, or the two processes do not share {SHM_DIR} (another container?)"
                    ) from None
                mappings[r.handle] = _map(path, size)
                if not _populate(mappings[r.handle]):
                    log.debug("madvise(MADV_POPULATE_WRITE) unsupported: first write to %s pays page faults", r.handle)
            if r.handle_offset + r.nbytes > mappings[r.handle].numel():
                raise ValueError(f"region {r.name!r} of peer {descriptor.session_id!r} runs past its segment's end")
        table = RegionTable(descriptor.regions)
        bases = np.array([mappings[r.handle].data_ptr() + r.handle_offset for r in table.regions], dtype=np.int64)
        peer = ShmPeer(descriptor=descriptor, table=table, mappings=mappings, local_bases=bases)
        self._peers.append(peer)
        return peer

    def _submit(self, batch: WriteBatch) -> ShmHandle:
        assert batch.blocks is not None
        return ShmHandle(nbytes=batch.nbytes, futures=self._copier.submit(batch.blocks))

    def _wait(self, handle: WriteHandle, deadline: float) -> None:
        assert isinstance(handle, ShmHandle)
        if not wait_futures(handle.futures, deadline):
            raise TimeoutError(timeout_message(self.kind, handle, deadline))

    def _close(self) -> None:
        try:
            self._copier.shutdown()
        finally:
            for arena in self._arenas:
                arena.close()
            self._arenas.clear()
            self._peers.clear()
