"""Regions: a destination piece cut along the source pieces that can fill it.

For every destination piece the planner needs the parts of it that one source box covers, and
who holds that box (its *holders*: every trainer rank and parameter with a piece of exactly that
global box -- DP/CP/EDP replicas, TP-replicated tensors). :class:`SourceIndex` groups the source
pieces of each global tensor by global box; :func:`dest_regions` cuts one destination piece
into :class:`Region` records. Both are pure functions of the layouts, so every rank computes the
same regions.

fp8: a destination of dtype ``float8_e4m3fn`` is filled from a bf16 source through the
``fp8_quant`` transform; a destination piece of a ``*_scale_inv`` global tensor (``quant_of`` =
the weight) is mapped to the weight region its blocks scale and filled through ``fp8_scale``.
Either way every region must consist of whole blocks of one source piece, or a ValueError names
the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from weightsync.layout.box import Box, LocalTensor, Piece, box_intersect, box_volume
from weightsync.models.hf import DTYPE_BYTES, GlobalTensor
from weightsync.plan.ops import box_is_contiguous


@dataclass(frozen=True, slots=True)
class Holder:
    """A source piece: trainer ``rank``'s ``tensor`` holds ``piece``."""

    rank: int
    tensor: LocalTensor
    piece: Piece


class Region:
    """One part of a destination piece that a single source box covers.

    ``global_name``/``global_box`` are in the destination's global coordinates (scale blocks for
    a scale tensor); ``src_global``/``src_gbox`` are the source global tensor and box that hold
    it (the weight for a scale tensor).
    """

    __slots__ = (
        "_src",
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
        self._src: list[tuple[Box, bool] | None] = [None] * len(holders)

    def source_box(self, i: int) -> tuple[Box, bool]:
        """``(local box, zero_copy)`` of this region in holder ``i``'s tensor (cached)."""
        got = self._src[i]
        if got is None:
            h = self.holders[i]
            box = h.piece.local_of(self.src_gbox)
            got = (box, self.transform is None and box_is_contiguous(h.tensor.shape, box))
            self._src[i] = got
        return got


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
        cells = [c + ((lo, hi),) for c in cells for lo, hi in zip(cuts[d], cuts[d][1:], strict=False)]
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

    def __init__(self, layouts: Iterable[tuple[int, Sequence[LocalTensor]]]) -> None:
        """Args: layouts: ``(source rank, its local tensors)`` pairs, e.g. ``enumerate(layouts)``."""
        self._raw: dict[str, dict[Box, list[Holder]]] = {}
        for rank, tensors in layouts:
            for t in tensors:
                if t.derived:
                    continue
                for p in t.pieces:
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


def scale_to_weight(sbox: Box, block: tuple[int, int], wshape: tuple[int, ...]) -> Box:
    """The weight region whose blocks the scale box ``sbox`` scales."""
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


def dest_regions(dst: LocalTensor, piece: Piece, sources: SourceIndex, globals_: dict[str, GlobalTensor]
                 ) -> list[Region]:
    """Cut one destination piece into regions, each covered by one source box.

    Args:
        dst: the destination tensor.
        piece: one of its pieces.
        sources: the source index.
        globals_: the model's global tensors.

    Returns:
        Regions in source-partition order.

    Raises:
        ValueError: unknown global tensor, a box outside the tensor, no source for part of the
            piece, or fp8 regions that are not whole blocks of one source piece.
    """
    name = piece.global_name
    gt = globals_.get(name)
    if gt is None:
        raise ValueError(f"{dst.name}: piece of unknown global tensor {name}")
    if any(a < 0 or z > n or a >= z for (a, z), n in zip(piece.global_box, gt.shape, strict=True)):
        raise ValueError(f"{dst.name}: piece box {piece.global_box} outside {name} of shape {gt.shape}")
    is_scale = False
    src_name, want = name, piece.global_box
    if name not in sources:
        if gt.quant_of is None or gt.quant_of not in sources:
            raise ValueError(f"no source rank holds {name} (needed by {dst.name})")
        is_scale = True
        src_name = gt.quant_of
        assert gt.block is not None
        want = scale_to_weight(want, gt.block, globals_[src_name].shape)
    wshape = globals_[src_name].shape
    isz = DTYPE_BYTES[dst.dtype]
    regions: list[Region] = []
    covered = 0
    for box, holders in sources.partition(src_name):
        inter = box_intersect(box, want)
        if inter is None:
            continue
        transform = transform_for(holders[0].tensor.dtype, dst, gt, is_scale)
        if transform in ("fp8_quant", "fp8_scale"):
            block = gt.block
            assert block is not None
            if not blocks_aligned(inter, block, wshape):
                h = holders[0]
                raise ValueError(
                    f"fp8 block alignment broken for {src_name}: region {inter} (source piece {box} of "
                    f"{h.tensor.name} on trainer rank {h.rank}, destination {dst.name}) is not made of whole "
                    f"{list(block)} blocks; choose parallel sizes whose shard boundaries fall on block boundaries"
                )
        gbox = weight_to_scale(inter, gt.block) if is_scale else inter  # type: ignore[arg-type]
        regions.append(Region(name, gbox, dst.name, piece.local_of(gbox), src_name, inter, holders, transform,
                              box_volume(gbox) * isz))
        covered += box_volume(inter)
    if covered != box_volume(want):
        raise ValueError(
            f"the source ranks hold only {covered} of the {box_volume(want)} elements of {src_name} box {want} "
            f"that {dst.name} needs"
        )
    return regions
