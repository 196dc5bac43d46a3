"""Fused block fp8 quantization of many tensors at once, bit-identical to :mod:`weightsync.quant.fp8`.

A sender packs a bucket of ``fp8_quant`` / ``fp8_scale`` ops (each a 2-D box of a bf16
parameter: one expert's projection, one attention weight) into staging. Done one op at a time
with torch (:func:`~weightsync.quant.fp8.quantize_block_fp8`: abs, pad, amax, reciprocal, two
``repeat_interleave``, multiply, clamp, cast) that is about ten passes over each op's bytes plus
a Python iteration: Kimi-K2's two layers took 539 ms for 34.6 GB of bf16 (64 GB/s). Here a
:class:`FusedQuant` is built once per bucket from its :class:`QuantTask` list into a device table
and one Triton launch (:mod:`weightsync.quant._fp8_kernel`) reads every source byte once and
writes the fp8 values and the scales; a task that asks for both (a weight and its
``weight_scale_inv`` in the same bucket) reads its source once for the two.

Without a GPU or Triton the same tables are executed by the reference functions, one task at
a time (:meth:`FusedQuant.run` on CPU), so the table arithmetic is tested everywhere.

Legend: ``B0 x B1`` the fp8 block, ``G`` column blocks per program.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weightsync.quant.fp8 import block_scale_inv, quantize_block_fp8

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_GROUP = 2
"""Column blocks per program (``G``)."""
DEFAULT_WARPS = 4
MAX_COL_GROUPS = 65535
"""CUDA's limit on the second grid dimension."""
TASK_FIELDS = 7


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantTask:
    """Quantize the 2-D ``src`` (row stride free, column stride 1) into ``q`` and/or ``scale``."""

    src: torch.Tensor
    q: torch.Tensor | None = None
    """Contiguous float8_e4m3fn of ``src``'s shape, or None (scales only)."""
    scale: torch.Tensor | None = None
    """Contiguous float32 ``[ceil(R/b0), ceil(C/b1)]``, or None (values only)."""

    def __post_init__(self) -> None:
        if self.src.dim() != 2 or (self.src.shape[1] > 1 and self.src.stride(1) != 1):
            raise ValueError(f"a quantization source must be 2-D with unit column stride, got shape "
                             f"{tuple(self.src.shape)} strides {self.src.stride()}")
        if self.q is None and self.scale is None:
            raise ValueError("a quantization task must write the values, the scales or both")
        if self.q is not None and (self.q.dtype != FP8 or tuple(self.q.shape) != tuple(self.src.shape)
                                   or not self.q.is_contiguous()):
            raise ValueError(f"q must be contiguous float8_e4m3fn of shape {tuple(self.src.shape)}")
        if self.scale is not None and (self.scale.dtype != torch.float32 or not self.scale.is_contiguous()):
            raise ValueError("scale must be contiguous float32")


def triton_available() -> bool:
    """Whether the Triton kernel can run here (Triton importable and a CUDA device)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _addr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


@dataclass(frozen=True, kw_only=True, slots=True)
class _Group:
    """Tasks of one source dtype and alignment class, as device tables."""

    tasks: torch.Tensor
    """``(T, TASK_FIELDS)`` int64 (see :data:`weightsync.quant._fp8_kernel.TASK_FIELDS`)."""
    strips: torch.Tensor
    """``(S, 2)`` int64 ``[task, block row]``."""
    src: torch.Tensor
    """The source at the lowest address: the kernel's source pointer (offsets are relative to it)."""
    out: torch.Tensor
    """The output at the lowest address, as uint8: the kernel's output pointer."""
    src_base: int
    out_base: int
    col_groups: int
    aligned: bool
    dtype: torch.dtype


class FusedQuant:
    """Tasks prepared once; :meth:`run` quantizes all of them (one launch per dtype/alignment group)."""

    def __init__(self, tasks: Sequence[QuantTask], block: tuple[int, int], *, group: int = DEFAULT_GROUP,
                 num_warps: int = DEFAULT_WARPS, use_kernel: bool | None = None) -> None:
        """Args:
        tasks: what to quantize (sources and outputs stay allocated while this object is used).
        block: the fp8 block ``(b0, b1)``.
        group: column blocks per program.
        num_warps: warps per program.
        use_kernel: force the Triton kernel (True) or the reference execution (False); default:
            the kernel when :func:`triton_available` and every tensor is on one CUDA device.
        """
        self.block = (int(block[0]), int(block[1]))
        self.group, self.num_warps = group, num_warps
        self.tasks = list(tasks)
        devices = {t.src.device for t in self.tasks} | {o.device for t in self.tasks for o in (t.q, t.scale)
                                                           if o is not None}
        if use_kernel is None:
            use_kernel = triton_available() and len(devices) == 1 and next(iter(devices), None) is not None \
                and next(iter(devices)).type == "cuda"
        self.use_kernel = bool(use_kernel) and bool(self.tasks)
        self.device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        self.groups: list[_Group] = []
        self.rest: list[QuantTask] = []
        self._build()

    @property
    def src_bytes(self) -> int:
        """Source bytes read per :meth:`run`."""
        return sum(t.src.numel() * t.src.element_size() for t in self.tasks)

    @property
    def out_bytes(self) -> int:
        """Bytes written per :meth:`run` (values and scales)."""
        return sum(o.numel() * o.element_size() for t in self.tasks for o in (t.q, t.scale) if o is not None)

    def _build(self) -> None:
        b1 = self.block[1]
        by_key: dict[tuple[torch.dtype, bool], list[QuantTask]] = {}
        for t in self.tasks:
            if t.src.dtype not in SOURCE_DTYPES or t.src.numel() == 0:
                self.rest.append(t)
                continue
            isz = t.src.element_size()
            pitch = t.src.stride(0) if t.src.shape[0] > 1 else t.src.shape[1]
            aligned = (_addr(t.src) % 16 == 0 and (pitch * isz) % 16 == 0 and t.src.shape[1] % 16 == 0
                       and (t.q is None or _addr(t.q) % 16 == 0))
            by_key.setdefault((t.src.dtype, aligned), []).append(t)
        for (dtype, aligned), ts in by_key.items():
            cols_max = max(t.src.shape[1] for t in ts)
            col_groups = -(-cols_max // (b1 * self.group))
            if self.use_kernel and col_groups > MAX_COL_GROUPS:
                self.rest.extend(ts)
                continue
            self.groups.append(self._group(ts, dtype, aligned, col_groups))

    def _group(self, ts: list[QuantTask], dtype: torch.dtype, aligned: bool, col_groups: int) -> _Group:
        b0, b1 = self.block
        isz = dtype.itemsize
        src_ref = min((t.src for t in ts), key=_addr)
        outs = [o for t in ts for o in (t.q, t.scale) if o is not None]
        out_ref = min(outs, key=_addr)
        src_base, out_base = _addr(src_ref), _addr(out_ref)
        rows = np.zeros((len(ts), TASK_FIELDS), dtype=np.int64)
        for i, t in enumerate(ts):
            r, c = t.src.shape
            off = _addr(t.src) - src_base
            if off % isz:
                raise ValueError(f"source of task {i} is not {isz}-byte aligned")
            pitch = t.src.stride(0) if r > 1 else c
            rows[i] = (off // isz, pitch, r, c, _addr(t.q) - out_base if t.q is not None else 0,
                       _addr(t.scale) - out_base if t.scale is not None else 0,
                       (t.q is not None) | ((t.scale is not None) << 1))
            if t.scale is not None and tuple(t.scale.shape) != (-(-r // b0), -(-c // b1)):
                raise ValueError(f"scale of task {i} has shape {tuple(t.scale.shape)}, expected "
                                 f"{(-(-r // b0), -(-c // b1))} for a [{r}, {c}] source in {b0}x{b1} blocks")
        nstrip = -(-rows[:, 2] // b0)
        task_idx = np.repeat(np.arange(len(ts)), nstrip)
        brow = np.arange(len(task_idx), dtype=np.int64) - np.repeat(np.cumsum(nstrip) - nstrip, nstrip)
        strips = np.stack([task_idx, brow], axis=1)
        dev = self.device if self.use_kernel else torch.device("cpu")
        return _Group(
            tasks=torch.from_numpy(rows).to(dev),
            strips=torch.from_numpy(np.ascontiguousarray(strips)).to(dev),
            src=src_ref,
            out=out_ref.view(torch.uint8),
            src_base=src_base,
            out_base=out_base,
            col_groups=col_groups,
            aligned=aligned,
            dtype=dtype,
        )

    def run(self) -> None:
        """Quantize every task (enqueued on the current stream when on the GPU)."""
        if self.use_kernel:
            from weightsync.quant import _fp8_kernel

            for g in self.groups:
                _fp8_kernel.launch(g.tasks, g.strips, g.src, g.out, block=self.block, group=self.group,
                                   col_groups=g.col_groups, aligned=g.aligned, num_warps=self.num_warps)
        else:
            for g in self.groups:
                self._emulate(g)
        for t in self.rest:
            _reference(t, self.block)

    def _emulate(self, g: _Group) -> None:
        """Execute a group's table with the reference functions (what the kernel computes)."""
        isz = g.dtype.itemsize
        for so, pitch, r, c, qo, sco, flags in g.tasks.tolist():
            src = torch.as_strided(_find(self.tasks, g.src_base + so * isz, "src"), (r, c), (pitch, 1))
            q = _find(self.tasks, g.out_base + qo, "q") if flags & 1 else None
            scale = _find(self.tasks, g.out_base + sco, "scale") if flags & 2 else None
            _reference(QuantTask(src=src, q=q, scale=scale), self.block)


def _find(tasks: Sequence[QuantTask], addr: int, field: str) -> torch.Tensor:
    """The task tensor ``field`` that starts at ``addr`` (the CPU execution resolves table
    addresses back to tensors, so that a wrong offset in the table is a wrong result there too)."""
    for t in tasks:
        x = getattr(t, field)
        if x is not None and _addr(x) == addr:
            return x
    raise AssertionError(f"no task {field} at address {addr:#x}: the quantization table is wrong")


def _reference(t: QuantTask, block: tuple[int, int]) -> None:
    if t.q is not None:
        q, scale = quantize_block_fp8(t.src, block)
        t.q.copy_(q)
        if t.scale is not None:
            t.scale.copy_(scale)
    elif t.scale is not None:
        t.scale.copy_(block_scale_inv(t.src, block))
