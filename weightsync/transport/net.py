"""Where listening sockets listen: the advertised address, not every interface.

Every data-plane listener of this project binds the address its process advertises (loopback by
default), so that nothing beyond that network can connect:

* a TCPStore master binds ``host:port`` itself (:func:`bound_store`: torch's ``TCPStore`` listens
  on every interface unless handed a socket already bound, ``master_listen_fd``);
* gloo pairs bind the address of the device they are created with (:func:`gloo_device`);
* Mooncake's TransferEngine in P2PHANDSHAKE mode binds its RPC (handshake) and TCP data ports to
  ``INADDR_ANY`` / ``::`` whatever ``initialize`` is given (Mooncake
  ``transfer_metadata_plugin.cpp`` ``findAvailableTcpPort``, ``tcp_transport_session_impl.h``'s
  dual-stack acceptor); no argument or variable changes that in P2P mode. Those sockets are
  *confined* after the fact (:func:`confine`): ``SO_BINDTODEVICE`` to the interface that holds the
  advertised address, so connections to any other interface's address are refused (unprivileged
  since Linux 5.7 for a socket not yet bound to a device).

NCCL's bootstrap listens on the interface NCCL chooses (``NCCL_SOCKET_IFNAME``); it cannot be
given an address per communicator.

:func:`listening_sockets` lists a process's listeners from ``/proc`` (tests and diagnostics).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915
SIOCGIFFLAGS = 0x8913
IFF_LOOPBACK = 0x8
TCP_LISTEN = "0A"
"""``st`` of a listening socket in ``/proc/net/tcp``."""


def resolve(host: str) -> str:
    """``host`` as an IP address string (a name is resolved; IPv6 brackets dropped).

    Raises:
        ValueError: the name does not resolve.
    """
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise ValueError(f"address {host!r} does not resolve ({exc})") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is a loopback address (``127.0.0.0/8``, ``::1``)."""
    try:
        return ipaddress.ip_address(resolve(host)).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every interface (``0.0.0.0``, ``::``, empty)."""
    return host.strip("[]") in ("", "0.0.0.0", "::")


def _ioctl(sock: socket.socket, request: int, name: str) -> bytes:
    return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds address ``host`` (``lo`` for any loopback
    address), or None when no interface of this host holds it (NAT, a name of another host)."""
    try:
        ip = ipaddress.ip_address(resolve(host))
    except ValueError:
        return None
    names = [name for _, name in socket.if_nameindex()]
    if ip.version == 6:
        if ip.is_loopback:
            return next((n for n in names if _is_loopback_iface(n)), None)
        for line in Path("/proc/net/if_inet6").read_text().splitlines() if Path("/proc/net/if_inet6").exists() else []:
            parts = line.split()
            if len(parts) >= 6 and ipaddress.ip_address(int(parts[0], 16)) == ip:
                return parts[5]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                if ip.is_loopback and _is_loopback_iface(name):
                    return name
                addr = socket.inet_ntoa(_ioctl(s, SIOCGIFADDR, name)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            if ipaddress.ip_address(addr) == ip:
                return name
    return None


def _is_loopback_iface(name: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            flags = struct.unpack("H", _ioctl(s, SIOCGIFFLAGS, name)[16:18])[0]
        except OSError:
            return False
    return bool(flags & IFF_LOOPBACK)


def route_source(peer: str) -> str:
    """This host's address on the route to ``peer`` (what ``peer`` reaches this process at)."""
    ip = resolve(peer)
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # UDP connect sends nothing; it picks the route and source address
        return str(s.getsockname()[0])


@dataclass(frozen=True, kw_only=True, slots=True)
class Listener:
    """One listening TCP socket of a process."""

    address: str
    """The bound address (``0.0.0.0`` / ``::``: every interface)."""
    port: int
    inode: int
    fd: int | None = None
    """Its file descriptor in the process (None when the fd table was not readable)."""

    @property
    def wildcard(self) -> bool:
        return is_wildcard(self.address)


def _hex_address(field: str) -> tuple[str, int]:
    addr, port = field.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    # IPv6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    ip = ipaddress.ip_address(words)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip), int(port, 16)


def listening_sockets(pid: int | None = None) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) that process ``pid`` (default: this one) holds.

    Reads ``/proc/<pid>/fd`` (same user or root) and ``/proc/<pid>/net/tcp{,6}``.
    """
    base = Path("/proc") / (str(pid) if pid is not None else "self")
    fds: dict[int, int] = {}
    for fd in os.listdir(base / "fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(base / "fd" / fd)
            if target.startswith("socket:["):
                fds[int(target[8:-1])] = int(fd)
    out = []
    for table in ("tcp", "tcp6"):
        path = base / "net" / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) < 10 or parts[3] != TCP_LISTEN or int(parts[9]) not in fds:
                continue
            address, port = _hex_address(parts[1])
            out.append(Listener(address=address, port=port, inode=int(parts[9]), fd=fds[int(parts[9])]))
    return out


def confine(listeners: list[Listener], interface: str) -> None:
    """Bind each of this process's ``listeners`` to ``interface`` (``SO_BINDTODEVICE``): the
    kernel then refuses connections that arrive for another interface's address.

    Raises:
        OSError: the kernel refused the option (before Linux 5.7 it needs ``CAP_NET_RAW``).
    """
    for lst in listeners:
        if lst.fd is None:
            continue
        # A socket object over a duplicate: options are the socket's, closing the dup leaves it open.
        with socket.socket(fileno=os.dup(lst.fd)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode() + b"\0")


def bound_device(fd: int) -> str:
    """The interface a socket of this process is bound to (``SO_BINDTODEVICE``; '' for none)."""
    with socket.socket(fileno=os.dup(fd)) as s:
        return s.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, 16).split(b"\0", 1)[0].decode()


def bound_store(host: str, port: int, world_size: int, *, is_master: bool, timeout: datetime.timedelta,
                wait_for_workers: bool = False) -> object:
    """A ``torch.distributed.TCPStore`` whose master listens on ``host:port`` only (torch's own
    listens on every interface); a client connects to ``host:port``.

    Raises:
        OSError: the master cannot bind ``host:port``.
    """
    import torch.distributed as dist

    fd = None
    if is_master:
        ip = resolve(host)
        family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ip, port))
            s.listen(socket.SOMAXCONN)
        except OSError:
            s.close()
            raise
        fd = s.detach()  # the store's server owns it from here
    try:
        return dist.TCPStore(host.strip("[]"), port, world_size, is_master=is_master, timeout=timeout,
                             wait_for_workers=wait_for_workers, master_listen_fd=fd)
    except BaseException:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def gloo_device(host: str) -> object:
    """A gloo device whose pairs listen on ``host`` (a local address)."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo.create_device(hostname=resolve(host))
