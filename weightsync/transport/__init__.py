"""Byte movers behind one interface (:class:`~weightsync.transport.base.Transport`), the written
policy that picks one per (sender, receiver) pair, and the one configuration record of a run.

Modules by job: :mod:`~weightsync.transport.base` (the interface and its life cycle),
:mod:`~weightsync.transport.records` (regions and descriptors, the JSON that crosses processes),
:mod:`~weightsync.transport.runs` (run arithmetic), :mod:`~weightsync.transport.region_table`
(which region holds a run), :mod:`~weightsync.transport.arena` (destination memory),
:mod:`~weightsync.transport.handles` (peers, write batches, issued writes),
:mod:`~weightsync.transport.registry` (the only module that knows every backend; the factory),
:mod:`~weightsync.transport.policy` (the selection policy, :func:`choose_transport`),
:mod:`~weightsync.transport.config` (:class:`TransportConfig`: ``auto`` resolved once, backend
options in one place); one module per backend.

Backends are imported when first asked for, so importing the package needs neither Mooncake nor
CUDA.

Typical usage::

    cfg = TransportConfig.resolve("auto", pairs, on_gpu=False)   # once, where the placement is known
    with cfg.make() as t:                                         # in each process (shm here)
        ...
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "AUTO": "policy",
    "HOST": "records",
    "Arena": "arena",
    "DeviceLike": "policy",
    "Peer": "handles",
    "PeerDescriptor": "records",
    "Region": "records",
    "Run": "records",
    "Transport": "base",
    "TransportConfig": "config",
    "TransportKind": "registry",
    "WriteBatch": "handles",
    "WriteHandle": "handles",
    "arena_bytes": "arena",
    "available_transports": "registry",
    "check_receiver": "registry",
    "choose_transport": "policy",
    "deadline_after": "handles",
    "make_transport": "registry",
    "receiver_kinds": "registry",
    "resolve_kind": "policy",
    "run_choices": "policy",
    "transport_class": "registry",
}
"""Public name -> the module defining it, imported on first use (PEP 562): the registry, the policy
and the configuration record import no torch, so a command line that needs only them (the
``--transport`` choices, ``TransportConfig``) stays light; the first name that needs torch loads it."""

if TYPE_CHECKING:
    from weightsync.transport.arena import Arena, arena_bytes
    from weightsync.transport.base import Transport
    from weightsync.transport.config import TransportConfig
    from weightsync.transport.handles import Peer, WriteBatch, WriteHandle, deadline_after
    from weightsync.transport.policy import AUTO, DeviceLike, choose_transport, resolve_kind, run_choices
    from weightsync.transport.records import HOST, PeerDescriptor, Region, Run
    from weightsync.transport.registry import (
        TransportKind,
        available_transports,
        check_receiver,
        make_transport,
        receiver_kinds,
        transport_class,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "AUTO",
    "HOST",
    "Arena",
    "DeviceLike",
    "Peer",
    "PeerDescriptor",
    "Region",
    "Run",
    "Transport",
    "TransportConfig",
    "TransportKind",
    "WriteBatch",
    "WriteHandle",
    "arena_bytes",
    "available_transports",
    "check_receiver",
    "choose_transport",
    "deadline_after",
    "make_transport",
    "receiver_kinds",
    "resolve_kind",
    "run_choices",
    "transport_class",
]
