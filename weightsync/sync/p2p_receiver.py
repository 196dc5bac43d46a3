"""The receiving end of p2p transfers on one engine rank: transport, arena, one registration.

With a transport (any one-sided backend that reaches other processes and moves the rank's memory:
:func:`~weightsync.transport.registry.check_receiver`), a block of the rank's parameter layout is
carved from that transport's arena and registered once, as region ``"params"``, before anything
is published; senders connect with the published descriptor and write straight into it. The
receiver does nothing per write (the transports are one-sided). It asks the backend what it can
do (its capability attributes, ``TransportConfig.backend``) and never compares kind names.
Without a transport (None) the parameters are a plain allocation and only the broadcast path
(two-sided, :mod:`weightsync.sync.broadcast_receiver`) can update them.

**Staged transports** (``Transport.dest_needs_staging``: shm): the registered block is an *inbox*
(:attr:`Receiver.inbox`), not the served parameters. A shm segment can be mapped and written by
any process of the engine's user that learns its name (``/dev/shm`` lists it), at any time; so the
engine serves from memory of its own, copies the served parameters into the inbox when an update
session begins (:meth:`Receiver.refresh`: writes made before the session are wiped) and the
inbox into the parameters when the session ends (:meth:`Receiver.commit`). A write outside a
session therefore never reaches the served weights; a write during a session is the session's
(its verification sees it). The price: twice the parameter memory (host memory, CPU engines only)
and two block copies per update. The others (cuda_ipc, mooncake) write in place as sglang does
(doubling device memory is not affordable): whoever holds their handles (published only through
the token-guarded info endpoint, respectively the Mooncake RPC port, confined to the advertised
interface) can write the served parameters directly.

Typical usage::

    receiver, store = Receiver.open(TransportConfig(kind="shm"), layout, device=torch.device("cpu"), rank=0)
    receiver.descriptor()        # JSON-safe dict for /get_remote_instance_transfer_engine_info
    receiver.refresh(store)      # begin_weight_update: the inbox starts as the served weights
    ...                          # senders write into receiver.inbox
    receiver.commit(store)       # end_weight_update: the inbox becomes the served weights
    store.close(); receiver.close()
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from weightsync.layout.box import LocalTensor
from weightsync.sync.params import ParamStore
from weightsync.transport import HOST, TransportConfig
from weightsync.transport.config import NONE
from weightsync.transport.registry import check_receiver

PARAMS_REGION = "params"


class Receiver:
    """The transport side of one engine rank (see the module docstring)."""

    def __init__(self, kind: str, transport: Any, arena: Any, rank: int, inbox: ParamStore | None = None) -> None:
        self.kind = kind
        self._transport = transport
        self._arena = arena
        self.inbox = inbox
        """The registered store p2p writes land in when staged (None: they land in the served store)."""
        self._session = (
            transport.session_id if transport is not None else f"none://{socket.gethostname()}/{os.getpid()}/rank{rank}"
        )

    @property
    def staged(self) -> bool:
        return self.inbox is not None

    def write_target(self, store: ParamStore) -> ParamStore:
        """Where writes of an update session go: the inbox when staged, else ``store`` itself."""
        return self.inbox if self.inbox is not None else store

    def refresh(self, store: ParamStore) -> int:
        """Staged: the inbox becomes a copy of the served ``store`` (a session begins); bytes copied."""
        return self.inbox.copy_from(store) if self.inbox is not None else 0

    def commit(self, store: ParamStore) -> int:
        """Staged: the served ``store`` becomes a copy of the inbox (a session ends); bytes copied."""
        return store.copy_from(self.inbox) if self.inbox is not None else 0

    @classmethod
    def open(
        cls,
        transport: TransportConfig | None,
        layout: list[LocalTensor],
        *,
        device: torch.device,
        rank: int,
    ) -> tuple[Receiver, ParamStore]:
        """Allocate the rank's parameters for ``transport`` and register them.

        Args:
            transport: the run's transport configuration (a kind an engine on ``device`` receives
                through, :func:`~weightsync.transport.registry.check_receiver`; bound to a CUDA
                ``device`` unless bound already), or None for no transport (broadcast only).
            layout: the rank's local tensors.
            device: where the parameters live.
            rank: engine rank (names the session when there is no transport).

        Returns:
            ``(receiver, store)``: ``store`` holds the served parameters (for a staged transport a
            plain allocation, the registered inbox being :attr:`Receiver.inbox`).

        Raises:
            ValueError: an unsuitable kind.
            RuntimeError: the transport is unavailable here (its message says why).
        """
        if transport is None:
            return cls(NONE, None, None, rank), ParamStore(layout, device)
        backend = check_receiver(transport.kind, device.type)
        if device.type == "cuda" and transport.cuda_device is None:
            transport = transport.on_device(device.index)
        opened = transport.make()
        try:
            arena = opened.new_arena(ParamStore.required_bytes(layout), device=device)
            registered = ParamStore(layout, device, arena=arena)
            opened.register(
                PARAMS_REGION, arena.base, arena.nbytes, device=device.index if device.type == "cuda" else HOST
            )
        except BaseException:
            opened.close()
            raise
        kind = transport.kind.value
        if backend.dest_needs_staging:
            return cls(kind, opened, arena, rank, inbox=registered), ParamStore(layout, device)
        return cls(kind, opened, arena, rank), registered

    @property
    def session_id(self) -> str:
        return self._session

    def descriptor(self) -> dict[str, Any] | None:
        """The transport's published descriptor (JSON-safe), or None without a transport."""
        return self._transport.descriptor().to_json() if self._transport is not None else None

    def close(self) -> None:
        """Release the registration and the arena (idempotent)."""
        if self.inbox is not None:
            self.inbox.close()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
