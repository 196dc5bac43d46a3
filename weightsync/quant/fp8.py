"""Block fp8 (e4m3) quantization of 2-D weights, DeepSeek-V3 style.

The engine of an fp8 model stores a linear weight ``W[R, C]`` as ``q[R, C]`` in
``float8_e4m3fn`` plus ``scale_inv[ceil(R/b0), ceil(C/b1)]`` in float32, one scale per
``[b0, b1]`` block (edge blocks may be partial): ``W ~= q * scale_inv`` blockwise. The sender
quantizes on the fly (transforms ``fp8_quant`` and ``fp8_scale`` of the plan), so the rule must
be a pure function of one block's values: then quantizing a block-aligned region of a shard
equals quantizing the whole tensor, bit for bit.

Rule (as the RL frameworks' ``per_block_cast_to_fp8``): ``amax = max(|x|)`` over the block in
float32, clamped below at ``1e-4``; ``q = fp8(x * (448 / amax))``; ``scale_inv = amax / 448``.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
AMAX_FLOOR = 1e-4
"""Lower bound on a block's amax, so that an all-zero block gets a finite scale."""


def _blocked_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-block max |w| in float32, shape ``[ceil(R/b0), ceil(C/b1)]`` (clamped at AMAX_FLOOR)."""
    if w.dim() != 2:
        raise ValueError(f"block fp8 quantization needs a 2-D tensor, got shape {tuple(w.shape)}")
    b0, b1 = block
    r, c = w.shape
    nr, nc = -(-r // b0), -(-c // b1)
    x = w.float().abs()
    if r % b0 or c % b1:
        # Zero-pad to whole blocks: zeros never raise a block's amax.
        x = torch.nn.functional.pad(x, (0, nc * b1 - c, 0, nr * b0 - r))
    amax = x.reshape(nr, b0, nc, b1).amax(dim=(1, 3))
    return amax.clamp(min=AMAX_FLOOR)


def _expand(s: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast a per-block tensor back to element shape (edge blocks cut to ``shape``)."""
    b0, b1 = block
    return s.repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)[: shape[0], : shape[1]]


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` as a true division on every device.

    CUDA divides a tensor by a Python scalar as a multiplication by its reciprocal, which rounds
    differently from the CPU's division; dividing by a tensor is a true division on both, so the
    scales a GPU sender writes equal the ones a CPU check expects, bit for bit.
    """
    return amax / torch.full_like(amax, FP8_MAX)


def block_scale_inv(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 ``scale_inv`` of ``w`` (one value per block).

    Args:
        w: 2-D weight (any float dtype).
        block: ``(b0, b1)`` block size.

    Returns:
        float32 tensor ``[ceil(R/b0), ceil(C/b1)]``.
    """
    return _scale_of(_blocked_amax(w, block))


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize ``w`` to float8_e4m3fn.

    Args:
        w: 2-D weight (any float dtype).
        block: ``(b0, b1)`` block size.

    Returns:
        ``(q, scale_inv)``: ``q`` float8_e4m3fn of ``w``'s shape, ``scale_inv`` float32 per block.
    """
    amax = _blocked_amax(w, block)
    factor = _expand(FP8_MAX / amax, block, tuple(w.shape))
    q = (w.float() * factor).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, _scale_of(amax)


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_block_fp8` (up to fp8 rounding).

    Args:
        q: float8_e4m3fn 2-D tensor.
        scale_inv: float32 per-block scales.
        block: ``(b0, b1)`` block size.
        dtype: result dtype.

    Returns:
        ``q * scale_inv`` blockwise, in ``dtype``.
    """
    return (q.float() * _expand(scale_inv.float(), block, tuple(q.shape))).to(dtype)


def reblock_scale_inv(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int],
                      into: tuple[int, int]) -> torch.Tensor:
    """The scales of a block-fp8 weight of ``shape`` in blocks of ``into``, each a sub-block of a
    ``block`` block (``into`` divides ``block``): every sub-block takes its block's scale, so the
    weight's fp8 values dequantize to the same numbers in either grid (a lossless re-blocking).

    Args:
        scale_inv: float32 ``[ceil(R/b0), ceil(C/b1)]`` of ``block``.
        shape: the weight's ``(R, C)``.
        block: the blocks ``scale_inv`` scales.
        into: the finer blocks, each side dividing ``block``'s.

    Returns:
        float32 ``[ceil(R/i0), ceil(C/i1)]``.

    Raises:
        ValueError: ``into`` does not divide ``block``.
    """
    if block[0] % into[0] or block[1] % into[1]:
        raise ValueError(f"fp8 blocks {list(into)} do not tile blocks {list(block)}: re-blocking would re-quantize")
    rows, cols = -(-shape[0] // into[0]), -(-shape[1] // into[1])
    k0, k1 = block[0] // into[0], block[1] // into[1]
    return scale_inv.repeat_interleave(k0, dim=0).repeat_interleave(k1, dim=1)[:rows, :cols].contiguous()
