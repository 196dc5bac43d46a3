"""The receiving end of p2p transfers on one engine rank: transport, arena, one registration.

With a transport (``shm`` on CPU, ``cuda_ipc`` on GPU, ``mooncake`` between hosts), the rank's
parameters are carved from that transport's arena and the whole block is registered once, as
region ``"params"``, before anything is published; senders connect with the published
descriptor and write straight into the parameters. The receiver does nothing per update (the
transports are one-sided). Without a transport (None) the parameters are a plain allocation
and only the broadcast path (two-sided, :mod:`weightsync.sync.broadcast_receiver`) can update them.

Typical usage::

    receiver, store = Receiver.open(TransportConfig(kind="shm"), layout, device=torch.device("cpu"), rank=0)
    receiver.descriptor()        # JSON-safe dict for /get_remote_instance_transfer_engine_info
    ...
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

RECEIVER_TRANSPORTS = ("shm", "cuda_ipc", "mooncake")
"""Transports an engine can receive through (dist is two-sided; local is in-process only); an
engine without a transport passes None."""

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
    ) -> tuple[Receiver, ParamStore]:
        """Allocate the rank's parameters for ``transport`` and register them.

        Args:
            transport: the run's transport configuration (its kind one of
                :data:`RECEIVER_TRANSPORTS`; ``cuda_ipc`` is bound to ``device`` unless bound
                already), or None for no transport (broadcast only).
            layout: the rank's local tensors.
            device: where the parameters live.
            rank: engine rank (names the session when there is no transport).

        Returns:
            ``(receiver, store)``.

        Raises:
            ValueError: an unsuitable kind.
            RuntimeError: the transport is unavailable here (its message says why).
        """
        if transport is None:
            return cls("none", None, None, rank), ParamStore(layout, device)
        kind = transport.kind.value
        if kind not in RECEIVER_TRANSPORTS:
            raise ValueError(f"an engine receives through one of {', '.join(RECEIVER_TRANSPORTS)}; got {kind!r}")
        if kind == "cuda_ipc":
            if device.type != "cuda":
                raise ValueError("the cuda_ipc transport needs a CUDA engine (--device cuda); use shm on CPU")
            if transport.cuda_device is None:
                transport = transport.on_device(device.index)
        elif kind == "shm" and device.type != "cpu":
            raise ValueError("the shm transport serves host memory; use cuda_ipc for a CUDA engine")
        opened = transport.make()
        try:
            arena = opened.new_arena(ParamStore.required_bytes(layout), device=device)
            store = ParamStore(layout, device, arena=arena)
            opened.register(
                PARAMS_REGION, arena.base, arena.nbytes, device=device.index if device.type == "cuda" else HOST
            )
        except BaseException:
            opened.close()
            raise
        return cls(kind, opened, arena, rank), store

    @property
    def session_id(self) -> str:
        return self._session

    def descriptor(self) -> dict[str, Any] | None:
        """The transport's published descriptor (JSON-safe), or None without a transport."""
        return self._transport.descriptor().to_json() if self._transport is not None else None

    def close(self) -> None:
        """Release the registration and the arena (idempotent)."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
