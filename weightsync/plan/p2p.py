"""The p2p planner: every trainer rank writes the bytes each rollout rank needs, directly.

For every destination piece of every rollout rank the planner takes the cuts of
:func:`weightsync.plan.cuts.dest_cuts` (one per source box that covers part of it) and
picks one holder of each cut by a **deterministic local rule**:

1. keep the holders on the cheapest path to the receiver (same GPU < same node < network);
2. among those, take number ``(k + e + r + j) mod n`` in rank order, where ``k`` is the
   ordinal of the source global tensor in :func:`weightsync.models.hf.global_tensors`, ``e``
   the engine, ``r`` the rank inside the engine and ``j`` the cut's index within its
   destination tensor.

Replicas thus take turns across engines, ranks and tensors, which spreads bytes over senders
and links and makes every replica send, and the rule needs nothing but the layouts: a rank
computes its own ops (:func:`plan_p2p_for_rank`) without the whole plan, and gets exactly the
whole plan's ops for that rank, in the same order.

Cuts are made once per engine rank (:mod:`weightsync.plan.cut_table`) and expanded to all
engines with numpy.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from weightsync.plan.cut_table import CutTable, HolderTable, NameTable, build_cut_table
from weightsync.plan.cuts import Cutter, SourceIndex
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.ops import TRANSFORMS
from weightsync.plan.records import Mode, Plan
from weightsync.plan.table import OpTable


class HolderRule:
    """The holder choice of the module docstring, vectorized over one cut table."""

    def __init__(self, inputs: PlanInputs, holders: HolderTable) -> None:
        self.h = holders
        train_node = np.array([d.node for d in inputs.train_devices], dtype=np.int64)
        train_gpu = np.array([d.gpu for d in inputs.train_devices], dtype=np.int64)
        self.h_node = train_node[holders.rank]
        self.h_gpu = train_gpu[holders.rank]
        self.roll = [(d.node, d.gpu) for d in inputs.rollout_devices]
        self.tp = inputs.rollout.tp
        self._multi: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def _multi_rows(self, rt: CutTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Cuts with several holders: (their indexes, flat holder rows, cut of each row, first row)."""
        got = self._multi.get(id(rt))
        if got is None:
            multi = np.flatnonzero(rt.h_count > 1)
            counts = rt.h_count[multi]
            first = np.cumsum(counts) - counts
            cut_of = np.repeat(np.arange(len(multi)), counts)
            flat = rt.h_start[multi][cut_of] + (np.arange(int(counts.sum())) - first[cut_of])
            got = self._multi[id(rt)] = (multi, flat, cut_of, first)
        return got

    def choose(self, rt: CutTable, d: int) -> np.ndarray:
        """Holder row chosen for each cut of ``rt`` when the receiver is rollout rank ``d``."""
        multi, flat, cut_of, first = self._multi_rows(rt)
        if len(multi) == 0:
            return rt.h_start
        e, r = divmod(d, self.tp)
        node, gpu = self.roll[d]
        same_node = self.h_node[flat] == node
        tier = 2 - same_node.astype(np.int64) - (same_node & (self.h_gpu[flat] == gpu))
        best = np.minimum.reduceat(tier, first)
        is_cand = tier == best[cut_of]
        ncand = np.add.reduceat(is_cand.astype(np.int64), first)
        k = (rt.src_ord[multi] + e + r + rt.j[multi]) % ncand
        csum = np.cumsum(is_cand)
        before = csum[first] - is_cand[first]  # candidates before each cut's first row
        pos = np.flatnonzero(is_cand & (csum - 1 - before[cut_of] == k[cut_of]))
        assert len(pos) == len(multi)
        chosen = rt.h_start.copy()
        chosen[multi] = flat[pos]
        return chosen


def expand(rt: CutTable, rule: HolderRule, dst_ranks: Iterable[int], src_rank: int | None
           ) -> list[dict[str, np.ndarray]]:
    """Op columns for the cuts of ``rt`` received by each of ``dst_ranks`` (one chunk per rank)."""
    hs = rule.h
    chunks = []
    for d in dst_ranks:
        h = rule.choose(rt, d)
        if src_rank is None:
            sel: np.ndarray = np.arange(len(rt))
        else:
            sel = np.flatnonzero(hs.rank[h] == src_rank)
            h = h[sel]
        chunks.append(coalesce_chunk(rt, sel, {
            "gid": rt.gid[sel], "src_rank": hs.rank[h], "src_pid": hs.pid[h],
            "dst_rank": np.full(len(h), d, dtype=np.int32), "dst_pid": rt.dst_pid[sel],
            "transform": rt.transform[sel], "zero_copy": hs.zc[h],
            "g_lo": rt.g_lo[sel], "g_hi": rt.g_hi[sel], "g_nd": rt.g_nd[sel],
            "s_lo": hs.s_lo[h], "s_hi": hs.s_hi[h], "s_nd": hs.s_nd[h],
            "d_lo": rt.d_lo[sel], "d_hi": rt.d_hi[sel], "d_nd": rt.d_nd[sel],
            "nbytes": rt.nbytes[sel],
        }))
    return chunks


def _adjacent_dim(a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray) -> np.ndarray:
    """Per row pair: the dim along which box b directly follows box a (equal elsewhere), else -1."""
    same = (a_lo == b_lo) & (a_hi == b_hi)
    follows = (a_hi == b_lo) & ~same
    ok = (same.sum(axis=1) == same.shape[1] - 1) & follows.any(axis=1)
    return np.where(ok, np.argmax(follows, axis=1), -1)


def coalesce_chunk(rt: CutTable, sel: np.ndarray, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Merge ops of consecutive cuts of one destination tensor that continue each other.

    Rows ``i-1`` and ``i`` merge when they come from consecutive cuts (``sel``) of the same
    destination tensor, read the same source tensor, write the same global tensor with the same
    transform (never ``fp8_scale``), and their global, source and destination boxes all follow
    each other along the same dim. A chain merges along one dim only. The rule looks at two
    cuts and their chosen holders only, so a per-rank plan merges exactly as the whole plan.
    """
    n = len(sel)
    if n < 2:
        return cols
    link = np.zeros(n, dtype=bool)
    link[1:] = ((sel[1:] == sel[:-1] + 1) & (rt.j[sel[1:]] == rt.j[sel[:-1]] + 1)
                & (cols["src_rank"][1:] == cols["src_rank"][:-1]) & (cols["src_pid"][1:] == cols["src_pid"][:-1])
                & (cols["gid"][1:] == cols["gid"][:-1]) & (cols["transform"][1:] == cols["transform"][:-1])
                & (cols["transform"][1:] != TRANSFORMS.index("fp8_scale")))
    cand = np.flatnonzero(link)
    if len(cand) == 0:
        return cols
    dims = [_adjacent_dim(cols[f"{b}_lo"][cand - 1], cols[f"{b}_hi"][cand - 1], cols[f"{b}_lo"][cand],
                          cols[f"{b}_hi"][cand]) for b in ("g", "s", "d")]
    good = (dims[0] >= 0) & (dims[0] == dims[1]) & (dims[0] == dims[2])
    link[cand] = good
    dim = np.full(n, -1)
    dim[cand] = dims[0]
    for i in np.flatnonzero(link):  # a chain continues along one dim only
        if link[i - 1] and dim[i - 1] != dim[i]:
            link[i] = False
    starts = np.flatnonzero(~link)
    ends = np.append(starts[1:], n) - 1
    out = {k: v[starts] for k, v in cols.items()}
    for b in ("g", "s", "d"):
        out[f"{b}_hi"] = cols[f"{b}_hi"][ends]
    out["nbytes"] = np.add.reduceat(cols["nbytes"], starts)
    out["zero_copy"] = np.logical_and.reduceat(cols["zero_copy"], starts)
    return out


def assemble(mode: Mode, inputs: PlanInputs, names: NameTable, chunks: list[dict[str, np.ndarray]],
             **plan_fields: object) -> Plan:
    """Concatenate op chunks into a plan; per-rank bytes count the chunks' ops."""
    cols = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]} if chunks else None
    if cols is None or len(cols["gid"]) == 0:
        cols = _empty_columns()
    nbytes = cols.pop("nbytes")
    sender = np.bincount(cols["src_rank"], weights=nbytes, minlength=inputs.train.world_size)
    receiver = np.bincount(cols["dst_rank"], weights=nbytes, minlength=inputs.num_dest)
    table = OpTable(global_names=tuple(names.globals), param_names=tuple(names.params), **cols)
    fields = {"sender_bytes": tuple(int(x) for x in sender), "receiver_bytes": tuple(int(x) for x in receiver)}
    fields.update(plan_fields)  # type: ignore[arg-type]
    return Plan(mode=mode, table=table, **fields)  # type: ignore[arg-type]


def _empty_columns() -> dict[str, np.ndarray]:
    from weightsync.plan.table import MAX_DIMS

    i32 = np.zeros(0, dtype=np.int32)
    box = np.zeros((0, MAX_DIMS), dtype=np.int32)
    i8 = np.zeros(0, dtype=np.int8)
    return {"gid": i32, "src_rank": i32, "src_pid": i32, "dst_rank": i32, "dst_pid": i32, "transform": i8,
            "zero_copy": np.zeros(0, dtype=bool), "g_lo": box, "g_hi": box, "g_nd": i8, "s_lo": box, "s_hi": box,
            "s_nd": i8, "d_lo": box, "d_hi": box, "d_nd": i8, "nbytes": np.zeros(0, dtype=np.int64)}


def plan_p2p(inputs: PlanInputs, sources: SourceIndex | None = None) -> Plan:
    """The whole p2p plan: every rollout rank's ops, in rollout-rank order.

    Args:
        inputs: planner inputs.
        sources: a prebuilt index of ``inputs.source_layouts`` (built when omitted).

    Returns:
        The plan.

    Raises:
        ValueError: a destination piece that no source covers, an unknown global tensor, or fp8
            cuts that are not whole blocks (the message names the tensor).
    """
    if sources is None:
        sources = SourceIndex(enumerate(inputs.source_layouts))
    names = NameTable(inputs.globals)
    cutter = Cutter(sources, inputs.globals)
    tables = [build_cut_table(inputs.engine_layouts[r], r, cutter, names)
              for r in range(inputs.rollout.tp)]
    rule = HolderRule(inputs, names.holders())
    tp = inputs.rollout.tp
    chunks = []
    for d in range(inputs.num_dest):
        chunks.extend(expand(tables[d % tp], rule, [d], None))
    return assemble(Mode.P2P, inputs, names, chunks)


def plan_p2p_for_rank(inputs: PlanInputs, *, src_rank: int | None = None, dst_rank: int | None = None,
                      sources: SourceIndex | None = None) -> Plan:
    """One rank's share of :func:`plan_p2p`: the ops it sends (``src_rank``) or receives (``dst_rank``).

    Equal to filtering the whole plan's ops by that rank, in the same order, but it cuts only the
    destination tensors that involve the rank.

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
    tp = inputs.rollout.tp
    if dst_rank is not None:
        if not 0 <= dst_rank < inputs.num_dest:
            raise ValueError(f"dst_rank {dst_rank} outside the {inputs.num_dest} rollout ranks")
        only: dict[int, set[int] | None] = {dst_rank % tp: None}
    else:
        assert src_rank is not None
        if not 0 <= src_rank < inputs.train.world_size:
            raise ValueError(f"src_rank {src_rank} outside the {inputs.train.world_size} trainer ranks")
        held = {p.global_name for t in inputs.source_layouts[src_rank] if not t.derived for p in t.pieces}
        only = dict(tensors_touching(inputs, held))
    if sources is None:  # index only what the tensors to cut read
        sources = SourceIndex(enumerate(inputs.source_layouts), source_globals(inputs, only))
    names = NameTable(inputs.globals)
    cutter = Cutter(sources, inputs.globals)
    tables = {r: build_cut_table(inputs.engine_layouts[r], r, cutter, names, idx) for r, idx in only.items()}
    rule = HolderRule(inputs, names.holders())
    dst = [dst_rank] if dst_rank is not None else range(inputs.num_dest)
    chunks = []
    for d in dst:
        chunks.extend(expand(tables[d % tp], rule, [d], src_rank))
    return assemble(Mode.P2P, inputs, names, chunks, src_rank=src_rank, dst_rank=dst_rank)


def source_globals(inputs: PlanInputs, only: dict[int, set[int] | None]) -> set[str]:
    """The source global tensors that the given engine tensors read (a scale reads its weight)."""
    gl = inputs.globals
    out = set()
    for r, idx in only.items():
        for i, t in enumerate(inputs.engine_layouts[r]):
            if idx is not None and i not in idx:
                continue
            for p in t.pieces:
                g = gl.get(p.global_name)
                out.add(p.global_name)
                if g is not None and g.quant_of is not None:
                    out.add(g.quant_of)
    return out


def tensors_touching(inputs: PlanInputs, held: set[str]) -> dict[int, set[int]]:
    """Per engine rank, the indexes of its tensors that need one of the global tensors ``held``
    (directly, or as the weight of a scale tensor)."""
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
