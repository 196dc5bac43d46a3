"""The written transport policy: which backend moves the bytes between two ranks.

Per (sender, receiver) pair (:func:`choose_transport`), cheapest path first:

* same device, same process (colocated) -> ``local``: a plain copy;
* same host -> ``cuda_ipc`` on GPUs (NVLink/PCIe, or HBM-local for two processes on one GPU),
  ``shm`` on CPUs (memcpy into the receiver's shared arena; never TCP on one host);
* other host -> ``mooncake`` (RDMA where there is a NIC, TCP otherwise).

A run uses one kind for every pair (each engine rank registers its parameters with one transport
and publishes one descriptor), so :func:`resolve_kind` applies the rule to every pair of a
placement: one answer for all pairs is that answer; ``mooncake`` among the answers wins (it
reaches every other host and this one); ``local`` next to a same-host kind has no common kind
(a CUDA IPC handle cannot be opened by its owner) and is refused.

``dist`` (two-sided torch.distributed) is never chosen: it is asked for by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from weightsync.transport.registry import KindChoices, TransportKind

AUTO = "auto"
"""The requested kind that means: apply this policy."""


def run_choices() -> KindChoices:
    """What a run's ``--transport`` accepts (``run``, ``bench``): :data:`AUTO`, or a kind an engine
    receives through (:func:`~weightsync.transport.registry.receiver_kinds`), forced for every pair."""
    return KindChoices(AUTO)


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


def resolve_kind(
    requested: str,
    pairs: Iterable[tuple[DeviceLike, DeviceLike]],
    *,
    on_gpu: bool,
    same_process: bool = False,
) -> TransportKind:
    """The one transport kind of a run: ``requested`` itself, or for :data:`AUTO` the policy over ``pairs``.

    Args:
        requested: :data:`AUTO` or a :class:`TransportKind` value (taken as it is: a forced kind).
        pairs: ``(sender device, receiver device)`` of every pair that writes; with :data:`AUTO`
            at least one.
        on_gpu: the memory on both sides is GPU memory (else host memory).
        same_process: senders and receivers on one device share a process (colocated).

    Raises:
        ValueError: an unknown kind; no pairs; pairs that no single kind serves (the message
            names two of them and how to force one).
    """
    if requested != AUTO:
        try:
            return TransportKind(requested)
        except ValueError:
            raise ValueError(
                f"unknown transport {requested!r}; choose {AUTO} or one of {[k.value for k in TransportKind]}"
            ) from None
    chosen: dict[TransportKind, tuple[DeviceLike, DeviceLike]] = {}
    for src, dst in pairs:
        chosen.setdefault(choose_transport(src, dst, on_gpu, same_process=same_process), (src, dst))
    if not chosen:
        raise ValueError("transport auto needs the placement of at least one (sender, receiver) pair")
    if len(chosen) == 1:
        return next(iter(chosen))
    if TransportKind.LOCAL not in chosen:
        return TransportKind.MOONCAKE  # the only mix left: same-host and other-host pairs
    (a, pa), (b, pb) = list(chosen.items())[:2]
    raise ValueError(
        f"no one transport serves this placement: {pa[0]} -> {pa[1]} needs {a.value}, {pb[0]} -> {pb[1]} "
        f"needs {b.value}; force one kind with --transport"
    )
