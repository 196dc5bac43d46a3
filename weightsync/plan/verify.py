"""The plan verifier: proves on metadata alone that a plan writes every destination byte once.

Checks, over the columnar op table (:mod:`weightsync.plan.table`), with numpy:

* ``rank``     -- source and destination ranks exist;
* ``param``    -- the destination / source parameter exists on that rank, with the op's rank
  of dims;
* ``derived``  -- no op writes a derived tensor (MLA ``w_kc``/``w_vc``: recomputed by the engine);
* ``padding``  -- no op writes outside every piece of its destination tensor (vocab padding,
  ...);
* ``mapping``  -- the destination box is where the destination layout keeps the op's global box;
* ``source``   -- the source box is where a real source piece keeps that global region (the
  weight region of a scale op), inside one piece;
* ``dtype``    -- source and destination dtypes agree, or the transform is legal (``cast``,
  ``fp8_quant`` into float8 of whole blocks, ``fp8_scale`` into a float32 scale tensor);
* ``overlap``  -- no two ops write the same destination element (a duplicated op is one);
* ``coverage`` -- every element of every destination piece is written (with the checks above:
  exactly once);
* ``layout``   -- the destination pieces themselves are disjoint and inside their tensors.

A failed check raises :class:`PlanVerificationError` listing the problems, each with its check
name and the tensor it concerns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.layout.box import LocalTensor
from weightsync.models.hf import DTYPE_BYTES, GlobalTensor
from weightsync.plan.cuts import normalize_pieces
from weightsync.plan.ops import TRANSFORMS
from weightsync.plan.table import MAX_DIMS, OpTable, pad_box, unpad_box

D = MAX_DIMS
DTYPES = tuple(DTYPE_BYTES)
FP8 = DTYPES.index("float8_e4m3fn")
F32 = DTYPES.index("float32")
T_NONE, T_CAST, T_QUANT, T_SCALE = (TRANSFORMS.index(t) for t in (None, "cast", "fp8_quant", "fp8_scale"))
MAX_LISTED = 8


class PlanVerificationError(ValueError):
    """The plan breaks at least one check; ``problems`` lists ``(check, message)``."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        shown = "\n".join(f"  [{c}] {m}" for c, m in problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        super().__init__(f"plan verification failed ({len(problems)} problems):\n{shown}{more}")


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyReport:
    """What a successful verification covered."""

    num_ops: int
    dest_elements: int
    """Destination elements checked for exactly-once coverage."""
    seconds: float


class _Names:
    """Interned names: ids of the op table first, then any new ones."""

    def __init__(self, initial: Sequence[str]) -> None:
        self.names = list(initial)
        self.ids = {n: i for i, n in enumerate(self.names)}

    def id(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            i = self.ids[name] = len(self.names)
            self.names.append(name)
        return i


@dataclass(eq=False)
class _Params:
    """Parameters of a set of ranks: sorted keys ``rank * NP + pid`` and their shape / dtype."""

    key: np.ndarray
    shape: np.ndarray
    nd: np.ndarray
    dtype: np.ndarray
    derived: np.ndarray

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Row of each key, -1 where absent."""
        if len(self.key) == 0:
            return np.full(len(keys), -1)
        i = np.searchsorted(self.key, keys).clip(0, len(self.key) - 1)
        return np.where(self.key[i] == keys, i, -1)


@dataclass(eq=False)
class _Pieces:
    """Pieces of a set of ranks: key ``(rank * NP + pid) * NG + gid``, global and local boxes."""

    key: np.ndarray
    pkey: np.ndarray
    """``rank * NP + pid`` (the parameter)."""
    g_lo: np.ndarray
    g_hi: np.ndarray
    l_lo: np.ndarray
    l_hi: np.ndarray
    g_nd: np.ndarray


def _params_and_pieces(layouts: Sequence[Sequence[LocalTensor]], names: _Names, gnames: _Names, np_: int,
                       ng: int) -> tuple[_Params, _Pieces]:
    prow: list[tuple[int, ...]] = []
    pc: list[tuple[int, ...]] = []
    padded: dict[tuple, tuple[int, ...]] = {}
    pids, gids = names.ids, gnames.ids
    for rank, tensors in enumerate(layouts):
        for t in tensors:
            pkey = rank * np_ + pids[t.name]
            shp = (1,) * (D - len(t.shape)) + t.shape
            prow.append((pkey, len(t.shape), DTYPES.index(t.dtype), t.derived, *shp))
            if t.derived:
                continue
            for p in normalize_pieces(t):
                g, lb = p.global_box, p.local_box
                pg = padded.get(g)
                if pg is None:
                    pg = padded[g] = pad_box(g)
                pl = padded.get(lb)
                if pl is None:
                    pl = padded[lb] = pad_box(lb)
                pc.append((pkey * ng + gids[p.global_name], pkey, len(g), *pg, *pl))
    pa = np.array(prow, dtype=np.int64).reshape(len(prow), 4 + D)
    pa = pa[np.argsort(pa[:, 0], kind="stable")]
    params = _Params(key=pa[:, 0], nd=pa[:, 1], dtype=pa[:, 2], derived=pa[:, 3].astype(bool), shape=pa[:, 4:])
    ca = np.array(pc, dtype=np.int64).reshape(len(pc), 3 + 4 * D)
    pieces = _Pieces(key=ca[:, 0], pkey=ca[:, 1], g_nd=ca[:, 2], g_lo=ca[:, 3:3 + D], g_hi=ca[:, 3 + D:3 + 2 * D],
                     l_lo=ca[:, 3 + 2 * D:3 + 3 * D], l_hi=ca[:, 3 + 3 * D:])
    return params, pieces


def _locate(pieces: _Pieces, key: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """For each query, the last piece with ``(key, g_lo) <= (key, lo)`` lexicographically (-1: none)."""
    m, n = len(pieces.key), len(key)
    allkey = np.concatenate([pieces.key, key])
    alllo = np.concatenate([pieces.g_lo, lo])
    is_query = np.concatenate([np.zeros(m, np.int8), np.ones(n, np.int8)])
    order = np.lexsort((is_query, *[alllo[:, d] for d in range(D - 1, -1, -1)], allkey))
    pos = np.where(order < m, np.arange(m + n), -1)
    last = np.maximum.accumulate(pos)
    out = np.full(n, -1, dtype=np.int64)
    q = order >= m
    found = last[q]
    out[order[q] - m] = np.where(found >= 0, order[found.clip(0)], -1)
    return out


def _matches(pieces: _Pieces, cand: np.ndarray, key: np.ndarray, glo: np.ndarray, ghi: np.ndarray,
             llo: np.ndarray, lhi: np.ndarray) -> np.ndarray:
    """Whether piece ``cand`` holds global box ``glo..ghi`` at local box ``llo..lhi``."""
    c = cand.clip(0)
    return (
        (cand >= 0)
        & (pieces.key[c] == key)
        & np.all(pieces.g_lo[c] <= glo, axis=1)
        & np.all(ghi <= pieces.g_hi[c], axis=1)
        & np.all(llo == pieces.l_lo[c] + (glo - pieces.g_lo[c]), axis=1)
        & np.all(lhi - llo == ghi - glo, axis=1)
    )


class _Fallback:
    """Python search for the few queries the vectorized lookup misses (non-grid piece sets)."""

    def __init__(self, pieces: _Pieces) -> None:
        self.pieces = pieces
        self.by_key: dict[int, list[int]] | None = None
        self.by_param: dict[int, list[int]] | None = None

    def find(self, key: int, glo: np.ndarray, ghi: np.ndarray, llo: np.ndarray, lhi: np.ndarray) -> int:
        if self.by_key is None:
            self.by_key = {}
            for i, k in enumerate(self.pieces.key.tolist()):
                self.by_key.setdefault(k, []).append(i)
        p = self.pieces
        for i in self.by_key.get(key, []):
            if (np.all(p.g_lo[i] <= glo) and np.all(ghi <= p.g_hi[i]) and np.all(llo == p.l_lo[i] + glo - p.g_lo[i])
                    and np.all(lhi - llo == ghi - glo)):
                return i
        return -1

    def touches_any(self, pkey: int, llo: np.ndarray, lhi: np.ndarray) -> bool:
        """Whether local box ``llo..lhi`` meets any piece of parameter ``pkey``."""
        if self.by_param is None:
            self.by_param = {}
            for i, k in enumerate(self.pieces.pkey.tolist()):
                self.by_param.setdefault(k, []).append(i)
        p = self.pieces
        return any(np.all(p.l_lo[i] < lhi) and np.all(llo < p.l_hi[i]) for i in self.by_param.get(pkey, []))


def _overlaps(key: np.ndarray, lo: np.ndarray, hi: np.ndarray, shape: np.ndarray) -> list[tuple[int, int]]:
    """Pairs ``(i, j)`` of boxes with the same key that share an element (first ``MAX_LISTED`` * 4)."""
    n = len(key)
    if n < 2:
        return []
    strides = np.ones_like(shape)
    for d in range(D - 2, -1, -1):
        strides[:, d] = strides[:, d + 1] * shape[:, d + 1]
    first = np.sum(lo * strides, axis=1)
    last = np.sum((hi - 1) * strides, axis=1) + 1
    order = np.lexsort((first, key))
    key, first, last, lo, hi = key[order], first[order], last[order], lo[order], hi[order]
    cand = np.arange(n - 1)
    found: list[tuple[int, int]] = []
    s = 1
    while len(cand) and len(found) < MAX_LISTED * 4:
        j = cand + s
        keep = j < n
        cand, j = cand[keep], j[keep]
        active = (key[j] == key[cand]) & (first[j] < last[cand])
        cand, j = cand[active], j[active]
        hit = np.all(lo[cand] < hi[j], axis=1) & np.all(lo[j] < hi[cand], axis=1)
        found.extend(zip(order[cand[hit]].tolist(), order[j[hit]].tolist(), strict=True))
        s += 1
    return found


def verify_ops(table: OpTable, *, sources: Sequence[Sequence[LocalTensor]],
               engine_layouts: Sequence[Sequence[LocalTensor]], num_engines: int,
               globals_: dict[str, GlobalTensor], coverage_ranks: Sequence[int] | None = None) -> VerifyReport:
    """Verify ops against the source and destination layouts (see the module docstring).

    Args:
        table: the ops.
        sources: per source rank, its tensors (trainer layouts, or the gathered tensors of a
            broadcast).
        engine_layouts: per rank inside one engine, its tensors.
        num_engines: engines (rollout rank ``d`` has layout ``engine_layouts[d % tp]``).
        globals_: the model's global tensors.
        coverage_ranks: rollout ranks whose pieces must be fully written (default: all; ``[]``
            for a plan that holds one sender's ops).

    Returns:
        A report of what was checked.

    Raises:
        PlanVerificationError: listing every failed check.
    """
    t0 = time.perf_counter()
    v = _Verifier(table, sources, engine_layouts, num_engines, globals_)
    v.check_ops()
    v.check_layout()
    v.check_overlap()
    ranks = range(len(engine_layouts) * num_engines) if coverage_ranks is None else coverage_ranks
    elements = v.check_coverage(list(ranks))
    if v.problems:
        raise PlanVerificationError(v.problems)
    return VerifyReport(num_ops=len(table), dest_elements=elements, seconds=time.perf_counter() - t0)


class _Verifier:
    """State of one verification; each ``check_*`` appends to ``problems``."""

    def __init__(self, table: OpTable, sources: Sequence[Sequence[LocalTensor]],
                 engine_layouts: Sequence[Sequence[LocalTensor]], num_engines: int,
                 globals_: dict[str, GlobalTensor]) -> None:
        self.t = table
        self.tp = len(engine_layouts)
        self.num_dest = self.tp * num_engines
        self.num_src = len(sources)
        self.problems: list[tuple[str, str]] = []
        self.pn = _Names(table.param_names)
        self.gn = _Names(table.global_names)
        for name in globals_:
            self.gn.id(name)
        for layouts in (sources, engine_layouts):
            for tensors in layouts:
                for lt in tensors:
                    self.pn.id(lt.name)
                    for p in lt.pieces:
                        if p.global_name not in self.gn.ids:
                            self.gn.id(p.global_name)
        self.NP, self.NG = len(self.pn.names), len(self.gn.names)
        self._global_info(globals_)
        self.dparams, self.dpieces = _params_and_pieces(engine_layouts, self.pn, self.gn, self.NP, self.NG)
        self.sparams, self.spieces = _params_and_pieces(sources, self.pn, self.gn, self.NP, self.NG)
        self.ok = np.ones(len(table), dtype=bool)
        self.dpiece = np.full(len(table), -1, dtype=np.int64)

    def _global_info(self, globals_: dict[str, GlobalTensor]) -> None:
        ng = self.NG
        self.g_known = np.zeros(ng, dtype=bool)
        self.g_shape = np.ones((ng, D), dtype=np.int64)
        self.g_block = np.zeros((ng, D), dtype=np.int64)
        self.g_quant_of = np.full(ng, -1, dtype=np.int64)
        for name, g in globals_.items():
            i = self.gn.ids[name]
            self.g_known[i] = True
            self.g_shape[i, D - len(g.shape):] = g.shape
            if g.block is not None:
                self.g_block[i, D - 2:] = g.block
            if g.quant_of is not None:
                self.g_quant_of[i] = self.gn.ids[g.quant_of]

    def fail(self, check: str, mask: np.ndarray, describe: str, drop: bool = True) -> None:
        """Record problem ``check`` for the ops in ``mask`` (first few described); with ``drop``
        the ops take no part in later checks (they are structurally broken)."""
        idx = np.flatnonzero(mask & self.ok)
        for i in idx[:MAX_LISTED]:
            op = self.t.op(int(i))
            self.problems.append((check, describe.format(op=op)))
        if len(idx) > MAX_LISTED:
            self.problems.append((check, f"... {len(idx) - MAX_LISTED} more ops with the same problem"))
        if drop:
            self.ok[idx] = False

    def check_ops(self) -> None:
        t = self.t
        self.fail("rank", (t.dst_rank < 0) | (t.dst_rank >= self.num_dest) | (t.src_rank < 0)
                  | (t.src_rank >= self.num_src),
                  "op on {op.global_name} goes from trainer rank {op.src_rank} to rollout rank {op.dst_rank}, "
                  "outside the ranks of the layouts")
        self.fail("rank", ~self.g_known[t.gid], "op writes {op.global_name}, which is not a global tensor of the model")
        r_local = np.where(self.ok, t.dst_rank % self.tp, 0)
        dkey = r_local.astype(np.int64) * self.NP + t.dst_pid
        skey = np.where(self.ok, t.src_rank, 0).astype(np.int64) * self.NP + t.src_pid
        drow, srow = self.dparams.find(dkey), self.sparams.find(skey)
        self.fail("param", drow < 0, "rollout rank {op.dst_rank} has no parameter {op.dst_param} ({op.global_name})")
        self.fail("param", srow < 0, "trainer rank {op.src_rank} has no parameter {op.src_param} ({op.global_name})")
        drow, srow = drow.clip(0), srow.clip(0)
        self.fail("derived", self.dparams.derived[drow],
                  "op writes derived tensor {op.dst_param} on rollout rank {op.dst_rank} ({op.global_name}); "
                  "derived tensors are recomputed by the engine and never written")
        self.fail("param", (self.dparams.nd[drow] != t.d_nd) | (self.sparams.nd[srow] != t.s_nd),
                  "op on {op.global_name}: box rank does not match {op.dst_param} / {op.src_param}")
        self._check_dtypes(self.sparams.dtype[srow], self.dparams.dtype[drow])
        self._check_dest(dkey)
        self._check_source(skey)

    def _check_dtypes(self, sd: np.ndarray, dd: np.ndarray) -> None:
        t = self.t
        tr = t.transform.astype(np.int64)
        is_scale = self.g_quant_of[t.gid] >= 0
        block = self.g_block[t.gid]
        legal = (
            ((tr == T_NONE) & (sd == dd))
            | ((tr == T_CAST) & (sd != dd) & (sd != FP8) & (dd != FP8))
            | ((tr == T_QUANT) & (dd == FP8) & (sd != FP8) & (block[:, -1] > 0) & ~is_scale)
            | ((tr == T_SCALE) & is_scale & (dd == F32) & (sd != FP8))
        )
        self.fail("dtype", ~legal, "op {op.global_name} -> {op.dst_param} on rollout rank {op.dst_rank}: transform "
                  "{op.transform} does not convert the source dtype into the destination dtype", drop=False)
        quant = tr == T_QUANT
        if quant.any():
            b = np.where(block > 0, block, 1)
            shp = self.g_shape[t.gid]
            aligned = np.all((t.g_lo % b == 0) & ((t.g_hi % b == 0) | (t.g_hi == shp)), axis=1)
            self.fail("dtype", quant & ~aligned, "fp8_quant op on {op.global_name} box {op.global_box} is not made of "
                      "whole fp8 blocks", drop=False)

    def _check_dest(self, dkey: np.ndarray) -> None:
        t = self.t
        key = dkey * self.NG + t.gid
        cand = _locate(self.dpieces, key, t.g_lo)
        good = _matches(self.dpieces, cand, key, t.g_lo, t.g_hi, t.d_lo, t.d_hi)
        fb = _Fallback(self.dpieces)
        padding = np.zeros(len(t), dtype=bool)
        for i in np.flatnonzero(~good & self.ok):
            c = fb.find(int(key[i]), t.g_lo[i], t.g_hi[i], t.d_lo[i], t.d_hi[i])
            if c >= 0:
                cand[i], good[i] = c, True
            elif not fb.touches_any(int(dkey[i]), t.d_lo[i], t.d_hi[i]):
                padding[i] = True
        self.fail("padding", padding, "op writes {op.dst_box} of {op.dst_param} on rollout rank {op.dst_rank}, "
                  "which holds no global tensor (padding), from {op.global_name}")
        self.fail("mapping", ~good, "op writes {op.global_name} {op.global_box} into {op.dst_box} of {op.dst_param} on "
                  "rollout rank {op.dst_rank}, where the destination layout does not keep that region")
        self.dpiece = np.where(good & self.ok, cand, -1)

    def _check_source(self, skey: np.ndarray) -> None:
        t = self.t
        scale = t.transform == T_SCALE
        sgid = np.where(scale, self.g_quant_of[t.gid], t.gid).clip(0)
        block = np.where(self.g_block[t.gid] > 0, self.g_block[t.gid], 1)
        wshape = self.g_shape[sgid]
        lo = np.where(scale[:, None], t.g_lo * block, t.g_lo)
        hi = np.where(scale[:, None], np.minimum(t.g_hi * block, wshape), t.g_hi)
        key = skey * self.NG + sgid
        cand = _locate(self.spieces, key, lo)
        good = _matches(self.spieces, cand, key, lo, hi, t.s_lo, t.s_hi)
        fb = _Fallback(self.spieces)
        for i in np.flatnonzero(~good & self.ok):
            good[i] = fb.find(int(key[i]), lo[i], hi[i], t.s_lo[i], t.s_hi[i]) >= 0
        self.fail("source", ~good, "op reads {op.src_box} of {op.src_param} on trainer rank {op.src_rank}, which "
                  "does not hold {op.global_name} {op.global_box} there inside one source piece", drop=False)

    def check_layout(self) -> None:
        """Destination pieces lie inside their tensors and do not overlap."""
        p, prm = self.dpieces, self.dparams
        row = prm.find(p.pkey)
        inside = np.all((p.l_lo >= 0) & (p.l_hi <= prm.shape[row]) & (p.l_lo < p.l_hi), axis=1)
        inside &= np.all((p.g_lo >= 0) & (p.g_hi <= self.g_shape[p.key % self.NG]), axis=1)
        for i in np.flatnonzero(~inside)[:MAX_LISTED]:
            self.problems.append(("layout", self._piece_str(int(i)) + " lies outside its tensor"))
        for i, j in _overlaps(p.pkey, p.l_lo, p.l_hi, prm.shape[row])[:MAX_LISTED]:
            self.problems.append(("layout", f"{self._piece_str(i)} overlaps {self._piece_str(j)}"))

    def _piece_str(self, i: int) -> str:
        p = self.dpieces
        r, pid = divmod(int(p.pkey[i]), self.NP)
        g = self.gn.names[int(p.key[i] % self.NG)]
        box = unpad_box(p.g_lo[i], p.g_hi[i], int(p.g_nd[i]))
        return f"piece {g} {box} of {self.pn.names[pid]} on engine rank {r}"

    def check_overlap(self) -> None:
        t = self.t
        idx = np.flatnonzero(self.ok)
        key = t.dst_rank[idx].astype(np.int64) * self.NP + t.dst_pid[idx]
        row = self.dparams.find((t.dst_rank[idx] % self.tp).astype(np.int64) * self.NP + t.dst_pid[idx])
        pairs = _overlaps(key, t.d_lo[idx], t.d_hi[idx], self.dparams.shape[row.clip(0)])
        for a, b in pairs[:MAX_LISTED]:
            x, y = t.op(int(idx[a])), t.op(int(idx[b]))
            self.problems.append((
                "overlap",
                f"{x.dst_param} on rollout rank {x.dst_rank} written more than once: op {x.global_name} {x.dst_box} "
                f"(from trainer rank {x.src_rank}) overlaps op {y.global_name} {y.dst_box} (from trainer rank "
                f"{y.src_rank})",
            ))

    def check_coverage(self, ranks: list[int]) -> int:
        """Every piece of ``ranks`` gets as many elements as it has; returns the elements checked."""
        t = self.t
        m = len(self.dpieces.key)
        vol_p = np.prod(self.dpieces.g_hi - self.dpieces.g_lo, axis=1)
        good = self.dpiece >= 0
        vol_o = np.prod(t.g_hi - t.g_lo, axis=1)[good]
        engine = (t.dst_rank[good] // self.tp).astype(np.int64)
        num_engines = self.num_dest // self.tp
        got = np.bincount(engine * m + self.dpiece[good], weights=vol_o, minlength=num_engines * m)
        got = got.reshape(num_engines, m)
        rank_of_piece = self.dpieces.pkey // self.NP
        total = 0
        listed = 0
        for d in ranks:
            e, r = divmod(d, self.tp)
            mine = rank_of_piece == r
            total += int(vol_p[mine].sum())
            short = np.flatnonzero(mine & (got[e] < vol_p))  # excess is reported as overlap
            for i in short:
                if listed < MAX_LISTED:
                    self.problems.append(("coverage", f"not written: {int(vol_p[i] - got[e, i])} of {int(vol_p[i])} "
                                          f"elements of {self._piece_str(int(i))} (rollout rank {d})"))
                listed += 1
        if listed > MAX_LISTED:
            self.problems.append(("coverage", f"... {listed - MAX_LISTED} more pieces not fully written"))
        return total
