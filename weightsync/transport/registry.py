"""The backends by kind: the only module that knows every one of them, and the factory.

A backend is one line of ``_BACKENDS``: its kind (the name used in descriptors, configurations
and the ``--transport`` choices; :class:`TransportKind` is built from these lines), its module,
its :class:`~weightsync.transport.base.Transport` subclass and its availability probe. What a
backend can do is asked of that class (its capability attributes), through the functions here
(:func:`receiver_kinds`, :func:`check_receiver`, :func:`sglang_kind`) or
:attr:`TransportConfig.backend <weightsync.transport.config.TransportConfig.backend>`; nothing
outside this package names a kind.

Backends are imported when first asked for (:func:`transport_class`), and their modules import
their libraries lazily, so importing the package needs neither Mooncake nor CUDA; this module
itself imports no backend (nor torch), so a command line can be built from it cheaply
(:class:`KindChoices`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the classes are imported when asked for, not with the registry
    from weightsync.transport.base import Transport

_BACKENDS: dict[str, tuple[str, str, str | None]] = {
    # kind: (module, Transport subclass, availability probe or None: always available)
    "local": ("weightsync.transport.local", "LocalTransport", None),
    "shm": ("weightsync.transport.shm", "ShmTransport", "shm_available"),
    "cuda_ipc": ("weightsync.transport.cuda_ipc", "CudaIpcTransport", "cuda_ipc_available"),
    "mooncake": ("weightsync.transport.mooncake", "MooncakeTransport", "mooncake_available"),
    "dist": ("weightsync.transport.dist", "DistTransport", "dist_available"),
}

TransportKind = StrEnum("TransportKind", [(kind.upper(), kind) for kind in _BACKENDS], module=__name__)
TransportKind.__doc__ = """Transport backends, by the name used in descriptors, configs and CLI flags (one per
line of ``_BACKENDS``; members are the names upper-cased, ``TransportKind.SHM``)."""


def _kind(kind: TransportKind | str) -> TransportKind:
    try:
        return TransportKind(kind)
    except ValueError:
        raise ValueError(f"unknown transport {kind!r}; choose one of {[k.value for k in TransportKind]}") from None


def transport_class(kind: TransportKind | str) -> type[Transport]:
    """The backend class of ``kind`` (imports its module)."""
    module, name, _ = _BACKENDS[_kind(kind).value]
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
            out.append(TransportKind(kind))
    return out


def receiver_kinds(device_type: str | None = None) -> list[TransportKind]:
    """Kinds an engine can register its parameters with: one-sided (the engine does nothing per
    write) and reachable from other processes; with ``device_type`` (``cpu``, ``cuda``) only those
    that move that memory. These are the ``--transport`` choices of ``run``, ``bench`` and ``serve``.
    """
    out = []
    for kind in TransportKind:
        cls = transport_class(kind)
        if cls.one_sided and not cls.same_process_only and (device_type is None or cls.serves(device_type)):
            out.append(kind)
    return out


class KindChoices(Sequence[str]):
    """``head``, then the kinds an engine receives through: the ``--transport`` choices of a command.

    Computed when argparse first reads them (to print help, or to check a value given), so that
    building a command line imports no backend, nor torch (``weightsync list`` stays light); give
    the argument a ``metavar``, else argparse reads them when the argument is added.
    """

    def __init__(self, *head: str) -> None:
        self._head = head
        self._values: list[str] | None = None

    def _all(self) -> list[str]:
        if self._values is None:
            self._values = [*self._head, *(kind.value for kind in receiver_kinds())]
        return self._values

    def __getitem__(self, index: Any) -> Any:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


def check_receiver(kind: TransportKind | str, device_type: str, *, name: str = "the transport") -> type[Transport]:
    """The backend class of ``kind``, refused unless an engine on ``device_type`` can receive through it.

    Args:
        kind: the kind asked for.
        device_type: where the engine's parameters live (``cpu`` or ``cuda``).
        name: how the message names the choice (``--transport`` on a command line).

    Raises:
        ValueError: unknown kind, a kind no engine receives through (two-sided, or same-process
            only), or one that cannot move the engine's memory (the message lists what can).
    """
    kind = _kind(kind)
    receivers = receiver_kinds()
    if kind not in receivers:
        raise ValueError(f"an engine receives through one of {', '.join(receivers)}; got {kind.value!r}")
    cls = transport_class(kind)
    if not cls.serves(device_type):
        fits = " or ".join(receiver_kinds(device_type)) or "none"
        if device_type == "cpu":
            why = "moves GPU memory only: it needs a CUDA engine (--device cuda)"
        else:
            why = f"moves host memory only: it cannot serve a {device_type} engine"
        raise ValueError(f"{name} {kind.value} {why}; on {device_type} use {fits}")
    return cls


def remove_leftovers(pids: set[int] | None = None) -> list[str]:
    """Ask every backend to remove what registrations of processes that are gone left on this host
    (``Transport.remove_leftovers``: ``pids``, or every owner that no longer exists).

    Returns:
        ``kind:name`` of everything removed.
    """
    return [f"{kind.value}:{name}" for kind in TransportKind for name in transport_class(kind).remove_leftovers(pids)]


def sglang_kind() -> TransportKind:
    """The kind of the backend that is sglang's own transfer engine (``Transport.sglang_native``):
    what reaches an engine that publishes only sglang's ``[session_id, weights_info]``."""
    native = [kind for kind in TransportKind if transport_class(kind).sglang_native]
    assert len(native) == 1, f"exactly one backend is sglang's transfer engine, found {native}"
    return native[0]
