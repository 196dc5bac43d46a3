"""Cross-host transport: Mooncake TransferEngine (RDMA, or TCP where there is no RDMA).

Each process runs one TransferEngine in P2PHANDSHAKE mode (no metadata server: peers exchange
segment descriptors directly over the engine's RPC port); its session id is ``"host:rpc_port"``.
Memory is registered once with ``register_memory``. A write is one asynchronous Mooncake batch
(``batch_transfer_async_write(session, srcs, dsts, lengths)``, then
``get_batch_transfer_status([batch_id])``, which blocks with the GIL released until the batch
completes or fails). :meth:`MooncakeTransport.write` submits the batch at once when fewer
than ``workers`` (default 4) are in flight, else queues it, and returns; one thread waits for
the oldest batch in flight and submits queued ones as slots free. So up to ``workers`` batches
move at once, one per (destination, bucket) as the sender issues them. One waiting thread, not one per batch:
Mooncake's wait busy-polls, and several pollers would take the cores the transfers need.
:meth:`~MooncakeTransport.wait` applies the deadline. Destination addresses are the receiver's
own pointers (Mooncake addresses remote memory by virtual address).

A Mooncake batch cannot be cancelled. A write that misses its deadline raises ``TimeoutError``
and is abandoned: :meth:`~MooncakeTransport.close` waits at most ``close_grace_s`` for writes
still in flight (none for one that already timed out), then returns; memory that an abandoned
batch may still read stays registered (and its engine alive) rather than being unregistered
under it, and the worker thread is a daemon, so neither ``close()`` nor interpreter exit hangs.

Protocol (``auto``, ``tcp``, ``rdma``) and device (an RDMA NIC name such as ``mlx5_0``, or empty)
are constructor arguments (:class:`~weightsync.transport.config.TransportConfig` carries them; the
launcher fills them from ``MOONCAKE_PROTOCOL`` and ``MOONCAKE_DEVICE``). The choice is made here
alone (:func:`choose_protocol`), as Mooncake itself makes it -- Mooncake's python ``initialize``
does not pick the transport from the protocol string: it runs RDMA when an ibverbs device of the
device filter has a port in state ``ACTIVE``, else TCP, and TCP whenever ``MC_FORCE_TCP`` is set
(Mooncake ``transfer_engine_impl.cpp``, ``topology.cpp``). ``auto`` (the default) is therefore
``rdma`` where such a port exists and ``tcp`` otherwise, said once in one loud line; an ``rdma``
asked for where none exists is said to run over TCP. The Mooncake package is imported lazily:
importing this module works without it (see :func:`mooncake_available`). GPU memory needs
Mooncake's CUDA build (``mooncake-transfer-engine-cuda13`` on the GPU set-up); the CPU set-up
installs the non-CUDA one.

Listeners: Mooncake binds its RPC (handshake) and TCP data ports to every interface in P2P mode
whatever ``hostname`` says; right after ``initialize`` they are confined to the interface that
holds ``hostname`` (:func:`weightsync.transport.net.confine`, ``SO_BINDTODEVICE``), so only
that network reaches them. Whoever reaches the RPC port can fetch this process's segment
descriptor (every registered buffer's address and length, RDMA keys) and then read and write
that memory: registration exposes it to that network, and no token guards it.

Measured on the 2-core CPU machine (tcp, 127.0.0.1): see scripts/bench_transport.py. Same-host
CPU traffic belongs on shm; this is for other hosts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from weightsync.transport.base import Transport
from weightsync.transport.handles import WriteBatch, WriteHandle, timeout_message
from weightsync.transport.net import confine, interface_of, listening_sockets
from weightsync.transport.records import Region

log = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
DEFAULT_PROTOCOL = "auto"
PROTOCOLS = ("auto", "tcp", "rdma")
IB_SYSFS = Path("/sys/class/infiniband")
FORCE_TCP_ENV = "MC_FORCE_TCP"
"""Mooncake's own variable (read by Mooncake from the process environment): TCP whatever else."""


def active_rdma_ports(device: str = "", root: Path | None = None) -> list[str]:
    """``device:port`` of every RDMA port in state ACTIVE (``/sys/class/infiniband/*/ports/*/state``,
    or under ``root``), among the comma-separated ``device`` names when given (Mooncake's filter)."""
    wanted = {d.strip() for d in device.split(",") if d.strip()}
    out = []
    for state in sorted((root or IB_SYSFS).glob("*/ports/*/state")):
        dev, port = state.parts[-4], state.parts[-2]
        if wanted and dev not in wanted:
            continue
        with contextlib.suppress(OSError):
            if "ACTIVE" in state.read_text():
                out.append(f"{dev}:{port}")
    return out


def choose_protocol(requested: str, device: str = "", *, environ: Mapping[str, str] | None = None,
                    root: Path | None = None) -> tuple[str, str]:
    """The protocol Mooncake will run and why, for ``requested`` (module docstring).

    Returns:
        ``(protocol, reason)``: ``rdma`` or ``tcp``, and one line saying why.

    Raises:
        ValueError: ``requested`` is none of :data:`PROTOCOLS`.
    """
    if requested not in PROTOCOLS:
        raise ValueError(f"Mooncake protocol {requested!r}: choose one of {', '.join(PROTOCOLS)}")
    env = os.environ if environ is None else environ
    if env.get(FORCE_TCP_ENV, "").strip() not in ("", "0"):
        return "tcp", f"{FORCE_TCP_ENV} is set: Mooncake uses tcp"
    if requested == "tcp":
        return "tcp", "tcp asked for"
    ports = active_rdma_ports(device, root)
    where = f"{root or IB_SYSFS}" + (f" (devices {device})" if device else "")
    if ports:
        return "rdma", f"RDMA port(s) {', '.join(ports)} active"
    if requested == "rdma":
        return "tcp", f"rdma asked for, but no RDMA port is ACTIVE under {where}: Mooncake runs over TCP"
    return "tcp", f"no RDMA port is ACTIVE under {where}: Mooncake uses tcp (slow between hosts; check the NICs)"


@functools.cache
def _say(protocol: str, reason: str) -> None:
    """Say the choice once per process: loudly when it is TCP for want of RDMA."""
    if protocol == "tcp" and ("no RDMA" in reason or "asked for, but" in reason):
        log.warning("Mooncake protocol: %s", reason)
    else:
        log.info("Mooncake protocol %s: %s", protocol, reason)


@functools.cache
def mooncake_available() -> bool:
    """True when ``mooncake.engine`` imports (package and its system libraries are installed)."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


CUDA_BUILDS = ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine")
"""Mooncake's distributions whose engine registers GPU memory (CUDA 13, and PyPI's default CUDA 12
build); ``mooncake-transfer-engine-non-cuda`` does not."""


@functools.cache
def mooncake_build() -> str | None:
    """The installed Mooncake distribution (one of :data:`CUDA_BUILDS` or the non-CUDA one), or None."""
    from importlib.metadata import PackageNotFoundError, version

    for name in (*CUDA_BUILDS, "mooncake-transfer-engine-non-cuda"):
        with contextlib.suppress(PackageNotFoundError):
            version(name)
            return name
    return None


def _engine_class() -> Any:
    if not mooncake_available():
        raise RuntimeError(
            "mooncake transport needs the Mooncake TransferEngine: pip install "
            "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine-cuda13 (GPU) (both need the Debian "
            "packages libibverbs1 librdmacm1 ibverbs-providers libnuma1 libcurl4)"
        )
    from mooncake.engine import TransferEngine

    return TransferEngine


DEFAULT_WORKERS = 4
"""Batches in flight at once (miles' ``--p2p-transfer-num-workers`` default)."""
CLOSE_GRACE_S = 5.0


@dataclass(eq=False, kw_only=True)
class MooncakeHandle(WriteHandle):
    future: Future[int]
    session_id: str
    timed_out: bool = False


class MooncakeTransport(Transport):
    """One-sided writes through a Mooncake TransferEngine (see module docstring)."""

    kind: ClassVar[str] = "mooncake"
    opens_ports: ClassVar[bool] = True
    sglang_native: ClassVar[bool] = True

    @classmethod
    def serves(cls, device_type: str) -> bool:
        """Host memory always; GPU memory with a CUDA build of Mooncake (:data:`CUDA_BUILDS`)."""
        return device_type == "cpu" or mooncake_build() in CUDA_BUILDS

    @classmethod
    def device_memory_hint(cls) -> str:
        return (f" (the installed Mooncake is {mooncake_build() or 'none'}; GPU memory needs "
                f"{CUDA_BUILDS[0]}==0.3.14: scripts/setup.sh installs it where nvidia-smi lists a GPU)")

    @classmethod
    def config_options(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return {"protocol": cfg["mooncake_protocol"], "device": cfg["mooncake_device"],
                "hostname": cfg["mooncake_hostname"]}

    def __init__(
        self,
        *,
        protocol: str = DEFAULT_PROTOCOL,
        device: str = "",
        hostname: str = "127.0.0.1",
        workers: int = DEFAULT_WORKERS,
        close_grace_s: float = CLOSE_GRACE_S,
        engine_factory: Callable[[], Any] | None = None,
    ) -> None:
        """Args:
        protocol: ``auto`` (RDMA where a port is active, else TCP), ``tcp`` or ``rdma``
            (:func:`choose_protocol`; the result is :attr:`protocol`).
        device: RDMA device name(s) (``mlx5_0``); empty: all.
        hostname: this host's address as peers reach it (an IP on multi-host runs).
        workers: batches in flight at once (>= 1; 1 serializes the writes).
        close_grace_s: how long :meth:`close` waits for writes still in flight.
        engine_factory: builds the TransferEngine (default: Mooncake's; tests pass a fake).

        Raises:
            ValueError: ``workers < 1`` or a negative ``close_grace_s``.
            RuntimeError: Mooncake is missing or the engine fails to start.
        """
        super().__init__()
        if workers < 1:
            raise ValueError(f"mooncake workers must be >= 1, got {workers}")
        if close_grace_s < 0:
            raise ValueError(f"close_grace_s must be >= 0, got {close_grace_s}")
        chosen, reason = choose_protocol(protocol, device)
        _say(chosen, reason)
        self.protocol, self.device, self.hostname = chosen, device, hostname
        self.workers, self.close_grace_s = workers, close_grace_s
        self._engine = (engine_factory or _engine_class())()
        before = {lst.inode for lst in listening_sockets()}
        ret = self._engine.initialize(hostname, P2P_HANDSHAKE, chosen, device)
        if ret != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {chosen!r}, {device!r}) "
                f"returned {ret}: check the protocol/device (MOONCAKE_PROTOCOL, MOONCAKE_DEVICE)"
            )
        self._port = int(self._engine.get_rpc_port())
        self.interface = self._confine(before)
        self._async = hasattr(self._engine, "batch_transfer_async_write")
        self._cv = threading.Condition()
        self._active: deque[tuple[Future[int], int]] = deque()
        """Submitted batches, oldest first (at most ``workers``)."""
        self._queued: deque[tuple[Future[int], str, list[int], list[int], list[int]]] = deque()
        """Writes waiting for a slot."""
        self._in_flight: set[Future[int]] = set()
        self._abandoned: list[MooncakeHandle] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._worker, name="weightsync-mooncake", daemon=True)
        self._thread.start()

    def _confine(self, before: set[int]) -> str | None:
        """Confine the listeners ``initialize`` opened (RPC/handshake and TCP data ports, bound to
        every interface by Mooncake in P2P mode) to the interface holding :attr:`hostname`;
        returns its name, or None when no local interface holds that address (then they listen
        everywhere, and the engine's documentation says what that exposes)."""
        opened = [lst for lst in listening_sockets() if lst.inode not in before and lst.wildcard]
        if not opened:
            return None
        iface = interface_of(self.hostname)
        if iface is None:
            log.warning("Mooncake listens on every interface (ports %s): no interface of this host holds %r",
                        sorted(lst.port for lst in opened), self.hostname)
            return None
        confine(opened, iface)
        log.info("Mooncake listeners (ports %s) confined to interface %s (%s)",
                 sorted(lst.port for lst in opened), iface, self.hostname)
        return iface

    @property
    def session_id(self) -> str:
        return f"{self.hostname}:{self._port}"

    def _register(self, region: Region) -> Region:
        ret = self._engine.register_memory(region.addr, region.nbytes)
        if ret != 0:
            raise RuntimeError(
                f"Mooncake register_memory of region {region.name!r} "
                f"({region.nbytes} bytes at {region.addr:#x}) returned {ret}"
            )
        return region

    def _start(self, future: Future[int], session: str, src: list[int], dst: list[int], n: list[int]) -> None:
        """Submit one batch (a Mooncake call that returns at once); caller holds the lock."""
        if not future.set_running_or_notify_cancel():
            return
        try:
            if not self._async:
                self._finish(future, int(self._engine.batch_transfer_sync_write(session, src, dst, n)))
                return
            batch_id = self._engine.batch_transfer_async_write(session, src, dst, n)
        except BaseException as exc:  # handed to the waiter, which raises it
            self._finish(future, exc=exc)
            return
        if not batch_id:  # Mooncake's failure sentinel: the segment would not open, or the submit failed
            self._finish(future, -1)
        else:
            self._active.append((future, batch_id))
            self._cv.notify_all()

    def _worker(self) -> None:
        """Wait for the oldest batch in flight (``get_batch_transfer_status`` blocks, GIL released,
        busy-polling), then submit the queued ones that now fit; one thread, so one core polls
        however many batches are in flight."""
        while True:
            with self._cv:
                while not self._active and not self._stopping:
                    self._cv.wait()
                if not self._active:
                    return
                future, batch_id = self._active[0]
            try:
                ret: int | BaseException = int(self._engine.get_batch_transfer_status([batch_id]))
            except BaseException as exc:  # handed to the waiter, which raises it
                ret = exc
            with self._cv:
                self._active.popleft()
                if isinstance(ret, BaseException):
                    self._finish(future, exc=ret)
                else:
                    self._finish(future, ret)
                while self._queued and len(self._active) < self.workers:
                    self._start(*self._queued.popleft())

    def _finish(self, future: Future[int], ret: int = 0, exc: BaseException | None = None) -> None:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(ret)
        self._in_flight.discard(future)

    def _submit(self, batch: WriteBatch) -> MooncakeHandle:
        src, dst, n = (col.tolist() for col in batch.runs.T)
        session = batch.peer.session_id
        future: Future[int] = Future()
        with self._cv:
            self._in_flight.add(future)
            if len(self._active) < self.workers and not self._queued:
                self._start(future, session, src, dst, n)
            else:
                self._queued.append((future, session, src, dst, n))
        return MooncakeHandle(nbytes=batch.nbytes, future=future, session_id=session)

    def _wait(self, handle: WriteHandle, deadline: float) -> None:
        assert isinstance(handle, MooncakeHandle)
        try:
            ret = handle.future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            # The handle stays valid (a later wait may still see it finish); close() will not
            # wait for it.
            if not handle.timed_out:
                handle.timed_out = True
                self._abandoned.append(handle)
            raise TimeoutError(timeout_message(self.kind, handle, deadline)) from None
        if ret != 0:
            raise RuntimeError(
                f"Mooncake batch write to {handle.session_id!r} ({handle.nbytes} bytes) returned {ret}: "
                f"the peer is unreachable or rejected an address (see the engine log above)"
            )

    def _close(self) -> None:
        """Stop the worker; wait up to ``close_grace_s`` for writes in flight (not for one that
        already timed out), then unregister, unless a write may still read the memory."""
        with self._cv:
            self._stopping = True
            for item in self._queued:
                item[0].cancel()  # never submitted: they never start
                self._in_flight.discard(item[0])
            self._queued.clear()
            pending = set(self._in_flight)
            self._cv.notify_all()
        stuck = {h.future for h in self._abandoned}
        end = time.monotonic() + self.close_grace_s
        for f in pending - stuck:
            try:
                f.result(timeout=max(end - time.monotonic(), 0.0))
            except TimeoutError:
                stuck.add(f)
            except Exception:  # its waiter reports the failure; close only needs it finished
                continue
        stuck = {f for f in stuck if not f.done()}
        if stuck:
            log.warning(
                "closing the mooncake transport with %d write(s) still in flight: their memory stays registered "
                "(a Mooncake batch cannot be cancelled)",
                len(stuck),
            )
            return  # the engine stays alive with its registrations; the daemon worker holds it
        errors = []
        for r in self.regions:
            ret = self._engine.unregister_memory(r.addr)
            if ret != 0:
                errors.append(f"{r.name!r} ({ret})")
        self._engine = None
        if errors:
            raise RuntimeError(f"Mooncake unregister_memory failed for regions {', '.join(errors)}")
