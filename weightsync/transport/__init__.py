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
