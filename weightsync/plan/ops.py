"""Copy ops: the records a plan is made of, and the byte runs they stand for.

A :class:`CopyOp` copies one N-D box of a source rank's local tensor into one N-D box of a
destination rank's local tensor, optionally converting on the way (``transform``). Ops are
boxes, not byte runs: :func:`box_runs` derives the contiguous ``(offset, length)`` runs of a
box in a row-major tensor, and :func:`coalesce_ops` merges ops that are adjacent in both
tensors so that runs get as long as the layouts allow.

Transforms (applied by the sender while packing):

* ``None``       -- plain copy, same dtype;
* ``"cast"``     -- dtype conversion (e.g. bf16 -> fp16);
* ``"fp8_quant"``-- block fp8 quantization of a bf16 region made of whole blocks
  (:mod:`weightsync.quant.fp8`);
* ``"fp8_scale"``-- the float32 ``scale_inv`` of those blocks. For this transform
  ``global_name``/``global_box``/``dst_box`` are in *scale* coordinates while ``src_box`` is the
  matching region of the *weight* in the source tensor (so the two boxes differ in shape).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from weightsync.layout.box import Box, box_volume

TRANSFORMS: tuple[str | None, ...] = (None, "cast", "fp8_quant", "fp8_scale")


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy ``src_box`` of ``src_param`` on trainer ``src_rank`` into ``dst_box`` of ``dst_param``
    on rollout ``dst_rank``; the region is ``global_box`` of ``global_name``."""

    global_name: str
    global_box: Box
    src_rank: int
    """Trainer rank (global trainer rank)."""
    src_param: str
    src_box: Box
    """Local box in the source tensor (weight coordinates for ``fp8_scale``)."""
    dst_rank: int
    """Rollout rank: engine ``e``'s rank ``r`` is ``e * rollout.tp + r``."""
    dst_param: str
    dst_box: Box
    transform: str | None = None
    zero_copy: bool = False
    """The source box is one contiguous run of the source tensor and needs no transform, so the
    sender can write it straight from parameter memory; otherwise it is packed into staging."""

    @property
    def numel(self) -> int:
        """Elements written into the destination."""
        return box_volume(self.dst_box)


def box_is_contiguous(shape: tuple[int, ...], box: Box) -> bool:
    """Whether ``box`` is a single contiguous run of a row-major tensor of ``shape``."""
    seen_partial = False
    for d in range(len(shape) - 1, -1, -1):
        a, b = box[d]
        if seen_partial:
            if b - a != 1:
                return False
        elif (a, b) != (0, shape[d]):
            seen_partial = True
    return True


def box_runs(shape: tuple[int, ...], box: Box, itemsize: int) -> list[tuple[int, int]]:
    """The contiguous byte runs ``(offset, length)`` of ``box`` in a row-major tensor.

    Trailing dims that the box covers fully are collapsed into the innermost partial dim, so a
    box of whole rows is one run.

    Args:
        shape: the tensor's shape.
        box: ``(start, stop)`` per dim, inside ``shape``.
        itemsize: bytes per element.

    Returns:
        Runs in increasing offset order; an empty box gives ``[]``.
    """
    if len(shape) != len(box):
        raise ValueError(f"box {box} does not have the rank of shape {shape}")
    if box_volume(box) == 0:
        return []
    # strides in elements
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # innermost dim k such that dims > k are full: a run spans box[k] times stride[k]
    k = len(shape) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    run_len = (box[k][1] - box[k][0]) * strides[k]
    starts = [box[k][0] * strides[k]]
    for d in range(k - 1, -1, -1):
        a, b = box[d]
        starts = [s + i * strides[d] for i in range(a, b) for s in starts]
    starts.sort()
    return [(s * itemsize, run_len * itemsize) for s in starts]


def merge_boxes(x: Box, y: Box) -> tuple[Box, int] | None:
    """If ``y`` directly follows ``x`` along exactly one dim (equal elsewhere): ``(merged, dim)``,
    with ``dim`` counted from the last dim (-1 = innermost), so that boxes of different rank
    (a leading expert axis) can be compared."""
    dim = -1
    for d, (a, b) in enumerate(zip(x, y, strict=True)):
        if a == b:
            continue
        if dim >= 0 or a[1] != b[0]:
            return None
        dim = d
    if dim < 0:
        return None
    return (*x[:dim], (x[dim][0], y[dim][1]), *x[dim + 1:]), dim - len(x)


def _try_merge(a: CopyOp, b: CopyOp) -> CopyOp | None:
    """``a`` and ``b`` (same key) merged when adjacent along one dim in all three boxes."""
    if a.transform == "fp8_scale":
        return None  # src and dst are in different coordinates; keep one op per region
    g = merge_boxes(a.global_box, b.global_box)
    s = merge_boxes(a.src_box, b.src_box)
    t = merge_boxes(a.dst_box, b.dst_box)
    if g is None or s is None or t is None or not g[1] == s[1] == t[1]:
        return None
    return replace(a, global_box=g[0], src_box=s[0], dst_box=t[0])


def _op_key(op: CopyOp) -> tuple:
    return (op.src_rank, op.src_param, op.dst_rank, op.dst_param, op.global_name, op.transform)


def coalesce_ops(ops: Iterable[CopyOp], src_shape: Callable[[int, str], tuple[int, ...]] | None = None
                 ) -> list[CopyOp]:
    """Merge ops that continue each other in the global tensor, the source and the destination.

    Two ops merge when they have the same ranks, params, global tensor and transform, and their
    boxes are adjacent along one dim (the same dim in all three) and equal elsewhere. Merging is
    repeated until nothing changes. The result keeps the first-seen order of the merged groups.

    Args:
        ops: ops in any order.
        src_shape: ``(src_rank, src_param) -> shape`` of source tensors; when given,
            ``zero_copy`` of merged ops is recomputed.

    Returns:
        The coalesced ops.
    """
    groups: dict[tuple, list[CopyOp]] = {}
    for op in ops:
        groups.setdefault(_op_key(op), []).append(op)
    out: list[CopyOp] = []
    for group in groups.values():
        if len(group) > 1:
            group = _coalesce_group(group)
            if src_shape is not None:
                group = [_with_zero_copy(op, src_shape(op.src_rank, op.src_param)) for op in group]
        out.extend(group)
    return out


def _with_zero_copy(op: CopyOp, shape: tuple[int, ...]) -> CopyOp:
    zc = op.transform is None and box_is_contiguous(shape, op.src_box)
    return op if zc == op.zero_copy else replace(op, zero_copy=zc)


def _coalesce_group(group: list[CopyOp]) -> list[CopyOp]:
    ndim = len(group[0].dst_box)
    changed = True
    while changed and len(group) > 1:
        changed = False
        for d in range(ndim - 1, -1, -1):
            # sort so that candidates along dim d are neighbours
            order = sorted(group, key=lambda o: (*(o.dst_box[i] for i in range(ndim) if i != d), o.dst_box[d]))
            merged: list[CopyOp] = [order[0]]
            for op in order[1:]:
                m = _try_merge(merged[-1], op)
                if m is not None:
                    merged[-1] = m
                    changed = True
                else:
                    merged.append(op)
            group = merged
    return group
