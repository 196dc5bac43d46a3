"""The broadcast update path, receiving side: a process group with the trainer, full HF tensors in.

sglang's ``/init_weights_update_group``, ``/update_weights_from_distributed`` and
``/destroy_weights_update_group``. The trainer's source rank is rank 0 of a group of
``world_size`` ranks; engine rank ``r`` joins as ``rank_offset + r``. For every announced
``(name, dtype, shape)``, in order, rank 0 broadcasts the full global tensor and each engine rank
keeps its own pieces (:func:`weightsync.sync.params.write_global`).

fp8 engines accept either the bf16 weight (quantized on arrival, its scale written with it) or
the float8 weight followed or preceded by its ``weight_scale_inv``.

The group is built as sglang's engine and miles' trainer build theirs
(:func:`weightsync.transport.group.new_weight_update_group`; rank 0 hosts the TCP store), so the
trainer may be weightsync's or miles'.

Deadlines: joining is bounded by ``timeout_s`` (a master nobody listens on fails after it, naming
the address) and can run in the background (:meth:`BroadcastReceiver.start_init`, polled with
:meth:`BroadcastReceiver.init_status`), so that an engine keeps generating while a trainer is
slow to come; every tensor of a receive must arrive within the receive's deadline, and the
error names the tensor and the group. Announcements are checked before anything is received:
each dtype must be the parameter's own (no silent casts), each shape its shape.

Cancellation: a receive whose source is gone (a trainer that gave up on a broadcast after another
engine died) would wait for its deadline, and the engine's calls queue behind it. Each receive
carries the value of a counter its engine's ranks share (:attr:`BroadcastReceiver.cancel`) when
the call was accepted; rank 0 bumps it (:meth:`BroadcastReceiver.cancel_receives`) when the
update session is aborted or the group destroyed, and every rank's receive then ends within
:data:`CANCEL_POLL_S`, naming why. A group whose receive was cancelled is never used again:
it is destroyed (the trainer opens new groups for the engines that still take part).
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from weightsync.layout.sglang import engine_layout
from weightsync.models.dtypes import torch_dtype
from weightsync.models.hf import GlobalTensor, global_tensors
from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import ModelSpec
from weightsync.sync.params import ParamStore, write_global
from weightsync.transport.group import new_weight_update_group

logger = logging.getLogger(__name__)


FP8_DTYPE = "float8_e4m3fn"

CANCEL_POLL_S = 0.1
"""How often a receive in flight checks whether it was cancelled."""


class ReceiveCancelled(RuntimeError):
    """A receive ended because its update session was aborted or its group destroyed."""


@functools.cache
def _storage_dtypes(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    """Global tensor -> the dtypes the engine stores its pieces in (sglang's parameters; the
    choice does not depend on the parallel sizes, so one rank of TP 1 holding everything tells)."""
    seen: dict[str, set[str]] = {}
    for t in engine_layout(spec, RolloutParallel(), 0):
        for p in t.pieces:
            seen.setdefault(p.global_name, set()).add(t.dtype)
    return {name: tuple(sorted(d)) for name, d in seen.items()}


@functools.cache
def _global_table(spec: ModelSpec) -> dict[str, GlobalTensor]:
    """:func:`~weightsync.models.hf.global_tensors` of ``spec``, built once (read it, never change
    it): every announced bucket is checked against it, and building it takes milliseconds (1.5 ms
    for Qwen3-4B's 398 tensors; looked up per tensor it was 0.49 s of checks per update)."""
    return global_tensors(spec)


@functools.cache
def accepted_dtypes(spec: ModelSpec, name: str) -> tuple[str, ...]:
    """The dtypes an update may announce for global tensor ``name``: the dtype of the engine
    parameter that stores it (what the trainer's broadcast carries: the DSA indexer's ``k_norm``
    and the router's ``e_score_correction_bias`` are float32 in sglang), the checkpoint's own
    (what sglang's loader reads), and for a weight the engine stores in block fp8 also
    ``float8_e4m3fn`` (sent with its ``weight_scale_inv``; the unquantized dtype is quantized on
    arrival). Nothing else is accepted: no int, complex or wider float for a bf16 parameter.

    Raises:
        KeyError: ``name`` is not a tensor of ``spec``.
    """
    t = _global_table(spec)[name]
    out = dict.fromkeys((t.dtype, *_storage_dtypes(spec).get(name, ())))
    if t.block is not None and t.quant_of is None:
        out[FP8_DTYPE] = None
    return tuple(out)


def check_update_request(spec: ModelSpec, names: list[str], dtypes: list[str], shapes: list[list[int]],
                         what: str = "update_weights_from_distributed") -> None:
    """Refuse an announcement that does not match the model's global tensors.

    Raises:
        ValueError: lists of different lengths, unknown names, unknown dtypes, a dtype that is
            not the parameter's (:func:`accepted_dtypes`) or wrong shapes (all offenders named).
    """
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    table = _global_table(spec)
    problems = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if name not in table:
            problems.append(f"{name}: not a tensor of {spec.name}")
            continue
        try:
            torch_dtype(dtype)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
        else:
            want = accepted_dtypes(spec, name)
            if str(dtype).removeprefix("torch.") not in want:
                problems.append(f"{name}: dtype {dtype} (expected {' or '.join(want)}; updates are not cast)")
        if tuple(shape) != table[name].shape:
            problems.append(f"{name}: shape {list(shape)} (expected {list(table[name].shape)})")
    if problems:
        raise ValueError(f"{what} refused {len(problems)} tensors: " + "; ".join(problems))


DEFAULT_TIMEOUT_S = 600.0
REFUSED_GRACE_S = 10.0
"""A weight-update group's master that refuses connections this long is not coming: the join fails
then, instead of at the group deadline (the trainer binds its store before it asks the engines)."""


def refused_fast(host: str, port: int, grace_s: float) -> None:
    """Return once ``host:port`` accepts a TCP connection (closed again at once).

    Raises:
        ConnectionRefusedError: every attempt for ``grace_s`` was refused (nobody listens there).
    """
    end = time.monotonic() + grace_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(1.0, grace_s)):
                return
        except ConnectionRefusedError:
            if time.monotonic() >= end:
                raise ConnectionRefusedError(f"nobody listens on {host}:{port} (connections refused for "
                                             f"{grace_s:.0f} s)") from None
            time.sleep(0.2)
        except OSError:  # unreachable, a timeout: the group's own deadline decides
            return


def _shut_down(pg: dist.ProcessGroup) -> None:
    shutdown = getattr(pg, "shutdown", None)
    if shutdown is not None:
        shutdown()


def _let_go(holder: list[dist.ProcessGroup]) -> None:
    """Shut down and drop the group in ``holder`` (the last reference: its destructor runs here)."""
    pg = holder.pop()
    try:
        _shut_down(pg)
    except Exception as exc:  # a group whose receive was cut off may refuse; it is dropped anyway
        logger.info("shutting down a weight update group after a cut-off receive: %s", exc)
    del pg


class BroadcastReceiver:
    """The update groups of one engine rank, by name."""

    def __init__(self, store: ParamStore | Callable[[], ParamStore], spec: ModelSpec, rank: int, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, bind_host: str | None = None) -> None:
        """Args:
        store: where received pieces are written: a store, or a function returning the one to
            write now (the engine's: its update session's copy).
        spec: the model.
        rank: this engine rank.
        timeout_s: the deadline of a join and of a receive, and the groups' collective timeout.
        bind_host: the local address the groups' gloo pairs listen on (default: the address on
            the route to the master).
        """
        self._store = store
        self.spec = spec
        self.rank = rank
        self.timeout_s = timeout_s
        self.bind_host = bind_host
        self._groups: dict[str, tuple[dist.ProcessGroup, str]] = {}
        self._joining: dict[str, tuple[threading.Thread, list[BaseException]]] = {}
        self._broken: set[str] = set()
        """Groups whose receive failed or was cancelled: gloo may still wait in it."""
        self.cancel: ctypes.c_int64 = ctypes.c_int64(0)
        """The cancel counter (module docstring): this rank's own, or one the engine's ranks share
        (a ``multiprocessing`` ``RawValue``, set by the engine's start-up)."""

    def cancel_receives(self) -> None:
        """End every receive in flight, on every rank sharing :attr:`cancel` (rank 0: an aborted
        session, a destroyed group); receives accepted from here on are not affected."""
        self.cancel.value += 1

    def init_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> str:
        """Join group ``group_name`` as ``rank_offset + rank`` (collective with the trainer; blocks
        at most ``timeout_s``).

        Raises:
            ValueError: the group exists.
            RuntimeError: the rendezvous failed or timed out (naming the master).
        """
        self.start_init(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                        world_size=world_size, group_name=group_name, backend=backend)
        self._joining[group_name][0].join(timeout=self.timeout_s + 5.0)  # the join's own deadline comes first
        status = self.init_status(group_name)
        if status == "pending":
            raise RuntimeError(f"[rank{self.rank}] joining {group_name!r} at {master_address}:{master_port} did not "
                               f"complete within {self.timeout_s:.0f} s")
        if status != "ok":
            raise RuntimeError(status)
        return f"joined {group_name!r} as rank {rank_offset + self.rank} of {world_size} ({backend})"

    def start_init(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> str:
        """Start joining group ``group_name`` in the background (returns at once); poll
        :meth:`init_status`.

        Raises:
            ValueError: the group exists or is being joined.
        """
        if group_name in self._groups or group_name in self._joining:
            raise ValueError(f"weight update group {group_name!r} exists; destroy it first")
        device = (self._store() if callable(self._store) else self._store).device.type
        if backend == "nccl" and device != "cuda":
            raise ValueError(f"backend nccl needs CUDA; this engine's weights are on {device}: use backend gloo")
        errors: list[BaseException] = []
        where = f"{master_address}:{master_port}"

        def join() -> None:
            try:
                if rank_offset + self.rank != 0:  # the master binds it: nobody else waits for a closed port
                    refused_fast(master_address, master_port, min(REFUSED_GRACE_S, self.timeout_s))
                pg = new_weight_update_group(
                    master_address=master_address,
                    master_port=master_port,
                    rank=rank_offset + self.rank,
                    world_size=world_size,
                    group_name=group_name,
                    backend=backend,
                    timeout=datetime.timedelta(seconds=self.timeout_s),
                    bind_host=self.bind_host,
                )
            except Exception as exc:  # reported by init_status
                errors.append(RuntimeError(f"[rank{self.rank}] joining weight update group {group_name!r} at {where} "
                                           f"failed within {self.timeout_s:.0f} s: {exc}"))
                return
            self._groups[group_name] = (pg, backend)

        thread = threading.Thread(target=join, name=f"join-{group_name}", daemon=True)
        self._joining[group_name] = (thread, errors)
        thread.start()
        return "joining"

    def init_status(self, group_name: str) -> str:
        """``"ok"`` (joined), ``"pending"``, or the failure message (the attempt is then forgotten)."""
        if group_name in self._groups:
            self._joining.pop(group_name, None)
            return "ok"
        entry = self._joining.get(group_name)
        if entry is None:
            return f"[rank{self.rank}] no weight update group {group_name!r} is being joined"
        thread, errors = entry
        if thread.is_alive():
            return "pending"
        self._joining.pop(group_name, None)
        if group_name in self._groups:
            return "ok"
        return str(errors[0]) if errors else f"[rank{self.rank}] joining {group_name!r} ended without a group"

    def abandon_init(self, group_name: str) -> None:
        """Forget a join that timed out on some rank (a group it still completes is destroyed)."""
        self._joining.pop(group_name, None)
        if group_name in self._groups:
            self.destroy_group(group_name)

    def receive(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                epoch: int | None = None) -> dict:
        """Receive each announced tensor from group rank 0 and write this rank's pieces.

        The announcement is checked by :func:`check_update_request` on rank 0 before this runs.
        The whole receive must complete within ``timeout_s``; ``epoch``: :attr:`cancel`'s value
        when the call was accepted (None: never cancelled).

        Raises:
            ValueError: unknown group.
            TimeoutError: a tensor did not arrive in time (named, with the group).
            ReceiveCancelled: :meth:`cancel_receives` was called since (named, with the group).
        """
        if group_name not in self._groups:
            raise ValueError(f"no weight update group {group_name!r} (call /init_weights_update_group first)")
        pg, backend = self._groups[group_name]
        store = self._store() if callable(self._store) else self._store
        device = torch.device("cpu") if backend == "gloo" else store.device
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        nbytes = 0
        for k, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
            want = torch_dtype(dtype)
            # fp8 travels as its bytes: gloo (and older NCCL) have no float8 type
            fp8 = want.is_floating_point and want.itemsize == 1
            buf = torch.empty(shape, dtype=torch.uint8 if fp8 else want, device=device)
            try:
                self._wait(pg.broadcast(buf, 0), backend, deadline,
                           f"[rank{self.rank}] {name} (tensor {k + 1} of {len(names)}) from weight update group "
                           f"{group_name!r}", epoch)
            except BaseException:
                self._broken.add(group_name)
                raise
            buf = buf.view(want) if fp8 else buf
            nbytes += buf.numel() * buf.element_size()
            write_global(store, self.spec, name, lambda box, t=buf: t[tuple(slice(a, b) for a, b in box)])
        seconds = time.perf_counter() - t0
        return {"num_tensors": len(names), "nbytes": nbytes, "seconds": seconds}

    def _wait(self, work: dist.Work, backend: str, deadline: float, what: str, epoch: int | None) -> None:
        """Wait for ``work`` until ``deadline``, ending early once cancelled (module docstring)."""
        pause = 1e-4
        while True:
            remaining = deadline - time.monotonic()
            if backend == "gloo":
                try:
                    work.wait(timeout=datetime.timedelta(seconds=max(min(remaining, CANCEL_POLL_S), 1e-3)))
                    return
                except RuntimeError as exc:
                    if "timed out" not in str(exc).lower():
                        raise
            elif work.is_completed():
                work.wait()
                return
            else:
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
            if epoch is not None and self.cancel.value != epoch:
                raise ReceiveCancelled(f"{what}: cancelled: the update session was aborted or the group destroyed")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what}: not received within {self.timeout_s:.0f} s")

    def destroy_group(self, group_name: str) -> str:
        """Leave group ``group_name``."""
        entry = self._groups.pop(group_name, None)
        if entry is None:
            raise ValueError(f"no weight update group {group_name!r}")
        if group_name in self._broken:
            # a receive on it was cut off: gloo's worker still waits in it (until the group's
            # timeout), and so do the group's shutdown and its destructor -- on a thread of their
            # own that holds the last reference, never on this rank's command loop
            self._broken.discard(group_name)
            holder = [entry[0]]
            del entry
            threading.Thread(target=_let_go, args=(holder,), name=f"destroy-{group_name}", daemon=True).start()
            return f"destroyed {group_name!r} (its cut-off receive ends in the background)"
        _shut_down(entry[0])
        return f"destroyed {group_name!r}"

    def close(self) -> None:
        self._joining.clear()
        for name in list(self._groups):
            self.destroy_group(name)
