"""The broadcast plan: the classic path, as the baseline p2p is measured against.

One source rank per pipeline stage (the lowest rank of the stage) gathers the TP/EP shards of
its stage into full HF tensors, converts them to the rollout's storage format (fp8 block
quantization: weight and ``scale_inv``), packs them into buckets of at most ``bucket_bytes`` and
broadcasts every bucket to every rollout rank; each rollout rank keeps the slices it owns.

The plan expresses that with the same records as p2p: the *gathered* tensors are the source
layout (:func:`gathered_layouts`: stage source ``s`` holds ``LocalTensor(name=G)`` = all of
``G``), and the ops are the copies each receiver makes out of the received buckets. So the
verifier and the simulation treat both modes alike; the byte accounting differs (every receiver
receives the whole model, see :mod:`weightsync.plan.records`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from weightsync.layout.box import LocalTensor, Piece, box_volume, full_box
from weightsync.models.hf import DTYPE_BYTES
from weightsync.plan.cut_table import NameTable, build_cut_table
from weightsync.plan.cuts import Cutter, SourceIndex
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.p2p import HolderRule, assemble, expand, source_globals, tensors_touching
from weightsync.plan.records import Bucket, Mode, Plan

GIB = 1 << 30
"""The unit of every bucket-size knob (``BUCKET_SIZE_GB``, ``--bucket-gb``): GiB, 2**30 bytes."""
DEFAULT_BUCKET_GB = 1.0
"""The reference system's default ``BUCKET_SIZE_GB``, in GiB."""


MAX_BUCKET_GB = 1024
"""The largest bucket size taken (GiB): a bucket is staged in host or device memory."""


def bucket_bytes_from_gb(gb: float | str, *, what: str = "bucket size") -> int:
    """A bucket size in GiB (``BUCKET_SIZE_GB``, ``--bucket-gb``; a number or its text) in bytes:
    ``int(gb * 2**30)``. The one parse of the knob: the environment reader and the flags call it.

    Args:
        gb: the size in GiB.
        what: the knob's name, for the error message.

    Raises:
        ValueError: ``gb`` is not a finite number, is under one byte or over :data:`MAX_BUCKET_GB`
            (the message names ``what``).
    """
    try:
        x = float(gb)
    except ValueError:
        raise ValueError(f"{what} must be a number of GiB (2**30 bytes), got {gb!r}") from None
    if not (math.isfinite(x) and x * GIB >= 1):
        raise ValueError(f"{what} must be a positive number of GiB (2**30 bytes, at least one byte), got {gb!r}")
    if x > MAX_BUCKET_GB:
        raise ValueError(f"{what} must be at most {MAX_BUCKET_GB} GiB (a bucket is staged in memory), got {gb!r}")
    return int(x * GIB)


DEFAULT_BUCKET_BYTES = bucket_bytes_from_gb(DEFAULT_BUCKET_GB)


def megatron_stage(inputs: PlanInputs) -> Callable[[int], int]:
    """Pipeline stage of a trainer rank in Megatron's default rank order (pp outermost)."""
    per_stage = inputs.train.world_size // inputs.train.pp
    return lambda rank: rank // per_stage


def wire_dtypes(inputs: PlanInputs) -> dict[str, str]:
    """Global tensor -> the dtype the broadcast carries it in: the rollout's storage dtype, or the
    global tensor's own dtype when rollout ranks store it in several (they convert on receipt)."""
    seen: dict[str, set[str]] = {}
    for tensors in inputs.engine_layouts:
        for t in tensors:
            if t.derived:
                continue
            for p in t.pieces:
                seen.setdefault(p.global_name, set()).add(t.dtype)
    return {name: next(iter(d)) if len(d) == 1 else inputs.globals[name].dtype for name, d in seen.items()}


def stage_sources(inputs: PlanInputs, stage_of: Callable[[int], int] | None = None) -> dict[str, int]:
    """Global tensor -> the trainer rank that gathers and broadcasts it.

    A tensor belongs to the lowest stage that holds a piece of it (tied embeddings live on the
    first and the last stage), and a stage's source is its lowest rank. Scale tensors go with
    their weight.
    """
    stage_of = stage_of or megatron_stage(inputs)
    first_rank: dict[int, int] = {}
    owner_stage: dict[str, int] = {}
    for rank, tensors in enumerate(inputs.source_layouts):
        st = stage_of(rank)
        first_rank.setdefault(st, rank)
        for t in tensors:
            for p in t.pieces:
                if owner_stage.get(p.global_name, st + 1) > st:
                    owner_stage[p.global_name] = st
    out: dict[str, int] = {}
    for name, g in inputs.globals.items():
        key = g.quant_of if g.quant_of is not None and name not in owner_stage else name
        if key in owner_stage:
            out[name] = first_rank[owner_stage[key]]
    return out


def gathered_layouts(inputs: PlanInputs, stage_of: Callable[[int], int] | None = None
                     ) -> tuple[tuple[LocalTensor, ...], ...]:
    """Per trainer rank, the full tensors it broadcasts (empty for non-sources), in wire dtype."""
    wire = wire_dtypes(inputs)
    src = stage_sources(inputs, stage_of)
    per_rank: list[list[LocalTensor]] = [[] for _ in range(inputs.train.world_size)]
    for name, g in inputs.globals.items():
        if name not in wire or name not in src:
            continue
        box = full_box(g.shape)
        per_rank[src[name]].append(LocalTensor(name=name, shape=g.shape, dtype=wire[name],
                                               pieces=(Piece(name, box, box),)))
    return tuple(tuple(ts) for ts in per_rank)


def _buckets(layouts: tuple[tuple[LocalTensor, ...], ...], bucket_bytes: int) -> tuple[Bucket, ...]:
    out: list[Bucket] = []
    for rank, tensors in enumerate(layouts):
        names: list[str] = []
        size = 0
        for t in tensors:
            nb = box_volume(full_box(t.shape)) * DTYPE_BYTES[t.dtype]
            if names and size + nb > bucket_bytes:
                out.append(Bucket(src_rank=rank, names=tuple(names), nbytes=size))
                names, size = [], 0
            names.append(t.name)
            size += nb
        if names:
            out.append(Bucket(src_rank=rank, names=tuple(names), nbytes=size))
    return tuple(out)


def _gather_bytes(inputs: PlanInputs, gathered: tuple[tuple[LocalTensor, ...], ...]) -> int:
    """Bytes the stage sources pull from other ranks: what of each gathered tensor they lack."""
    sources = {t.name: rank for rank, ts in enumerate(gathered) for t in ts}
    own: dict[str, int] = {}
    itemsize: dict[str, int] = {}
    for rank, tensors in enumerate(inputs.source_layouts):
        for t in tensors:
            for p in t.pieces:
                if sources.get(p.global_name) == rank:
                    own[p.global_name] = own.get(p.global_name, 0) + box_volume(p.global_box)
                itemsize.setdefault(p.global_name, DTYPE_BYTES[t.dtype])
    total = 0
    for name in sources:
        g = inputs.globals[name]
        if name in itemsize:
            total += (g.numel - min(own.get(name, 0), g.numel)) * itemsize[name]
    return total


def plan_broadcast(inputs: PlanInputs, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dst_rank: int | None = None,
                   src_rank: int | None = None, stage_of: Callable[[int], int] | None = None) -> Plan:
    """The broadcast plan, or one rank's share of it (``dst_rank`` or ``src_rank``, not both).

    Args:
        inputs: planner inputs.
        bucket_bytes: bucket size limit (a tensor larger than it gets a bucket of its own).
        dst_rank: only this rollout rank's ops.
        src_rank: only the ops out of this trainer rank's buckets (empty unless it is a stage source).
        stage_of: trainer rank -> PP stage (default: Megatron's order, pp outermost).

    Returns:
        The plan; ``buckets`` lists what each stage source broadcasts (the rank's own for ``src_rank``).
    """
    if dst_rank is not None and src_rank is not None:
        raise ValueError("give at most one of src_rank and dst_rank")
    gathered = gathered_layouts(inputs, stage_of)
    buckets = _buckets(gathered, bucket_bytes)
    tp = inputs.rollout.tp
    dst = list(range(inputs.num_dest)) if dst_rank is None else [dst_rank]
    only: dict[int, set[int] | None] = dict.fromkeys(sorted({d % tp for d in dst}))
    if src_rank is not None:
        only = dict(tensors_touching(inputs, {t.name for t in gathered[src_rank]}))
        buckets = tuple(b for b in buckets if b.src_rank == src_rank)
    whole = dst_rank is None and src_rank is None
    sources = SourceIndex(enumerate(gathered), None if whole else source_globals(inputs, only))
    names = NameTable(inputs.globals)
    cutter = Cutter(sources, inputs.globals)
    tables = {r: build_cut_table(inputs.engine_layouts[r], r, cutter, names, idx) for r, idx in only.items()}
    rule = HolderRule(inputs, names.holders())
    chunks = []
    for d in dst:
        chunks.extend(expand(tables[d % tp], rule, [d], src_rank))
    plan = assemble(Mode.BROADCAST, inputs, names, chunks)
    total = sum(b.nbytes for b in buckets)
    sender = [0] * inputs.train.world_size
    for b in buckets:
        sender[b.src_rank] += b.nbytes
    receiver = tuple(total if d in dst else 0 for d in range(inputs.num_dest))
    return Plan(mode=Mode.BROADCAST, table=plan.table, sender_bytes=tuple(sender), receiver_bytes=receiver,
                dst_rank=dst_rank, src_rank=src_rank, buckets=buckets,
                gather_bytes=_gather_bytes(inputs, gathered) if whole else 0)
