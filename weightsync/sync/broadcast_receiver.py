"""The broadcast update path, receiving side: a process group with the trainer, full HF tensors in.

sglang's ``/init_weights_update_group``, ``/update_weights_from_distributed`` and
``/destroy_weights_update_group``. The trainer's source rank is rank 0 of a group of
``world_size`` ranks; engine rank ``r`` joins as ``rank_offset + r``. For every announced
``(name, dtype, shape)``, in order, rank 0 broadcasts the full global tensor and each engine rank
keeps its own pieces (:func:`weightsync.sync.params.write_global`).

fp8 engines accept either the bf16 weight (quantized on arrival, its scale written with it) or
the float8 weight followed or preceded by its ``weight_scale_inv``.

Both sides build the group the same way: :func:`weightsync.transport.group.new_weight_update_group`
(rank 0 hosts the TCP store).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from weightsync.models.dtypes import torch_dtype
from weightsync.models.hf import global_tensors
from weightsync.models.spec import ModelSpec
from weightsync.sync.params import ParamStore, write_global
from weightsync.transport.group import new_weight_update_group

logger = logging.getLogger(__name__)


def check_update_request(spec: ModelSpec, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
    """Refuse an announcement that does not match the model's global tensors.

    Raises:
        ValueError: lists of different lengths, unknown names, unknown dtypes or wrong shapes
            (all offenders named).
    """
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    table = global_tensors(spec)
    problems = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if name not in table:
            problems.append(f"{name}: not a tensor of {spec.name}")
            continue
        try:
            torch_dtype(dtype)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
        if tuple(shape) != table[name].shape:
            problems.append(f"{name}: shape {list(shape)} (expected {list(table[name].shape)})")
    if problems:
        raise ValueError(f"update_weights_from_distributed refused {len(problems)} tensors: " + "; ".join(problems))


class BroadcastReceiver:
    """The update groups of one engine rank, by name."""

    def __init__(self, store: ParamStore, spec: ModelSpec, rank: int) -> None:
        self.store = store
        self.spec = spec
        self.rank = rank
        self._groups: dict[str, tuple[dist.ProcessGroup, str]] = {}

    def init_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> str:
        """Join group ``group_name`` as ``rank_offset + rank`` (collective with the trainer)."""
        if group_name in self._groups:
            raise ValueError(f"weight update group {group_name!r} exists; destroy it first")
        pg = new_weight_update_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset + self.rank,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        self._groups[group_name] = (pg, backend)
        return f"joined {group_name!r} as rank {rank_offset + self.rank} of {world_size} ({backend})"

    def receive(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str) -> dict:
        """Receive each announced tensor from group rank 0 and write this rank's pieces.

        The announcement is checked by :func:`check_update_request` on rank 0 before this runs.

        Raises:
            ValueError: unknown group.
        """
        if group_name not in self._groups:
            raise ValueError(f"no weight update group {group_name!r} (call /init_weights_update_group first)")
        pg, backend = self._groups[group_name]
        device = torch.device("cpu") if backend == "gloo" else self.store.device
        t0 = time.perf_counter()
        nbytes = 0
        for name, dtype, shape in zip(names, dtypes, shapes):
            want = torch_dtype(dtype)
            # fp8 travels as its bytes: gloo (and older NCCL) have no float8 type
            fp8 = want.is_floating_point and want.itemsize == 1
            buf = torch.empty(shape, dtype=torch.uint8 if fp8 else want, device=device)
            pg.broadcast(buf, 0).wait()
            buf = buf.view(want) if fp8 else buf
            nbytes += buf.numel() * buf.element_size()
            write_global(self.store, self.spec, name, lambda box, t=buf: t[tuple(slice(a, b) for a, b in box)])
        seconds = time.perf_counter() - t0
        return {"num_tensors": len(names), "nbytes": nbytes, "seconds": seconds}

    def destroy_group(self, group_name: str) -> str:
        """Leave group ``group_name``."""
        entry = self._groups.pop(group_name, None)
        if entry is None:
            raise ValueError(f"no weight update group {group_name!r}")
        pg, _ = entry
        shutdown = getattr(pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        return f"destroyed {group_name!r}"

    def close(self) -> None:
        for name in list(self._groups):
            self.destroy_group(name)
