"""The broadcast sender (the baseline): gather full tensors on one rank per stage, broadcast them.

For each bucket of the broadcast plan, the stage source (the lowest rank of a PP stage) pulls
the pieces it lacks from the other ranks of its stage over the trainer's process group,
assembles the full HF tensors, converts them to the engines' storage format (fp8 block
quantization and its ``weight_scale_inv`` where the engine stores fp8), and broadcasts them one
by one over the weight-update group it shares with every rollout rank (sglang's
``/update_weights_from_distributed`` receives them in the same order).

Which rank contributes which piece is a pure function of the layouts (the source's own pieces
first, then the lowest rank holding each missing region), so every rank knows what to send
without being told.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightsync.layout.box import LocalTensor, Piece, box_intersect, box_slices, box_volume
from weightsync.models.spec import ModelSpec
from weightsync.plan.broadcast import megatron_stage, stage_sources, wire_dtypes
from weightsync.plan.inputs import PlanInputs
from weightsync.quant.fp8 import quantize_block_fp8
from weightsync.transport.group import new_weight_update_group

log = logging.getLogger(__name__)

Contribution = tuple[int, str, Piece]
"""``(trainer rank, its local tensor name, the piece it contributes)``."""
Allocator = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
"""``alloc(name, shape, dtype)``: the memory a full tensor is gathered into."""



def contributions(inputs: PlanInputs, source: int, names: set[str]) -> dict[str, list[Contribution]]:
    """For each global tensor in ``names`` gathered by ``source``: who contributes which piece.

    The source's own pieces come first; then ranks of the same stage in ascending order add
    every piece that does not meet one already taken (replicas of a taken piece are skipped).

    Raises:
        ValueError: two ranks hold partially overlapping pieces (the layouts are inconsistent),
            or a tensor is not fully covered by the stage.
    """
    stage_of = megatron_stage(inputs)
    stage = stage_of(source)
    ranks = [source] + [r for r in range(inputs.train.world_size) if r != source and stage_of(r) == stage]
    taken: dict[str, list[Contribution]] = defaultdict(list)
    for r in ranks:
        for t in inputs.source_layouts[r]:
            for p in t.pieces:
                if p.global_name not in names:
                    continue
                hit = [c for c in taken[p.global_name] if box_intersect(c[2].global_box, p.global_box) is not None]
                if not hit:
                    taken[p.global_name].append((r, t.name, p))
                elif any(c[2].global_box != p.global_box for c in hit):
                    raise ValueError(f"{p.global_name}: rank {r} holds {p.global_box}, which partly overlaps "
                                     f"{hit[0][2].global_box} of rank {hit[0][0]}")
    for name in names:
        g = inputs.globals[name]
        got = sum(box_volume(c[2].global_box) for c in taken.get(name, []))
        if got != g.numel:
            raise ValueError(f"{name}: stage {stage} holds {got} of its {g.numel} elements")
    return dict(taken)



class BroadcastSender:
    """One trainer rank's part of the broadcast path (see the module docstring).

    Every rank of the trainer calls :meth:`send_bucket` with the same names, in the same order
    (it hangs otherwise): sources gather and broadcast, the others send their pieces.
    """

    def __init__(self, spec: ModelSpec, inputs: PlanInputs, rank: int, layout: Sequence[LocalTensor],
                 params: Mapping[str, torch.Tensor], *, group: Mapping[str, Any] | None, device: str,
                 pg: Any = None) -> None:
        """Join the weight-update group if this rank is a stage source.

        Args:
            spec: the model.
            inputs: planner inputs (both layouts).
            rank: this trainer rank (its rank in ``pg``).
            layout: its local tensors.
            params: its parameters by local name.
            group: ``{"master_address", "master_port", "world_size", "backend", "group_names":
                {source rank: group name}, "ports": {source rank: port}}`` and optionally
                ``"timeout_s"`` (joining, and each broadcast); None: join no
                weight-update group (only :meth:`wire_bucket` / :meth:`full_tensors` are used,
                e.g. to hand the tensors over another way).
            device: ``cpu`` or ``cuda``.
            pg: the trainer ranks' process group the pieces are gathered over (None: the
                default group).
        """
        self.spec = spec
        self.inputs = inputs
        self.rank = rank
        self.params = params
        self.pg = pg
        self.device = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        self.owner = stage_sources(inputs)
        self.wire = wire_dtypes(inputs)
        self.is_source = rank in set(self.owner.values())
        self._layout = {t.name: t for t in layout}
        self.group = None
        if self.is_source and group is not None:
            self.group = new_weight_update_group(
                master_address=group["master_address"], master_port=int(group["ports"][str(rank)]), rank=0,
                world_size=int(group["world_size"]), group_name=group["group_names"][str(rank)],
                backend=group["backend"],
                **({"timeout": datetime.timedelta(seconds=float(group["timeout_s"]))} if "timeout_s" in group else {}))

    def _global(self, rank: int) -> int:
        """The default-group rank of trainer rank ``rank`` (torch's send/recv take those)."""
        return rank if self.pg is None else dist.get_global_rank(self.pg, rank)

    def full_tensors(self, source: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The full tensors ``names`` (of ``source``'s stage) assembled on ``source``, in the
        trainer's dtype; every other rank of the stage sends its pieces and gets {} (collective
        over the stage)."""
        return self._gather(source, list(names))

    def _gather(self, source: int, names: list[str], alloc: Allocator | None = None) -> dict[str, torch.Tensor]:
        """Assemble the full tensors ``names`` on ``source`` (others: send pieces; returns {}),
        each in memory from ``alloc`` (default: a new tensor)."""
        contrib = contributions(self.inputs, source, set(names))
        mine: list[tuple[str, str, Piece]] = []
        incoming: dict[int, list[tuple[str, Piece]]] = defaultdict(list)
        for name in names:
            for r, local, piece in contrib[name]:
                if r == self.rank:
                    mine.append((name, local, piece))
                elif self.rank == source:
                    incoming[r].append((name, piece))
        if self.rank != source:
            if mine:
                flat = torch.cat([self.params[local][box_slices(p.local_box)].reshape(-1) for _, local, p in mine])
                dist.send(flat.cpu() if flat.is_cuda else flat, dst=self._global(source), group=self.pg)
            return {}
        full: dict[str, torch.Tensor] = {}
        for name in names:
            g = self.inputs.globals[name]
            shape, dtype = tuple(g.shape), getattr(torch, g.dtype)
            full[name] = (alloc(name, shape, dtype) if alloc is not None
                          else torch.empty(shape, dtype=dtype, device=self.device))
        for name, local, p in mine:
            full[name][box_slices(p.global_box)] = self.params[local][box_slices(p.local_box)].reshape(
                tuple(b - a for a, b in p.global_box))
        for r, items in sorted(incoming.items()):
            dtype = full[items[0][0]].dtype
            flat = torch.empty(sum(box_volume(p.global_box) for _, p in items), dtype=dtype)
            dist.recv(flat, src=self._global(r), group=self.pg)
            off = 0
            for name, p in items:
                n = box_volume(p.global_box)
                full[name][box_slices(p.global_box)] = flat[off:off + n].view(tuple(b - a for a, b in p.global_box))
                off += n
        return full

    def _to_wire(self, names: list[str], full: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Convert to the engines' storage dtypes; fp8 weights bring their ``_scale_inv``."""
        out: list[tuple[str, torch.Tensor]] = []
        scales: dict[str, torch.Tensor] = {}
        for name in names:
            g = self.inputs.globals[name]
            if g.quant_of is not None:
                continue
            t = full[name]
            wire = self.wire.get(name, g.dtype)
            if wire == "float8_e4m3fn":
                assert g.block is not None
                q, s = quantize_block_fp8(t, g.block)
                out.append((name, q))
                scales[name + "_scale_inv"] = s
            elif str(t.dtype).removeprefix("torch.") != wire:
                out.append((name, t.to(getattr(torch, wire))))
            else:
                out.append((name, t))
        for name in names:  # every fp8 weight's scale follows, in the weights' order (as announced),
            scale = name + "_scale_inv"  # also where the plan's bucket cut put the scale's name in the next one
            if scale in scales:
                out.append((scale, scales[scale]))
        return out

    def wire_bucket(self, names: Sequence[str], alloc: Allocator | None = None,
                    ) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
        """The bucket's tensors in the engines' storage format, per stage source, in the order
        :func:`announcement` lists them: yields ``(source, tensors)`` on that source (others help
        gather and get ``(source, [])``); collective over the trainer ranks. ``alloc(name, shape,
        dtype)`` gives the memory each full tensor is gathered into (a tensor whose wire format is
        the trainer's own goes out in it as it is)."""
        by_source: dict[int, list[str]] = defaultdict(list)
        for n in names:
            by_source[self.owner[n]].append(n)
        for source in sorted(by_source):
            weights = [n for n in by_source[source] if self.inputs.globals[n].quant_of is None]
            full = self._gather(source, weights, alloc)
            yield source, (self._to_wire(by_source[source], full) if self.rank == source else [])

    def send_bucket(self, names: Sequence[str]) -> dict[str, Any]:
        """Gather, convert and broadcast one bucket (collective over the trainer ranks).

        Returns:
            ``{"pack_s", "wire_s", "bytes"}`` of this rank (sources: bytes broadcast).
        """
        t0 = time.perf_counter()
        sent = 0
        wire_s = 0.0
        for source, tensors in self.wire_bucket(names):
            if self.rank != source:
                continue
            tw = time.perf_counter()
            assert self.group is not None
            for _, t in tensors:
                t = t.contiguous()
                # fp8 travels as its bytes: gloo (and older NCCL) have no float8 type
                wire = t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t
                self.group.broadcast(wire, 0).wait()
                sent += t.numel() * t.element_size()
            wire_s += time.perf_counter() - tw
        total = time.perf_counter() - t0
        return {"pack_s": total - wire_s, "wire_s": wire_s, "bytes": sent}

    def close(self) -> None:
        self.group = None


def announcement(inputs: PlanInputs, names: Sequence[str]) -> tuple[list[str], list[str], list[list[int]]]:
    """``(names, dtypes, shapes)`` of a bucket in the order :meth:`BroadcastSender.send_bucket`
    broadcasts them: per source, weights first, then the fp8 scales of that source's weights."""
    owner = stage_sources(inputs)
    wire = wire_dtypes(inputs)
    by_source: dict[int, list[str]] = defaultdict(list)
    for n in names:
        by_source[owner[n]].append(n)
    out_n: list[str] = []
    out_d: list[str] = []
    out_s: list[list[int]] = []
    for source in sorted(by_source):
        group = by_source[source]
        ordered = [n for n in group if inputs.globals[n].quant_of is None]
        ordered += [n + "_scale_inv" for n in ordered if wire.get(n) == "float8_e4m3fn"]
        for n in ordered:
            g = inputs.globals[n]
            out_n.append(n)
            out_d.append(wire.get(n, g.dtype))
            out_s.append(list(g.shape))
    return out_n, out_d, out_s
