"""The p2p planner: every trainer rank writes the bytes each rollout rank needs, directly.

For every destination piece of every rollout rank the planner takes the regions of
:func:`weightsync.plan.regions.dest_regions` (one per source box that covers part of it) and
picks one holder of each region by a **deterministic local rule**:

1. keep the holders on the cheapest path to the receiver (same GPU < same node < network);
2. among those, take number ``(k + e + r + j) mod n`` in rank order, where ``k`` is the
   ordinal of the source global tensor in :func:`weightsync.models.hf.global_tensors`, ``e``
   the engine, ``r`` the rank inside the engine and ``j`` the region's index within its
   destination tensor.

Replicas thus take turns across engines, ranks and tensors, which spreads bytes over senders
and links and makes every replica send, and the rule needs nothing but the layouts: a rank
computes its own ops (:func:`plan_for_rank`) without the whole plan, and gets exactly the
whole plan's ops for that rank, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable

from weightsync.layout.box import LocalTensor
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.ops import CopyOp, coalesce_ops
from weightsync.plan.records import Plan
from weightsync.plan.regions import Region, SourceIndex, dest_regions

# Regions of one destination tensor of one engine rank, in layout order.
TensorRegions = tuple[LocalTensor, list[Region]]


def engine_regions(inputs: PlanInputs, sources: SourceIndex, rank: int,
                   only: set[int] | None = None) -> list[TensorRegions]:
    """The regions of every written tensor of engine rank ``rank`` (derived tensors skipped).

    Args:
        inputs: planner inputs.
        sources: index of the source pieces.
        rank: rank inside one engine.
        only: when given, the indexes (in the rank's layout) of the tensors to cut.

    Returns:
        ``(tensor, regions)`` in layout order.
    """
    out: list[TensorRegions] = []
    for i, t in enumerate(inputs.engine_layouts[rank]):
        if t.derived or (only is not None and i not in only):
            continue
        regions: list[Region] = []
        for p in t.pieces:
            regions.extend(dest_regions(t, p, sources, inputs.globals))
        if regions:
            out.append((t, regions))
    return out


class _Chooser:
    """The holder rule of the module docstring, with placement tiers precomputed."""

    def __init__(self, inputs: PlanInputs) -> None:
        self.ordinal = {name: i for i, name in enumerate(inputs.globals)}
        self.train_dev = [(d.node, d.gpu) for d in inputs.train_devices]
        self.roll_dev = [(d.node, d.gpu) for d in inputs.rollout_devices]
        self.tp = inputs.rollout.tp

    def choose(self, region: Region, d: int, j: int) -> int:
        hs = region.holders
        if len(hs) == 1:
            return 0
        node, gpu = self.roll_dev[d]
        tiers = []
        for h in hs:
            hn, hg = self.train_dev[h.rank]
            tiers.append(0 if (hn == node and hg == gpu) else 1 if hn == node else 2)
        best = min(tiers)
        cands = [i for i, t in enumerate(tiers) if t == best]
        e, r = divmod(d, self.tp)
        return cands[(self.ordinal[region.src_global] + e + r + j) % len(cands)]


def _assign(inputs: PlanInputs, chooser: _Chooser, per_rank: dict[int, list[TensorRegions]],
            dst_ranks: Iterable[int], src_rank: int | None) -> Plan:
    """Pick a holder for every region of every destination rank; build the ops and byte counts."""
    sender = [0] * inputs.train.world_size
    receiver = [0] * inputs.num_dest
    ops: list[CopyOp] = []
    shapes: dict[tuple[int, str], tuple[int, ...]] = {}

    def src_shape(rank: int, name: str) -> tuple[int, ...]:
        if not shapes:
            shapes.update({(r, t.name): t.shape for r, ts in enumerate(inputs.source_layouts) for t in ts})
        return shapes[(rank, name)]

    tp = inputs.rollout.tp
    for d in dst_ranks:
        for _, regions in per_rank[d % tp]:
            tensor_ops = []
            for j, reg in enumerate(regions):
                i = chooser.choose(reg, d, j)
                h = reg.holders[i]
                if src_rank is not None and h.rank != src_rank:
                    continue
                sbox, zc = reg.source_box(i)
                tensor_ops.append(CopyOp(reg.global_name, reg.global_box, h.rank, h.tensor.name, sbox, d,
                                         reg.dst_param, reg.dst_box, reg.transform, zc))
                sender[h.rank] += reg.nbytes
                receiver[d] += reg.nbytes
            if len(tensor_ops) > 1:
                tensor_ops = coalesce_ops(tensor_ops, src_shape)
            ops.extend(tensor_ops)
    return Plan(mode="p2p", ops=tuple(ops), sender_bytes=tuple(sender), receiver_bytes=tuple(receiver),
                src_rank=src_rank)


def plan_p2p(inputs: PlanInputs, sources: SourceIndex | None = None) -> Plan:
    """The whole p2p plan: every rollout rank's ops, in rollout-rank order.

    Args:
        inputs: planner inputs.
        sources: a prebuilt index of ``inputs.source_layouts`` (built when omitted).

    Returns:
        The plan.

    Raises:
        ValueError: a destination piece that no source covers, an unknown global tensor, or fp8
            regions that are not whole blocks (the message names the tensor).
    """
    if sources is None:
        sources = SourceIndex(enumerate(inputs.source_layouts))
    per_rank = {r: engine_regions(inputs, sources, r) for r in range(inputs.rollout.tp)}
    return _assign(inputs, _Chooser(inputs), per_rank, range(inputs.num_dest), None)


def plan_p2p_for_rank(inputs: PlanInputs, *, src_rank: int | None = None, dst_rank: int | None = None,
                      sources: SourceIndex | None = None) -> Plan:
    """One rank's share of :func:`plan_p2p`: the ops it sends (``src_rank``) or receives (``dst_rank``).

    Equal to filtering the whole plan's ops by that rank, in the same order, but it cuts only the
    destination pieces that involve the rank.

    Args:
        inputs: planner inputs.
        src_rank: a trainer rank, or
        dst_rank: a rollout rank (exactly one of the two).
        sources: a prebuilt index of ``inputs.source_layouts``.

    Returns:
        A partial plan (``sender_bytes``/``receiver_bytes`` count only its ops).
    """
    if (src_rank is None) == (dst_rank is None):
        raise ValueError("give exactly one of src_rank and dst_rank")
    if sources is None:
        sources = SourceIndex(enumerate(inputs.source_layouts))
    chooser = _Chooser(inputs)
    tp = inputs.rollout.tp
    if dst_rank is not None:
        if not 0 <= dst_rank < inputs.num_dest:
            raise ValueError(f"dst_rank {dst_rank} outside the {inputs.num_dest} rollout ranks")
        per_rank = {dst_rank % tp: engine_regions(inputs, sources, dst_rank % tp)}
        plan = _assign(inputs, chooser, per_rank, [dst_rank], None)
        return Plan(mode="p2p", ops=plan.ops, sender_bytes=plan.sender_bytes, receiver_bytes=plan.receiver_bytes,
                    dst_rank=dst_rank)
    assert src_rank is not None
    if not 0 <= src_rank < inputs.train.world_size:
        raise ValueError(f"src_rank {src_rank} outside the {inputs.train.world_size} trainer ranks")
    needed = _tensors_touching(inputs, src_rank)
    per_rank = {r: engine_regions(inputs, sources, r, needed[r]) for r in range(tp)}
    return _assign(inputs, chooser, per_rank, range(inputs.num_dest), src_rank)


def _tensors_touching(inputs: PlanInputs, src_rank: int) -> dict[int, set[int]]:
    """Per engine rank, the indexes of the tensors that need a global tensor ``src_rank`` holds."""
    held = {p.global_name for t in inputs.source_layouts[src_rank] if not t.derived for p in t.pieces}
    gl = inputs.globals
    out: dict[int, set[int]] = {}
    for r, tensors in enumerate(inputs.engine_layouts):
        idx = set()
        for i, t in enumerate(tensors):
            if t.derived:
                continue
            for p in t.pieces:
                g = gl.get(p.global_name)
                if p.global_name in held or (g is not None and g.quant_of in held):
                    idx.add(i)
                    break
        out[r] = idx
    return out
