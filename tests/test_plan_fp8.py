"""Block fp8 quantization (weightsync.quant.fp8), the sender-side transforms of the plan.

Contract: quantizing a block-aligned region of a tensor equals the same region of quantizing the
whole tensor, bit for bit (so senders may quantize their shards); scale_inv = amax / 448 per
block; dequantization recovers the tensor within fp8 precision.
"""

from __future__ import annotations

import pytest
import torch

from weightsync.quant.fp8 import AMAX_FLOOR, FP8_MAX, block_scale_inv, dequantize_block_fp8, quantize_block_fp8


def _w(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(16, 16), (20, 12), (7, 5), (128, 64)], ids=lambda s: "x".join(map(str, s)))
def test_round_trip_within_fp8_precision(shape):
    w = _w(shape)
    q, s = quantize_block_fp8(w, (8, 8))
    assert q.dtype == torch.float8_e4m3fn
    assert s.shape == (-(-shape[0] // 8), -(-shape[1] // 8))
    back = dequantize_block_fp8(q, s, (8, 8), torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the block's scale range
    assert torch.all((back - w.float()).abs() <= s.repeat_interleave(8, 0).repeat_interleave(8, 1)[
        : shape[0], : shape[1]] * FP8_MAX * 2**-4)


@pytest.mark.parametrize(
    ("rows", "cols"),
    [((0, 8), (0, 8)), ((8, 20), (0, 12)), ((16, 20), (8, 12)), ((0, 20), (8, 12))],
    ids=["first-block", "row-band-with-edge", "edge-corner", "column-band"],
)
def test_region_quantization_equals_whole_tensor_quantization(rows, cols):
    w = _w((20, 12), seed=1)
    q_all, s_all = quantize_block_fp8(w, (8, 8))
    q, s = quantize_block_fp8(w[rows[0]:rows[1], cols[0]:cols[1]], (8, 8))
    assert torch.equal(q.view(torch.uint8), q_all[rows[0]:rows[1], cols[0]:cols[1]].view(torch.uint8))
    assert torch.equal(s, s_all[rows[0] // 8:-(-rows[1] // 8), cols[0] // 8:-(-cols[1] // 8)])


def test_scale_is_block_amax_over_448_with_a_floor():
    w = torch.zeros(16, 16, dtype=torch.bfloat16)
    w[0, 0] = 3.5
    w[9, 9] = -448.0
    s = block_scale_inv(w, (8, 8))
    assert s[0, 0].item() == pytest.approx(3.5 / FP8_MAX)
    assert s[1, 1].item() == pytest.approx(1.0)
    assert s[0, 1].item() == pytest.approx(AMAX_FLOOR / FP8_MAX)
    q, _ = quantize_block_fp8(w, (8, 8))
    assert q[9, 9].float().item() == -FP8_MAX
    assert q[0, 0].float().item() == FP8_MAX


def test_rejects_non_2d_input():
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8(torch.zeros(2, 2, 2), (8, 8))
