"""Byte movers behind one interface (:class:`~weightsync.transport.base.Transport`), and the
written policy that picks one per (sender, receiver) pair.

Modules by job: :mod:`~weightsync.transport.base` (the interface and its life cycle),
:mod:`~weightsync.transport.records` (regions and descriptors, the JSON that crosses processes),
:mod:`~weightsync.transport.runs` (run arithmetic), :mod:`~weightsync.transport.region_table`
(which region holds a run), :mod:`~weightsync.transport.arena` (destination memory),
:mod:`~weightsync.transport.handles` (peers, write batches, issued writes); one module per backend.

This is the only module that knows every backend. Backends are imported when first asked for,
so importing the package needs neither Mooncake nor CUDA.

Selection policy (:func:`choose_transport`), cheapest path first:

* same device, same process (colocated) -> ``local``: a plain copy;
* same host -> ``cuda_ipc`` on GPUs (NVLink/PCIe, or HBM-local for two processes on one GPU),
  ``shm`` on CPUs (memcpy into the receiver's shared arena; never TCP on one host);
* other host -> ``mooncake`` (RDMA where there is a NIC, TCP otherwise).

``dist`` (two-sided torch.distributed) and ``mock`` are never chosen: they are asked for by name.
"""

from __future__ import annotations

import importlib
from enum import StrEnum
from typing import Any, Protocol

from weightsync.transport.arena import Arena, arena_bytes
from weightsync.transport.base import Transport
from weightsync.transport.handles import Peer, WriteBatch, WriteHandle, deadline_after
from weightsync.transport.records import HOST, PeerDescriptor, Region, Run

__all__ = [
    "HOST",
    "Arena",
    "DeviceLike",
    "Peer",
    "PeerDescriptor",
    "Region",
    "Run",
    "Transport",
    "TransportKind",
    "WriteBatch",
    "WriteHandle",
    "arena_bytes",
    "available_transports",
    "choose_transport",
    "deadline_after",
    "make_transport",
    "transport_class",
]


class TransportKind(StrEnum):
    """Transport backends, by the name used in descriptors, configs and CLI flags."""

    LOCAL = "local"
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"
    MOONCAKE = "mooncake"
    DIST = "dist"
    MOCK = "mock"


# kind -> (module, class, availability probe)
_BACKENDS: dict[TransportKind, tuple[str, str, str | None]] = {
    TransportKind.LOCAL: ("weightsync.transport.local", "LocalTransport", None),
    TransportKind.SHM: ("weightsync.transport.shm", "ShmTransport", "shm_available"),
    TransportKind.CUDA_IPC: ("weightsync.transport.cuda_ipc", "CudaIpcTransport", "cuda_ipc_available"),
    TransportKind.MOONCAKE: ("weightsync.transport.mooncake", "MooncakeTransport", "mooncake_available"),
    TransportKind.DIST: ("weightsync.transport.dist", "DistTransport", "dist_available"),
    TransportKind.MOCK: ("weightsync.transport.mock", "MockTransport", None),
}


def _kind(kind: TransportKind | str) -> TransportKind:
    try:
        return TransportKind(kind)
    except ValueError:
        raise ValueError(f"unknown transport {kind!r}; choose one of {[k.value for k in TransportKind]}") from None


def transport_class(kind: TransportKind | str) -> type[Transport]:
    """The backend class of ``kind`` (imports its module)."""
    module, name, _ = _BACKENDS[_kind(kind)]
    cls: type[Transport] = getattr(importlib.import_module(module), name)
    return cls


def make_transport(kind: TransportKind | str, **cfg: Any) -> Transport:
    """Construct the backend ``kind`` with its keyword configuration.

    Args:
        kind: a :class:`TransportKind` or its value.
        **cfg: the backend's constructor arguments, e.g. ``device=0`` (cuda_ipc, local),
            ``protocol="rdma", device="mlx5_0", hostname=ip`` (mooncake), ``group=pg`` (dist),
            ``num_threads=2`` (shm).

    Raises:
        ValueError: unknown kind.
        RuntimeError: the backend is not available on this machine (the message says what is missing).
    """
    return transport_class(kind)(**cfg)


def available_transports() -> list[TransportKind]:
    """Kinds whose backend can run here (library installed, device present)."""
    out = []
    for kind, (module, _, probe) in _BACKENDS.items():
        if probe is None or getattr(importlib.import_module(module), probe)():
            out.append(kind)
    return out


class DeviceLike(Protocol):
    """Where a rank runs (``weightsync.models.parallel.Device`` fits): node and GPU/CPU-slot index."""

    node: int
    gpu: int


def choose_transport(
    src_device: DeviceLike, dst_device: DeviceLike, on_gpu: bool, *, same_process: bool = True
) -> TransportKind:
    """The transport for writes from ``src_device`` into ``dst_device`` (module docstring policy).

    Args:
        src_device: where the sending rank runs.
        dst_device: where the receiving rank runs.
        on_gpu: the memory on both sides is GPU memory (else host memory).
        same_process: for ``src_device == dst_device``, whether sender and receiver share a
            process (colocated in one process). Two processes on one device use the same-host
            path (``cuda_ipc`` then copies within the GPU's HBM).
    """
    if src_device.node != dst_device.node:
        return TransportKind.MOONCAKE
    if src_device.gpu == dst_device.gpu and same_process:
        return TransportKind.LOCAL
    return TransportKind.CUDA_IPC if on_gpu else TransportKind.SHM
