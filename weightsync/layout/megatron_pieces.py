"""Piece math of Megatron-core's tensor-parallel layers (pure functions over shapes).

Each function answers: rank ``part`` of ``num_parts`` holds which boxes of which global tensors,
for one kind of Megatron parameter. They are written from ``megatron/core/tensor_parallel/
layers.py`` (``ColumnParallelLinear`` splits output rows, ``RowParallelLinear`` splits input
columns, ``VocabParallelEmbedding`` splits padded vocab rows), ``transformer/attention.py``
(fused QKV interleaved per query group) and ``transformer/mlp.py`` (gated ``linear_fc1`` =
``[gate_shard; up_shard]`` on each rank, since swiglu chunks the local output in two).

Legend: ``rows`` = dim 0 of a 2-D weight (or the only dim of a bias); ``g`` = global, ``l`` = local.
"""

from __future__ import annotations

from weightsync.layout.box import Box, Piece, full_box

Shape = tuple[int, ...]


def _rows_box(start: int, stop: int, trailing: Shape) -> Box:
    return ((start, stop), *tuple((0, d) for d in trailing))


def whole(gname: str, gshape: Shape) -> tuple[Shape, tuple[Piece, ...]]:
    """A replicated tensor: the rank holds all of it."""
    box = full_box(gshape)
    return gshape, (Piece(gname, box, box),)


def split_rows(gname: str, gshape: Shape, part: int, num_parts: int) -> tuple[Shape, tuple[Piece, ...]]:
    """Column-parallel weight (or its bias): rank ``part`` holds rows ``[part*n, (part+1)*n)``."""
    n = gshape[0] // num_parts
    assert n * num_parts == gshape[0], (gname, gshape, num_parts)
    lshape = (n, *gshape[1:])
    return lshape, (Piece(gname, _rows_box(part * n, (part + 1) * n, gshape[1:]), full_box(lshape)),)


def split_cols(gname: str, gshape: Shape, part: int, num_parts: int) -> tuple[Shape, tuple[Piece, ...]]:
    """Row-parallel weight: rank ``part`` holds columns ``[part*n, (part+1)*n)``."""
    rows, cols = gshape
    n = cols // num_parts
    assert n * num_parts == cols, (gname, gshape, num_parts)
    return (rows, n), (Piece(gname, ((0, rows), (part * n, (part + 1) * n)), ((0, rows), (0, n))),)


def gated_fc1(gate: str, up: str, gshape: Shape, part: int, num_parts: int) -> tuple[Shape, tuple[Piece, ...]]:
    """Gated ``linear_fc1`` of ``[I, H]`` gate and up weights: local ``[gate_shard; up_shard]``."""
    inter, hidden = gshape
    n = inter // num_parts
    assert n * num_parts == inter, (gate, gshape, num_parts)
    g_rows = ((part * n, (part + 1) * n), (0, hidden))
    return (2 * n, hidden), (
        Piece(gate, g_rows, ((0, n), (0, hidden))),
        Piece(up, g_rows, ((n, 2 * n), (0, hidden))),
    )


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: round up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def vocab_rows(gname: str, gshape: Shape, part: int, num_parts: int, divisible_by: int) -> tuple[
    Shape, tuple[Piece, ...]
]:
    """Vocab-parallel embedding / output layer: even split of the padded vocab; padding has no piece."""
    vocab, hidden = gshape
    per = padded_vocab_size(vocab, num_parts, divisible_by) // num_parts
    lo = part * per
    hi = min(lo + per, vocab)
    if lo >= hi:
        return (per, hidden), ()
    return (per, hidden), (Piece(gname, ((lo, hi), (0, hidden)), ((0, hi - lo), (0, hidden))),)


def qkv_rows(q: str, k: str, v: str, *, num_heads: int, num_groups: int, head_dim: int, trailing: Shape,
             part: int, num_parts: int) -> tuple[Shape, tuple[Piece, ...]]:
    """Fused ``linear_qkv`` (weight, or bias with ``trailing=()``) of one TP rank.

    The global fused tensor is, for each query group g in order: the q rows of g's heads, then
    g's k rows, then g's v rows. ``ColumnParallelLinear`` gives rank ``part`` the contiguous
    rows ``[part*N/tp, (part+1)*N/tp)`` of it. With ``num_groups >= tp`` that is whole groups;
    with ``num_groups < tp`` (Megatron-core >= 0.14 allows a divisor) a rank holds a slice of
    one group's block, exactly as Megatron stores it.
    """
    q_per_group = num_heads // num_groups * head_dim
    segments: list[tuple[str, int, int]] = []  # (global name, global first row, rows), in fused order
    for g in range(num_groups):
        segments.append((q, g * q_per_group, q_per_group))
        segments.append((k, g * head_dim, head_dim))
        segments.append((v, g * head_dim, head_dim))
    total = num_groups * (q_per_group + 2 * head_dim)
    n = total // num_parts
    assert n * num_parts == total, (q, total, num_parts)
    lo, hi = part * n, (part + 1) * n
    pieces = []
    fused = 0
    for name, g0, rows in segments:
        a, b = max(lo, fused), min(hi, fused + rows)
        if a < b:
            pieces.append(Piece(name, _rows_box(g0 + a - fused, g0 + b - fused, trailing),
                                _rows_box(a - lo, b - lo, trailing)))
        fused += rows
    return (n, *trailing), tuple(pieces)
