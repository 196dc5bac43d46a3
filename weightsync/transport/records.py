"""The records a transport publishes: registered memory regions and a peer's descriptor.

These cross process boundaries (a receiver publishes its :class:`PeerDescriptor`, e.g. through
sglang's ``/get_remote_instance_transfer_engine_info``, and writers connect with it), so they are
frozen and JSON-serializable. :data:`Run` is the unit every write is made of.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

Run = tuple[int, int, int]
"""``(src_addr, dst_addr, nbytes)``: one contiguous byte run of a write."""

HOST = -1
"""The ``device`` of host (CPU) memory in :class:`Region` and :meth:`Transport.register`."""


def host_id() -> str:
    """An identifier of this machine boot: hostname plus the kernel's boot id.

    Same-host transports (shm, cuda_ipc) compare it to refuse peers on other machines early.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"



@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    """One registered memory region as its owner publishes it (serialized, JSON-safe)."""

    name: str
    """Label given at registration (e.g. ``"params"`` or a parameter name); unique per owner."""
    addr: int
    """Start address in the owner's address space (a device pointer for GPU memory)."""
    nbytes: int
    """Length in bytes."""
    handle: str = ""
    """Backend-specific name of the memory that peers open: a shm segment name, a base64 CUDA IPC
    handle; empty when peers address ``addr`` directly (mooncake, dist, local)."""
    handle_offset: int = 0
    """Offset of ``addr`` from the start of the memory that ``handle`` names."""
    device: int = HOST
    """Owner's CUDA device ordinal, or :data:`HOST` for host memory."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("region name must be non-empty")
        if self.addr <= 0 or self.nbytes <= 0:
            raise ValueError(f"region {self.name!r}: addr and nbytes must be positive, got {self.addr}, {self.nbytes}")
        if self.handle_offset < 0:
            raise ValueError(f"region {self.name!r}: handle_offset must be >= 0, got {self.handle_offset}")

    @property
    def end(self) -> int:
        return self.addr + self.nbytes

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "addr": self.addr,
            "nbytes": self.nbytes,
            "handle": self.handle,
            "handle_offset": self.handle_offset,
            "device": self.device,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Region:
        return cls(
            name=str(data["name"]),
            addr=int(data["addr"]),
            nbytes=int(data["nbytes"]),
            handle=str(data.get("handle", "")),
            handle_offset=int(data.get("handle_offset", 0)),
            device=int(data.get("device", HOST)),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerDescriptor:
    """What a receiver publishes so that writers can reach its registered memory (JSON-safe)."""

    kind: str
    """The transport kind that produced it (a :class:`~weightsync.transport.TransportKind` value)."""
    session_id: str
    """How to reach the owner: ``"ip:port"`` (mooncake), a rank (dist), ``"shm:<pid>"`` ..."""
    host_id: str
    """:func:`host_id` of the owner's machine."""
    pid: int
    """Owner's process id."""
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"descriptor {self.session_id!r} has duplicate region names: {sorted(names)}")

    def region(self, name: str) -> Region:
        """The region called ``name``; raises ``KeyError`` listing the names there are."""
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"peer {self.session_id!r} has no region {name!r}; it has {[r.name for r in self.regions]}")

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "session_id": self.session_id,
            "host_id": self.host_id,
            "pid": self.pid,
            "regions": [r.to_json() for r in self.regions],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PeerDescriptor:
        return cls(
            kind=str(data["kind"]),
            session_id=str(data["session_id"]),
            host_id=str(data["host_id"]),
            pid=int(data["pid"]),
            regions=tuple(Region.from_json(r) for r in data["regions"]),
        )

