"""The receiver's parameter memory: every parameter of one engine rank, in one block, allocated once.

The engine's parameters are the local tensors of :func:`weightsync.layout.sglang.engine_layout`
(names, shapes, dtypes, pieces). :class:`ParamStore` carves them out of a single byte block,
zero-filled, and never reallocates them: their addresses are published to senders through
``/get_remote_instance_transfer_engine_info`` as ``{name: [ptr, numel, element_size]}``, and
senders write into them directly. Regions no piece covers (vocab padding rows,
:func:`padding_runs`) are zero: from allocation, and again after every update session
(:meth:`ParamStore.zero_padding`), since a writer of whole padded tensors may have written them.

The block comes from a transport's arena (:meth:`weightsync.transport.base.Transport.new_arena`:
a shared-memory segment for ``shm``, device memory for ``cuda_ipc``, ...) when the engine
receives p2p writes (:mod:`weightsync.sync.p2p_receiver`), or from a plain torch allocation.

Typical usage::

    store = ParamStore(engine_layout(spec, par, rank), device=torch.device("cpu"))
    w = store["model.layers.0.self_attn.qkv_proj.weight"]   # a view into the block
    info = store.transfer_info()                              # {name: [ptr, numel, elem_size]}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from weightsync.layout.box import Box, LocalTensor, Piece, box_slices, box_volume
from weightsync.models.dtypes import torch_dtype
from weightsync.models.spec import ModelSpec
from weightsync.plan.ops import box_runs
from weightsync.quant.fp8 import quantize_block_fp8

ALIGN_BYTES = 256
"""Every parameter starts at a multiple of this (CUDA allocation granularity; RDMA-friendly)."""


class ArenaLike(Protocol):
    """What :class:`ParamStore` needs of an arena (:class:`weightsync.transport.arena.Arena` fits)."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class ParamStore:
    """All parameters of one engine rank, as views into one arena (see the module docstring)."""

    def __init__(self, layout: list[LocalTensor], device: torch.device, arena: ArenaLike | None = None) -> None:
        """Allocate every tensor of ``layout`` once, zero-filled (a ``constant`` one filled with its value).

        Args:
            layout: the rank's local tensors (names unique).
            device: where the parameters live.
            arena: where the block comes from (at least :meth:`required_bytes` free); a plain
                torch allocation on ``device`` when None.

        Raises:
            ValueError: duplicate names or unknown dtypes in ``layout``, or an arena block on
                another device.
        """
        names = [t.name for t in layout]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"engine layout lists parameters twice: {dup}")
        self.device = device
        self.layout = list(layout)
        self.meta: dict[str, LocalTensor] = {t.name: t for t in layout}
        offsets = _offsets(layout)
        self.nbytes = self.required_bytes(layout)
        if arena is None:
            self._buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        else:
            self._buf = arena.empty((self.nbytes,), torch.uint8)
            if self._buf.device.type != device.type:
                raise ValueError(f"arena memory is on {self._buf.device}, the parameters belong on {device}")
            self._buf.zero_()
        self._tensors: dict[str, torch.Tensor] = {}
        for t in layout:
            dtype = torch_dtype(t.dtype)
            off = offsets[t.name]
            raw = self._buf[off : off + t.numel * dtype.itemsize]
            self._tensors[t.name] = raw.view(dtype).view(t.shape)
            if t.constant is not None:
                self._tensors[t.name].fill_(t.constant)
        self._by_global: dict[str, list[tuple[str, Piece]]] = {}
        for t in layout:
            for p in t.pieces:
                self._by_global.setdefault(p.global_name, []).append((t.name, p))
        self.padding: dict[str, list[tuple[int, int]]] = {t.name: r for t in layout if (r := padding_runs(t))}
        """Parameter -> its :func:`padding_runs` (only parameters that have some)."""

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor | None:
        return self._tensors.get(name)

    def names(self) -> list[str]:
        return list(self._tensors)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._tensors.items()

    def global_names(self) -> list[str]:
        """The global tensors this rank holds a piece of, in layout order."""
        return list(self._by_global)

    def pieces_of(self, global_name: str) -> list[tuple[str, Piece]]:
        """``(local name, piece)`` for every piece of ``global_name`` on this rank ([] if none)."""
        return self._by_global.get(global_name, [])

    def derived_names(self) -> list[str]:
        return [n for n, t in self.meta.items() if t.derived]

    def transfer_info(self) -> dict[str, list[int]]:
        """``{name: [data_ptr, numel, element_size]}`` of every parameter (addresses never change)."""
        return {n: [t.data_ptr(), t.numel(), t.element_size()] for n, t in self._tensors.items()}

    @staticmethod
    def required_bytes(layout: list[LocalTensor]) -> int:
        """Size of the block that holds ``layout`` (every tensor ``ALIGN_BYTES``-aligned)."""
        size = 0
        for t in layout:
            size = -(-size // ALIGN_BYTES) * ALIGN_BYTES + t.numel * torch_dtype(t.dtype).itemsize
        return max(size, 1)

    def zero_padding(self) -> int:
        """Zero every parameter's padding (the regions no piece covers); returns the elements zeroed.

        A writer of whole padded tensors (``update_weights_from_tensor`` with ``direct``, a peer
        writing raw bytes) may have put anything there; the end of an update session restores
        the zeros the model and the fingerprint expect.
        """
        zeroed = 0
        for name, runs in self.padding.items():
            flat = self._tensors[name].view(-1)
            for first, count in runs:
                flat[first : first + count].zero_()
                zeroed += count
        return zeroed

    def copy_from(self, other: ParamStore) -> int:
        """Copy every byte of ``other`` (a store of the same layout) into this one, as one block
        copy (the staged receive path's commit and refresh); returns the bytes copied.

        Raises:
            ValueError: the layouts differ.
        """
        if other.nbytes != self.nbytes or other.names() != self.names():
            raise ValueError("copy_from needs a store of the same layout")
        self._buf.copy_(other._buf)
        return self.nbytes

    def close(self) -> None:
        """Drop the views (the arena, if any, is its owner's to close)."""
        self._tensors.clear()


def padding_runs(t: LocalTensor) -> list[tuple[int, int]]:
    """The element runs ``(first, count)`` of ``t`` (row-major) that no piece covers: its padding
    (vocab rows past the vocabulary), written by no plan; none for a derived tensor (the engine
    computes all of it) or a constant one (it keeps its value)."""
    if t.derived or t.constant is not None or sum(box_volume(p.local_box) for p in t.pieces) >= t.numel:
        return []
    covered = sorted(r for p in t.pieces for r in box_runs(t.shape, p.local_box, 1))
    gaps: list[tuple[int, int]] = []
    at = 0
    for start, length in covered:
        if start > at:
            gaps.append((at, start - at))
        at = max(at, start + length)
    if at < t.numel:
        gaps.append((at, t.numel - at))
    return gaps


def _offsets(layout: list[LocalTensor]) -> dict[str, int]:
    out: dict[str, int] = {}
    size = 0
    for t in layout:
        out[t.name] = -(-size // ALIGN_BYTES) * ALIGN_BYTES
        size = out[t.name] + t.numel * torch_dtype(t.dtype).itemsize
    return out


def write_global(store: ParamStore, spec: ModelSpec, global_name: str, read: Callable[[Box], torch.Tensor]) -> int:
    """Write every piece of ``global_name`` this rank holds.

    Args:
        store: the rank's parameters.
        spec: the model (for the fp8 block size).
        global_name: the global tensor.
        read: returns the region ``box`` of the global tensor (any device, any float dtype).

    Returns:
        Bytes written into parameters.
    """
    written = 0
    pieces = store.pieces_of(global_name)
    scale_pieces = store.pieces_of(global_name + "_scale_inv")
    for k, (local_name, piece) in enumerate(pieces):
        dst = store[local_name]
        region = dst[box_slices(piece.local_box)]
        src = read(piece.global_box)
        if src.device == dst.device or src.dtype != dst.dtype:
            src = src.to(dst.device)  # casts and quantization run on the parameters' device
        if dst.dtype == torch.float8_e4m3fn and src.dtype != torch.float8_e4m3fn:
            assert spec.fp8_block is not None, f"{local_name} is fp8 but the spec has no fp8 block"
            q, scale = quantize_block_fp8(src, spec.fp8_block)
            region.copy_(q.view(region.shape))
            # The layout emits one scale piece per weight piece, in the same order.
            scale_name, scale_piece = scale_pieces[k]
            scale_region = store[scale_name][box_slices(scale_piece.local_box)]
            scale_region.copy_(scale.view(scale_region.shape))
            written += scale_region.numel() * scale_region.element_size()
        else:
            region.copy_(src.reshape(region.shape))
        written += region.numel() * region.element_size()
    return written
