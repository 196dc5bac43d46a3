"""One transport configuration: the kind a run uses and the options of its backend.

Built once per run, where the placement is known (:meth:`TransportConfig.resolve` applies the
written policy of :mod:`~weightsync.transport.policy` to ``auto``), then handed to every process
that opens a transport: trainer ranks and benchmark ranks get it pickled, engines get it on their
command line (``--transport`` plus the ``--mooncake-*`` options) and rebuild it. Each process
binds what only it knows (its CUDA device, :meth:`TransportConfig.on_device`; its host's
address, :meth:`TransportConfig.on_host`) and opens the backend with
:meth:`TransportConfig.make`; nothing else assembles backend options.

The record is frozen and JSON-safe (:meth:`TransportConfig.to_json` / ``from_json``); it reads no
environment (the launcher's reader, ``weightsync.launch.config``, passes ``MOONCAKE_PROTOCOL`` and
``MOONCAKE_DEVICE`` in).

Typical usage::

    cfg = TransportConfig.resolve("auto", pairs, on_gpu=True, mooncake_protocol=env.mooncake_protocol)
    ...                                   # pickled to a trainer rank on cuda:3
    transport = cfg.on_device(3).make()   # cuda_ipc on cuda:3
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from weightsync.transport.base import Transport
from weightsync.transport.policy import DeviceLike, resolve_kind
from weightsync.transport.records import HOST
from weightsync.transport.registry import TransportKind, make_transport

DEFAULT_MOONCAKE_PROTOCOL = "tcp"


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportConfig:
    """The transport of a run: its kind and every backend option that can be written down."""

    kind: TransportKind
    """The resolved kind (never ``auto``); a string value is converted."""
    cuda_device: int | None = None
    """``cuda_ipc`` (required) and ``local``: this process's CUDA device ordinal. Per process:
    a launcher leaves it None and each rank binds its own (:meth:`on_device`)."""
    shm_threads: int = 1
    """``shm`` and host-memory ``local``: copy threads per writer."""
    mooncake_protocol: str = DEFAULT_MOONCAKE_PROTOCOL
    """``mooncake``: ``tcp`` or ``rdma`` (``MOONCAKE_PROTOCOL``)."""
    mooncake_device: str = ""
    """``mooncake`` ``rdma``: the RDMA device(s), e.g. ``mlx5_0`` (``MOONCAKE_DEVICE``)."""
    mooncake_hostname: str = "127.0.0.1"
    """``mooncake``: this process's address as peers reach it (an engine passes its own host)."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", TransportKind(self.kind))
        except ValueError:
            raise ValueError(
                f"unknown transport {self.kind!r}; choose one of {[k.value for k in TransportKind]}"
            ) from None
        if self.cuda_device is not None and self.cuda_device < 0:
            raise ValueError(f"cuda_device must be a CUDA device ordinal >= 0 or None, got {self.cuda_device}")
        if self.shm_threads < 1:
            raise ValueError(f"shm_threads must be >= 1, got {self.shm_threads}")
        if not self.mooncake_protocol:
            raise ValueError("mooncake_protocol must be non-empty (tcp or rdma)")

    @classmethod
    def resolve(
        cls,
        requested: str,
        pairs: Iterable[tuple[DeviceLike, DeviceLike]],
        *,
        on_gpu: bool,
        same_process: bool = False,
        **options: Any,
    ) -> TransportConfig:
        """The configuration of a run: ``requested`` (``auto`` or a kind) resolved over ``pairs``.

        Args:
            requested: ``auto`` (the policy of :func:`~weightsync.transport.policy.resolve_kind`)
                or a kind, taken as it is.
            pairs: ``(sender device, receiver device)`` of every writing pair.
            on_gpu: both sides hold GPU memory.
            same_process: senders and receivers on one device share a process.
            **options: the other fields (``mooncake_protocol=``, ``shm_threads=``, ...).

        Raises:
            ValueError: see :func:`~weightsync.transport.policy.resolve_kind`; a bad option.
        """
        kind = resolve_kind(requested, pairs, on_gpu=on_gpu, same_process=same_process)
        return cls(kind=kind, **options)

    def on_device(self, cuda_device: int | None) -> TransportConfig:
        """This configuration bound to the calling process's CUDA device (None: host memory)."""
        return replace(self, cuda_device=cuda_device)

    def on_host(self, hostname: str) -> TransportConfig:
        """This configuration bound to the calling process's host: the address peers reach it at,
        which a backend that publishes one announces (a Mooncake session)."""
        return replace(self, mooncake_hostname=hostname)

    def options(self) -> dict[str, Any]:
        """The backend's constructor arguments (what :func:`~weightsync.transport.make_transport` takes).

        Raises:
            ValueError: ``cuda_ipc`` without a bound device; ``dist``, whose process group
                cannot be written down (construct it with ``make_transport("dist", group=pg)``).
        """
        if self.kind is TransportKind.SHM:
            return {"num_threads": self.shm_threads}
        if self.kind is TransportKind.CUDA_IPC:
            if self.cuda_device is None:
                raise ValueError("the cuda_ipc transport needs this process's CUDA device: bind it with on_device()")
            return {"device": self.cuda_device}
        if self.kind is TransportKind.MOONCAKE:
            return {"protocol": self.mooncake_protocol, "device": self.mooncake_device,
                    "hostname": self.mooncake_hostname}
        if self.kind is TransportKind.LOCAL:
            return {"device": HOST if self.cuda_device is None else self.cuda_device, "num_threads": self.shm_threads}
        raise ValueError(
            f"a {self.kind.value} transport cannot be made from a TransportConfig; "
            f"construct it with make_transport({self.kind.value!r}, ...)"
        )

    def make(self) -> Transport:
        """Open the backend (the caller closes it).

        Raises:
            ValueError: as :meth:`options`.
            RuntimeError: the backend is not available here (its message says what is missing).
        """
        return make_transport(self.kind, **self.options())

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TransportConfig:
        """The inverse of :meth:`to_json`; missing options take their defaults.

        Raises:
            ValueError: a key that is no field (the message lists the fields).
        """
        fields = list(cls.__dataclass_fields__)
        unknown = set(data) - set(fields)
        if unknown:
            raise ValueError(f"unknown transport config keys {sorted(unknown)}; the fields are {fields}")
        return cls(**data)
