"""One transport configuration: the kind a run uses and the options of its backend.

Built once per run, where the placement is known (:meth:`TransportConfig.resolve` applies the
written policy of :mod:`~weightsync.transport.policy` to ``auto``), then handed to every process
that opens a transport: trainer ranks and benchmark ranks get it pickled, engines get it on their
command line as one JSON argument (``--transport-config``, :func:`add_receiver_arguments`). Each
process binds what only it knows (its CUDA device, :meth:`TransportConfig.on_device`; its address,
:meth:`TransportConfig.on_host`) and opens the backend with :meth:`TransportConfig.make`, which
asks the backend class for its constructor arguments (``Transport.config_options``).

The record is frozen and JSON-safe (:meth:`TransportConfig.to_json` / ``from_json``); it reads no
environment: the fields name their variables (:meth:`TransportConfig.env_options`:
``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``) and the launcher's reader, ``weightsync.launch.config``,
passes their values in. A field with a ``flag`` is also an option of ``weightsync serve``
(``--mooncake-protocol``, ``--mooncake-device``).

Typical usage::

    cfg = TransportConfig.resolve("auto", pairs, on_gpu=True, mooncake_protocol=env.mooncake_protocol)
    ...                                   # pickled to a trainer rank on cuda:3
    transport = cfg.on_device(3).make()   # cuda_ipc on cuda:3
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from weightsync.transport.policy import DeviceLike, resolve_kind
from weightsync.transport.registry import KindChoices, TransportKind, make_transport, transport_class

if TYPE_CHECKING:  # the backends are imported when a record is opened, not with it
    from weightsync.transport.base import Transport

DEFAULT_MOONCAKE_PROTOCOL = "auto"
NONE = "none"
"""The ``--transport`` of an engine without a p2p transport (broadcast only)."""


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
    mooncake_protocol: str = field(default=DEFAULT_MOONCAKE_PROTOCOL, metadata={
        "env": "MOONCAKE_PROTOCOL",
        "flag": "with --transport mooncake: auto | tcp | rdma (default auto: rdma where an RDMA port is active)"})
    """``mooncake``: ``auto`` (rdma where an RDMA port is active, else tcp), ``tcp`` or ``rdma``
    (``MOONCAKE_PROTOCOL``; the choice: :func:`weightsync.transport.mooncake.choose_protocol`)."""
    mooncake_device: str = field(default="", metadata={
        "env": "MOONCAKE_DEVICE", "flag": "with --transport mooncake rdma: e.g. mlx5_0"})
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
        if self.mooncake_protocol not in ("auto", "tcp", "rdma"):
            raise ValueError(f"mooncake_protocol must be auto, tcp or rdma, got {self.mooncake_protocol!r}")

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

    @property
    def backend(self) -> type[Transport]:
        """The backend class: what it can do is asked of its capability attributes."""
        return transport_class(self.kind)

    def on_device(self, cuda_device: int | None) -> TransportConfig:
        """This configuration bound to the calling process's CUDA device (None: host memory)."""
        return replace(self, cuda_device=cuda_device)

    def on_host(self, hostname: str) -> TransportConfig:
        """This configuration bound to the calling process's host: the address peers reach it at,
        which a backend that ``opens_ports`` announces (a Mooncake session)."""
        return replace(self, mooncake_hostname=hostname)

    def options(self) -> dict[str, Any]:
        """The backend's constructor arguments (what :func:`~weightsync.transport.make_transport` takes).

        Raises:
            ValueError: the backend needs what is not bound (cuda_ipc: a device), or cannot be
                built from a record (dist, whose process group cannot be written down).
        """
        return self.backend.config_options({f.name: getattr(self, f.name) for f in fields(self)})

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
            ValueError: a key that is no field (the message lists the fields), no kind.
        """
        names = list(cls.__dataclass_fields__)
        unknown = set(data) - set(names)
        if unknown:
            raise ValueError(f"unknown transport config keys {sorted(unknown)}; the fields are {names}")
        if "kind" not in data:
            raise ValueError(f"a transport config needs its kind; got the keys {sorted(data)}")
        return cls(**data)

    @classmethod
    def env_options(cls, environ: Mapping[str, str]) -> dict[str, str]:
        """The options set in ``environ`` (a variable per field that names one; empty means unset).

        The environment's one reader (``weightsync.launch.config``) passes it in; this reads nothing
        itself.
        """
        out = {}
        for f in fields(cls):
            value = environ.get(f.metadata["env"], "").strip() if "env" in f.metadata else ""
            if value:
                out[f.name] = value
        return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_receiver_arguments(parser: argparse.ArgumentParser) -> None:
    """The transport options of an engine's command line: ``--transport`` (``none`` or a kind an
    engine receives through, :func:`~weightsync.transport.registry.receiver_kinds`), one flag per
    option that has one (``--mooncake-protocol``, ...), or the whole record as one JSON argument
    ``--transport-config`` (what launchers pass); :func:`receiver_config_from_args` reads them."""
    parser.add_argument("--transport", default=None, choices=KindChoices(NONE), metavar="KIND",
                        help="p2p transport the parameters are registered with: %(choices)s (default: none = "
                        "broadcast only)")
    for f in fields(TransportConfig):
        if "flag" in f.metadata:
            parser.add_argument(_flag(f.name), default=None, help=f.metadata["flag"])
    parser.add_argument("--transport-config", default=None, metavar="JSON",
                        help="the whole transport configuration as JSON (TransportConfig.to_json), instead of "
                        "--transport and its options")


def receiver_config_from_args(args: argparse.Namespace) -> TransportConfig | None:
    """The record :func:`add_receiver_arguments`'s options give (None: ``--transport none``).

    Raises:
        ValueError: ``--transport-config`` next to another transport option, JSON that is no
            record, or a bad option.
    """
    given = {f.name: getattr(args, f.name) for f in fields(TransportConfig)
             if "flag" in f.metadata and getattr(args, f.name) is not None}
    if args.transport_config is not None:
        if args.transport is not None or given:
            named = ["--transport"] * (args.transport is not None) + [_flag(n) for n in given]
            raise ValueError(f"--transport-config is the whole transport configuration: drop {', '.join(named)}")
        try:
            data = json.loads(args.transport_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--transport-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--transport-config must be a JSON object (TransportConfig.to_json), got {data!r}")
        return TransportConfig.from_json(data)
    if args.transport in (None, NONE):
        return None
    return TransportConfig(kind=args.transport, **given)


def receiver_argv(cfg: TransportConfig | None) -> list[str]:
    """The engine command-line options that carry ``cfg`` (the inverse of :func:`receiver_config_from_args`)."""
    return ["--transport", NONE] if cfg is None else ["--transport-config", json.dumps(cfg.to_json())]
