"""Boxes and pieces: how a rank's local tensor maps onto global tensors.

A *box* is an N-D index region, one ``(start, stop)`` pair per dimension. A local tensor on
either side is a list of :class:`Piece` records, each saying "this box of my local tensor holds
that box of global tensor G". Regions of a local tensor covered by no piece are padding
(never written by a transfer); a tensor marked ``derived`` is recomputed by its owner after an
update and never written either, and a ``constant`` one keeps the value it is allocated with.

Legend: ``g`` = global coordinates, ``l`` = local coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, d) for d in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple([b - a for a, b in box])


def box_volume(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def box_slices(box: Box) -> tuple[slice, ...]:
    """The box as an index into a tensor (``t[box_slices(box)]``)."""
    return tuple(slice(a, b) for a, b in box)


def box_intersect(x: Box, y: Box) -> Box | None:
    """The common region of two boxes of the same rank, or None when they do not meet."""
    out = []
    for (a0, a1), (b0, b1) in zip(x, y, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_contains(outer: Box, inner: Box) -> bool:
    return all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(outer, inner, strict=True))


@dataclass(frozen=True, slots=True)
class Piece:
    """``local_box`` of a local tensor holds ``global_box`` of global tensor ``global_name``.

    Both boxes have the same shape. They may differ in rank only through the leading
    expert axis of stacked expert tensors: a local box may carry one more leading dim of
    extent 1 (``w13_weight[e]``) than its 2-D global box.
    """

    global_name: str
    global_box: Box
    local_box: Box

    def __post_init__(self) -> None:
        # Hot path (millions of pieces at full size): plain loops, no generators.
        g, loc = self.global_box, self.local_box
        extra = len(loc) - len(g)
        ok = extra >= 0
        if ok:
            for a, b in loc[:extra]:
                if b - a != 1:
                    ok = False
                    break
        if ok:
            for (ga, gb), (la, lb) in zip(g, loc[extra:]):
                if gb - ga != lb - la:
                    ok = False
                    break
        if not ok:
            raise ValueError(
                f"piece of {self.global_name}: local box {self.local_box} does not match {self.global_box}")

    def local_of(self, gbox: Box) -> Box:
        """The local box that holds ``gbox`` (which must lie inside ``global_box``)."""
        extra = len(self.local_box) - len(self.global_box)
        lead = self.local_box[:extra]
        tail = tuple(
            (lb[0] + (g[0] - gb[0]), lb[0] + (g[1] - gb[0]))
            for g, gb, lb in zip(gbox, self.global_box, self.local_box[extra:], strict=True)
        )
        return lead + tail


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalTensor:
    """One parameter (or buffer) of one rank: its name, shape, dtype and global pieces."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    derived: bool = False
    """Recomputed by the owner after an update (MLA w_kc/w_vc); never written by a plan."""
    constant: float | None = None
    """A parameter no update writes, which the engine holds at this value from allocation on
    (sglang's fp8 attention ``k_scale`` / ``v_scale``: 1.0 when the checkpoint has none); it has
    no pieces, is published with the parameters and left out of checksums, as sglang does."""

    @property
    def numel(self) -> int:
        return box_volume(full_box(self.shape))
