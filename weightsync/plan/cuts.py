"""Cuts: a destination piece cut along the source pieces that can fill it.

For every destination piece the planner needs the parts of it that one source box covers, and
who holds that box (its *holders*: every trainer rank and parameter with a piece of exactly that
global box -- DP/CP/EDP replicas, TP-replicated tensors). :class:`SourceIndex` groups the source
pieces of each global tensor by global box; :func:`dest_cuts` cuts one destination piece
into :class:`Cut` records. Both are pure functions of the layouts, so every rank computes the
same cuts.

fp8: a destination of dtype ``float8_e4m3fn`` is filled from a bf16 source through the
``fp8_quant`` transform; a destination piece of a ``*_scale_inv`` global tensor (``quant_of`` =
the weight) is mapped to the weight region its blocks scale and filled through ``fp8_scale``.
Either way every cut must consist of whole blocks of one source piece, or a ValueError names
the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from weightsync.layout.box import Box, LocalTensor, Piece, box_intersect, box_volume
from weightsync.models.hf import DTYPE_BYTES, GlobalTensor
from weightsync.plan.ops import merge_boxes


@dataclass(frozen=True, slots=True)
class Holder:
    """A source piece: trainer ``rank``'s ``tensor`` holds ``piece``."""

    rank: int
    tensor: LocalTensor
    piece: Piece


class Cut:
    """One part of a destination piece that a single source box covers.

    ``global_name``/``global_box`` are in the destination's global coordinates (scale blocks for
    a scale tensor); ``src_global``/``src_gbox`` are the source global tensor and box that hold
    it (the weight for a scale tensor).
    """

    __slots__ = (
        "dst_box",
        "dst_param",
        "global_box",
        "global_name",
        "holders",
        "nbytes",
        "src_gbox",
        "src_global",
        "transform",
    )

    def __init__(self, global_name: str, global_box: Box, dst_param: str, dst_box: Box, src_global: str,
                 src_gbox: Box, holders: tuple[Holder, ...], transform: str | None, nbytes: int) -> None:
        self.global_name = global_name
        self.global_box = global_box
        self.dst_param = dst_param
        self.dst_box = dst_box
        self.src_global = src_global
        self.src_gbox = src_gbox
        self.holders = holders
        self.transform = transform
        self.nbytes = nbytes

    def source_box(self, i: int) -> Box:
        """The local box of this cut in holder ``i``'s tensor."""
        return local_of(self.holders[i].piece, self.src_gbox)


def local_of(piece: Piece, gbox: Box) -> Box:
    """``piece.local_of(gbox)``, with a fast path for the common 1-D and 2-D cases."""
    lb, pg = piece.local_box, piece.global_box
    n = len(pg)
    if n == 2:
        (a0, z0), (a1, z1) = gbox
        (g0, _), (g1, _) = pg
        s0, s1 = lb[-2][0] - g0, lb[-1][0] - g1
        tail: Box = ((a0 + s0, z0 + s0), (a1 + s1, z1 + s1))
        return lb[:-2] + tail if len(lb) > 2 else tail
    if n == 1 and len(lb) == 1:
        s0 = lb[0][0] - pg[0][0]
        return ((gbox[0][0] + s0, gbox[0][1] + s0),)
    return piece.local_of(gbox)


def normalize_pieces(t: LocalTensor) -> tuple[Piece, ...]:
    """The pieces of ``t`` with pieces that continue each other merged.

    Two pieces of the same global tensor merge when their global and local boxes are adjacent
    along the same dim and equal elsewhere (one shift maps the union). Ops then come out as long
    as both layouts allow, and an op may span what a layout listed as two pieces.
    """
    pieces = t.pieces
    if len(pieces) < 2:
        return pieces
    by_name: dict[str, list[Piece]] = {}
    for p in pieces:
        by_name.setdefault(p.global_name, []).append(p)
    if all(len(v) == 1 for v in by_name.values()):
        return pieces
    out: list[Piece] = []
    for name, group in by_name.items():
        changed = True
        while changed and len(group) > 1:
            changed = False
            group.sort(key=lambda p: p.global_box)
            merged = [group[0]]
            for p in group[1:]:
                q = merged[-1]
                g = merge_boxes(q.global_box, p.global_box)
                lo = merge_boxes(q.local_box, p.local_box) if g is not None else None
                if g is not None and lo is not None and g[1] == lo[1]:
                    merged[-1] = Piece(name, g[0], lo[0])
                    changed = True
                else:
                    merged.append(p)
            group = merged
        out.extend(group)
    return tuple(out)


def _overlapping_pairs(boxes: list[Box]) -> bool:
    """Whether any two distinct boxes overlap (sweep over dim 0)."""
    order = sorted(boxes)
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            if b[0][0] >= a[0][1]:
                break
            if box_intersect(a, b) is not None:
                return True
    return False


def _refine(parts: dict[Box, list[Holder]]) -> list[tuple[Box, tuple[Holder, ...]]]:
    """Cut overlapping source boxes into grid cells, each held by every box that contains it."""
    boxes = list(parts)
    ndim = len(boxes[0])
    cuts = [sorted({c for b in boxes for c in b[d]}) for d in range(ndim)]
    cells: list[Box] = [()]
    for d in range(ndim):
        cells = [(*c, (lo, hi)) for c in cells for lo, hi in zip(cuts[d], cuts[d][1:], strict=False)]
    out = []
    for cell in cells:
        holders = [h for b in boxes if box_intersect(b, cell) == cell for h in parts[b]]
        if holders:
            out.append((cell, tuple(sorted(holders, key=_holder_key))))
    return out


def _holder_key(h: Holder) -> tuple[int, str]:
    return (h.rank, h.tensor.name)


class SourceIndex:
    """Source pieces of every global tensor, grouped by global box (disjoint after refinement)."""

    def __init__(self, layouts: Iterable[tuple[int, Sequence[LocalTensor]]], names: set[str] | None = None
                 ) -> None:
        """Args:
            layouts: ``(source rank, its local tensors)`` pairs, e.g. ``enumerate(layouts)``.
            names: index only these global tensors (a rank planning its own share needs few).
        """
        self._raw: dict[str, dict[Box, list[Holder]]] = {}
        for rank, tensors in layouts:
            for t in tensors:
                if t.derived or (names is not None and not any(p.global_name in names for p in t.pieces)):
                    continue
                for p in normalize_pieces(t):
                    self._raw.setdefault(p.global_name, {}).setdefault(p.global_box, []).append(Holder(rank, t, p))
        self._parts: dict[str, list[tuple[Box, tuple[Holder, ...]]]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._raw

    def names(self) -> list[str]:
        return list(self._raw)

    def partition(self, name: str) -> list[tuple[Box, tuple[Holder, ...]]]:
        """Disjoint ``(global box, holders sorted by rank)`` covering what the sources hold of ``name``."""
        got = self._parts.get(name)
        if got is None:
            raw = self._raw[name]
            if len(raw) > 1 and _overlapping_pairs(list(raw)):
                got = _refine(raw)
            else:
                got = [(b, tuple(sorted(hs, key=_holder_key))) for b, hs in raw.items()]
            for _, hs in got:
                dtypes = {h.tensor.dtype for h in hs}
                if len(dtypes) > 1:
                    raise ValueError(f"source pieces of {name} disagree on dtype: {sorted(dtypes)}")
            self._parts[name] = got
        return got


def _inside(box: Box, shape: tuple[int, ...]) -> bool:
    for (a, z), n in zip(box, shape):  # noqa: SIM110 (hot path)
        if a < 0 or z > n or a >= z:
            return False
    return True


def _contains(outer: Box, inner: Box) -> bool:
    """``box_contains`` without a generator (hot path)."""
    for (a0, a1), (b0, b1) in zip(outer, inner):  # noqa: SIM110
        if b0 < a0 or a1 < b1:
            return False
    return True


def scale_to_weight(sbox: Box, block: tuple[int, int], wshape: tuple[int, ...]) -> Box:
    """The weight region whose blocks the scale box ``sbox`` scales."""
    if len(sbox) == 2:
        (a0, z0), (a1, z1) = sbox
        b0, b1 = block
        return ((a0 * b0, min(z0 * b0, wshape[0])), (a1 * b1, min(z1 * b1, wshape[1])))
    return tuple((a * b, min(z * b, n)) for (a, z), b, n in zip(sbox, block, wshape, strict=True))


def weight_to_scale(wbox: Box, block: tuple[int, int]) -> Box:
    """The scale box of a block-aligned weight region."""
    return tuple((a // b, -(-z // b)) for (a, z), b in zip(wbox, block, strict=True))


def blocks_aligned(wbox: Box, block: tuple[int, int], wshape: tuple[int, ...]) -> bool:
    """Whether ``wbox`` is a union of whole blocks (edge blocks end at the tensor's edge)."""
    return all(a % b == 0 and (z % b == 0 or z == n) for (a, z), b, n in zip(wbox, block, wshape, strict=True))


def transform_for(src_dtype: str, dst: LocalTensor, gt: GlobalTensor, is_scale: bool) -> str | None:
    """The transform that turns ``src_dtype`` source data into ``dst``'s storage of ``gt``."""
    if is_scale:
        if dst.dtype != "float32":
            raise ValueError(f"{dst.name}: fp8 scale tensor {gt.name} must be stored as float32, not {dst.dtype}")
        return "fp8_scale"
    if dst.dtype == src_dtype:
        return None
    if dst.dtype == "float8_e4m3fn":
        if gt.block is None:
            raise ValueError(f"{dst.name}: float8 destination for {gt.name}, which has no fp8 block size")
        return "fp8_quant"
    return "cast"


class Cutter:
    """Cuts destination pieces along the source pieces (:func:`dest_cuts`), with caches: a piece of a
    replicated tensor recurs on many engine ranks, and most pieces take the fast path (one source
    box holds the whole piece)."""

    def __init__(self, sources: SourceIndex, globals_: dict[str, GlobalTensor]) -> None:
        self.sources = sources
        self.globals = globals_
        self._pieces: dict[tuple[str, str, Piece], list[Cut]] = {}

    def cut(self, dst: LocalTensor, piece: Piece) -> list[Cut]:
        """The cuts of ``piece`` of ``dst`` (see :func:`dest_cuts`)."""
        key = (dst.name, dst.dtype, piece)
        got = self._pieces.get(key)
        if got is None:
            got = self._pieces[key] = self._cut(dst, piece)
        return got

    def _cut(self, dst: LocalTensor, piece: Piece) -> list[Cut]:
        name = piece.global_name
        gt = self.globals.get(name)
        if gt is None:
            raise ValueError(f"{dst.name}: piece of unknown global tensor {name}")
        want = piece.global_box
        if len(want) != len(gt.shape) or not _inside(want, gt.shape):
            raise ValueError(f"{dst.name}: piece box {want} outside {name} of shape {gt.shape}")
        is_scale = False
        src_name = name
        if name not in self.sources:
            if gt.quant_of is None or gt.quant_of not in self.sources:
                raise ValueError(f"no source rank holds {name} (needed by {dst.name})")
            is_scale = True
            src_name = gt.quant_of
            assert gt.block is not None
            want = scale_to_weight(want, gt.block, self.globals[src_name].shape)
        parts = self.sources.partition(src_name)
        transform = transform_for(parts[0][1][0].tensor.dtype, dst, gt, is_scale)
        isz = DTYPE_BYTES[dst.dtype]
        if len(parts) == 1 and _contains(parts[0][0], want):
            # fast path: one source box holds the whole piece; a scale box maps to whole blocks
            if transform == "fp8_quant":
                self._check_blocks(want, gt, src_name, parts[0], dst)
            return [Cut(name, piece.global_box, dst.name, piece.local_box, src_name, want, parts[0][1], transform,
                           box_volume(piece.global_box) * isz)]
        return self._cut_parts(dst, piece, gt, src_name, want, parts, transform, is_scale)

    def _check_blocks(self, inter: Box, gt: GlobalTensor, src_name: str, part: tuple[Box, tuple[Holder, ...]],
                      dst: LocalTensor) -> None:
        assert gt.block is not None
        if not blocks_aligned(inter, gt.block, self.globals[src_name].shape):
            h = part[1][0]
            raise ValueError(
                f"fp8 block alignment broken for {src_name}: region {inter} (source piece {part[0]} of "
                f"{h.tensor.name} on trainer rank {h.rank}, destination {dst.name}) is not made of whole "
                f"{list(gt.block)} blocks; choose parallel sizes whose shard boundaries fall on block boundaries"
            )

    def _cut_parts(self, dst: LocalTensor, piece: Piece, gt: GlobalTensor, src_name: str, want: Box,
                   parts: list[tuple[Box, tuple[Holder, ...]]], transform: str | None, is_scale: bool
                   ) -> list[Cut]:
        isz = DTYPE_BYTES[dst.dtype]
        cuts: list[Cut] = []
        covered = 0
        need = box_volume(want)
        for part in parts:
            inter = box_intersect(part[0], want)
            if inter is None:
                continue
            if transform in ("fp8_quant", "fp8_scale"):
                self._check_blocks(inter, gt, src_name, part, dst)
            gbox = weight_to_scale(inter, gt.block) if is_scale else inter  # type: ignore[arg-type]
            cuts.append(Cut(gt.name, gbox, dst.name, local_of(piece, gbox), src_name, inter, part[1],
                                  transform, box_volume(gbox) * isz))
            covered += box_volume(inter)
        if covered != need:
            raise ValueError(
                f"the source ranks hold only {covered} of the {need} elements of {src_name} box {want} "
                f"that {dst.name} needs"
            )
        return cuts


def dest_cuts(dst: LocalTensor, piece: Piece, sources: SourceIndex, globals_: dict[str, GlobalTensor]
                 ) -> list[Cut]:
    """Cut one destination piece along the source boxes, each cut covered by one source box.

    Args:
        dst: the destination tensor.
        piece: one of its pieces.
        sources: the source index.
        globals_: the model's global tensors.

    Returns:
        Cuts in source-partition order.

    Raises:
        ValueError: unknown global tensor, a box outside the tensor, no source for part of the
            piece, or fp8 cuts that are not whole blocks of one source piece.
    """
    return Cutter(sources, globals_).cut(dst, piece)
