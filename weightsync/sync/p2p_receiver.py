"""The receiving end of p2p transfers on one engine rank: transport, arena, one registration.

With a transport (any one-sided backend that reaches other processes and moves the rank's memory:
:func:`~weightsync.transport.registry.check_receiver`), the rank's parameter copies
(:class:`~weightsync.sync.weight_copies.WeightCopies`) are carved from that transport's arena and
registered once, as region ``"params"``, before anything is published; senders connect with the
published descriptor and write straight into them. The receiver does nothing per write (the
transports are one-sided). It asks the backend what it can do (its capability attributes,
``TransportConfig.backend``) and never compares kind names. Without a transport (None) the copies
are plain allocations and only the broadcast path (two-sided,
:mod:`weightsync.sync.broadcast_receiver`) and the engine's own loaders can update them.

With a shadow (``shadow=True``) the block holds two copies, both published: the served one and the
shadow an update session writes while the engine keeps generating; without, one copy, written in
place as sglang does.

**Staged transports** (``Transport.dest_needs_staging``: shm): the registered block is an *inbox*
(copy 0, the only published copy), never the served parameters. A shm segment can be mapped and
written by any process of the engine's user that learns its name (``/dev/shm`` lists it), at any
time; so the engine serves from memory of its own (copy 1), copies it into the inbox when an
update session begins and the inbox into it at the session's publication (a flip by copy,
:meth:`~weightsync.sync.weight_copies.WeightCopies.flip`). A write outside a session therefore
never reaches the served weights; a write during a session is the session's (its verification
sees it). The price: twice the parameter memory (host memory, CPU engines only) and two block
copies per update. The others (cuda_ipc, mooncake) publish what they serve, as sglang does:
whoever holds their handles (published only through the token-guarded info endpoint,
respectively the Mooncake RPC port, confined to the advertised interface) can write the served
parameters directly.

Typical usage::

    receiver, copies = Receiver.open(TransportConfig(kind="shm"), layout, device=torch.device("cpu"), rank=0)
    receiver.descriptor()        # JSON-safe dict for /get_remote_instance_transfer_engine_info
    copies.begin(pause_free=False)   # begin_weight_update: the inbox starts as the served weights
    ...                              # senders write into copies.session_store()
    copies.flip()                    # the publication: the inbox becomes the served weights
    copies.close(); receiver.close()
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from weightsync.layout.box import LocalTensor
from weightsync.sync.params import ALIGN_BYTES, ParamStore
from weightsync.sync.weight_copies import WeightCopies
from weightsync.transport import HOST, TransportConfig
from weightsync.transport.config import NONE
from weightsync.transport.registry import check_receiver

PARAMS_REGION = "params"


class Receiver:
    """The transport side of one engine rank (see the module docstring)."""

    def __init__(self, kind: str, transport: Any, arena: Any, rank: int) -> None:
        self.kind = kind
        self._transport = transport
        self._arena = arena
        self._session = (
            transport.session_id if transport is not None else f"none://{socket.gethostname()}/{os.getpid()}/rank{rank}"
        )

    @classmethod
    def open(
        cls,
        transport: TransportConfig | None,
        layout: list[LocalTensor],
        *,
        device: torch.device,
        rank: int,
        shadow: bool = False,
    ) -> tuple[Receiver, WeightCopies]:
        """Allocate the rank's parameter copies for ``transport`` and register them.

        Args:
            transport: the run's transport configuration (a kind an engine on ``device`` receives
                through, :func:`~weightsync.transport.registry.check_receiver`; bound to a CUDA
                ``device`` unless bound already), or None for no transport (broadcast only).
            layout: the rank's local tensors.
            device: where the parameters live.
            rank: engine rank (names the session when there is no transport).
            shadow: hold a second copy that pause-free sessions write (a staged transport has one
                anyway: its inbox).

        Returns:
            ``(receiver, copies)`` (module docstring: which copy is served and which published).

        Raises:
            ValueError: an unsuitable kind.
            RuntimeError: the transport is unavailable here (its message says why).
        """
        if transport is None:
            stores = [ParamStore(layout, device) for _ in range(2 if shadow else 1)]
            return cls(NONE, None, None, rank), WeightCopies(stores, published=len(stores))
        backend = check_receiver(transport.kind, device.type)
        if device.type == "cuda" and transport.cuda_device is None:
            transport = transport.on_device(device.index)
        staged = backend.dest_needs_staging
        published = 2 if shadow and not staged else 1
        copy_bytes = -(-ParamStore.required_bytes(layout) // ALIGN_BYTES) * ALIGN_BYTES
        opened = transport.make()
        try:
            arena = opened.new_arena(published * copy_bytes, device=device)
            stores = [ParamStore(layout, device, arena=arena) for _ in range(published)]
            opened.register(
                PARAMS_REGION, arena.base, arena.nbytes, device=device.index if device.type == "cuda" else HOST
            )
        except BaseException:
            opened.close()
            raise
        kind = transport.kind.value
        if staged:  # the inbox is copy 0; the served copy is private memory
            return cls(kind, opened, arena, rank), WeightCopies([*stores, ParamStore(layout, device)], published=1,
                                                                served=1, pause_free=shadow)
        return cls(kind, opened, arena, rank), WeightCopies(stores, published=published)

    @property
    def session_id(self) -> str:
        return self._session

    def descriptor(self) -> dict[str, Any] | None:
        """The transport's published descriptor (JSON-safe), or None without a transport."""
        return self._transport.descriptor().to_json() if self._transport is not None else None

    def close(self) -> None:
        """Release the registration and the arena (idempotent; close the copies first)."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
