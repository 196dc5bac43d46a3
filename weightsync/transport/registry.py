"""The backends by kind: the only module that knows every one of them, and the factory.

Backends are imported when first asked for (:func:`transport_class`), so importing the package
needs neither Mooncake nor CUDA. A new backend is one entry in ``_BACKENDS``.
"""

from __future__ import annotations

import importlib
from enum import StrEnum
from typing import Any

from weightsync.transport.base import Transport


class TransportKind(StrEnum):
    """Transport backends, by the name used in descriptors, configs and CLI flags."""

    LOCAL = "local"
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"
    MOONCAKE = "mooncake"
    DIST = "dist"


# kind -> (module, class, availability probe)
_BACKENDS: dict[TransportKind, tuple[str, str, str | None]] = {
    TransportKind.LOCAL: ("weightsync.transport.local", "LocalTransport", None),
    TransportKind.SHM: ("weightsync.transport.shm", "ShmTransport", "shm_available"),
    TransportKind.CUDA_IPC: ("weightsync.transport.cuda_ipc", "CudaIpcTransport", "cuda_ipc_available"),
    TransportKind.MOONCAKE: ("weightsync.transport.mooncake", "MooncakeTransport", "mooncake_available"),
    TransportKind.DIST: ("weightsync.transport.dist", "DistTransport", "dist_available"),
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
