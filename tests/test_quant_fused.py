"""Fused fp8 packing and batched MLA post-load are bit-identical to the per-op reference.

Contract: :class:`~weightsync.quant.fp8_fused.FusedQuant` over many 2-D boxes (strided column
boxes, partial edge blocks, an all-zero block, values-only / scales-only / both tasks) writes
exactly the bytes of :func:`~weightsync.quant.fp8.quantize_block_fp8` /
:func:`~weightsync.quant.fp8.block_scale_inv`. On the CPU the tables are executed by the
reference functions with every address resolved from the table (so a wrong offset fails here);
the GPU tests (marked ``gpu``) run the Triton kernels on fresh random data and compare with the
same reference computed by torch on the GPU. :func:`~weightsync.quant.mla.derive_all` equals
:func:`~weightsync.quant.mla.derive_w_kc_w_vc` layer by layer (bf16 and fp8 ``kv_b_proj``).
"""

from __future__ import annotations

import pytest
import torch

from weightsync.quant.fp8 import block_scale_inv, quantize_block_fp8
from weightsync.quant.fp8_fused import FusedQuant, QuantTask
from weightsync.quant.mla import MlaLayer, derive_all, derive_w_kc_w_vc

BOXES = [(0, 40, 0, 64), (8, 70, 16, 200), (16, 24, 32, 48), (0, 70, 0, 200), (64, 70, 192, 200)]
"""Row/column ranges of a [70, 200] source: aligned, strided, small, whole, one partial corner."""


def _tasks(device: str, block: tuple[int, int], seed: int) -> tuple[list[QuantTask], list[tuple[torch.Tensor, ...]]]:
    gen = torch.Generator(device=device).manual_seed(seed)
    src = (torch.randn(70, 200, generator=gen, device=device) * 3).to(torch.bfloat16)
    src[: block[0], : block[1]] = 0  # an all-zero block gets the floor scale
    staging = torch.full((1 << 20,), 0x7F, dtype=torch.uint8, device=device)  # poisoned
    off = 0

    def take(n: int) -> torch.Tensor:
        nonlocal off
        view = staging[off : off + n]
        off += -(-n // 256) * 256
        return view

    tasks, expected = [], []
    for k, (r0, r1, c0, c1) in enumerate(BOXES):
        box = src[r0:r1, c0:c1]
        r, c = box.shape
        nr, nc = -(-r // block[0]), -(-c // block[1])
        q = take(r * c).view(torch.float8_e4m3fn).view(r, c)
        s = take(4 * nr * nc).view(torch.float32).view(nr, nc)
        kind = k % 3  # both, values only, scales only
        tasks.append(QuantTask(src=box, q=q if kind != 2 else None, scale=s if kind != 1 else None))
        expected.append(quantize_block_fp8(box, block))
    return tasks, expected


def _check(tasks: list[QuantTask], expected: list[tuple[torch.Tensor, ...]]) -> None:
    for i, (t, (q, s)) in enumerate(zip(tasks, expected, strict=True)):
        if t.q is not None:
            assert torch.equal(t.q.view(torch.uint8), q.view(torch.uint8)), f"task {i}: fp8 values differ"
        if t.scale is not None:
            assert torch.equal(t.scale.view(torch.int32), s.view(torch.int32)), f"task {i}: scales differ"


@pytest.mark.parametrize("block", [(8, 16), (16, 16)], ids=["8x16", "16x16"])
def test_fused_tables_match_reference_on_cpu(block: tuple[int, int]) -> None:
    tasks, expected = _tasks("cpu", block, seed=1)
    fused = FusedQuant(tasks, block, use_kernel=False)
    assert fused.groups, "every task should go into a table"
    fused.run()
    _check(tasks, expected)


def test_scales_only_task_equals_block_scale_inv() -> None:
    src = torch.randn(33, 130).to(torch.bfloat16)
    out = torch.empty(5, 9, dtype=torch.float32)
    FusedQuant([QuantTask(src=src, scale=out)], (8, 16), use_kernel=False).run()
    assert torch.equal(out, block_scale_inv(src, (8, 16)))


def test_task_rejects_wrong_outputs() -> None:
    src = torch.zeros(8, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="values, the scales or both"):
        QuantTask(src=src)
    with pytest.raises(ValueError, match="float8_e4m3fn of shape"):
        QuantTask(src=src, q=torch.empty(8, 4, dtype=torch.float8_e4m3fn))


def _mla_layers(device: str, fp8: bool, n_layers: int = 3) -> tuple[list[MlaLayer], list[tuple[torch.Tensor, ...]]]:
    heads, nope, v, rank, block = 3, 16, 8, 64, (8, 16)
    gen = torch.Generator(device=device).manual_seed(7)
    layers, refs = [], []
    for _ in range(n_layers):
        w = torch.randn(heads * (nope + v), rank, generator=gen, device=device)
        kv, scale = quantize_block_fp8(w, block) if fp8 else (w.to(torch.bfloat16), None)
        kc = torch.full((heads, nope, rank), float("nan"), dtype=torch.bfloat16, device=device)
        vc = torch.full((heads, rank, v), float("nan"), dtype=torch.bfloat16, device=device)
        layers.append(MlaLayer(kv_b=kv, w_kc=kc, w_vc=vc, scale_inv=scale))
        rk, rv = torch.empty_like(kc), torch.empty_like(vc)
        derive_w_kc_w_vc(kv, rk, rv, qk_nope_head_dim=nope, v_head_dim=v, scale_inv=scale, block=block)
        refs.append((rk, rv))
    return layers, refs


def _check_mla(layers: list[MlaLayer], refs: list[tuple[torch.Tensor, ...]]) -> None:
    for i, (item, (rk, rv)) in enumerate(zip(layers, refs, strict=True)):
        assert torch.equal(item.w_kc.view(torch.int16), rk.view(torch.int16)), f"layer {i}: w_kc differs"
        assert torch.equal(item.w_vc.view(torch.int16), rv.view(torch.int16)), f"layer {i}: w_vc differs"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_derive_all_matches_per_layer_on_cpu(fp8: bool) -> None:
    layers, refs = _mla_layers("cpu", fp8)
    derive_all(layers, qk_nope_head_dim=16, v_head_dim=8, block=(8, 16))
    _check_mla(layers, refs)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(64, 64), (8, 16), (128, 128)], ids=["64x64", "8x16", "128x128"])
@pytest.mark.parametrize("seed", [1, 2])
def test_fused_kernel_bit_identical_on_gpu(block: tuple[int, int], seed: int) -> None:
    tasks, expected = _tasks("cuda", block, seed)
    fused = FusedQuant(tasks, block)
    assert fused.use_kernel, "the Triton kernel should run on a GPU"
    fused.run()
    torch.cuda.synchronize()
    _check(tasks, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_derive_all_kernel_bit_identical_on_gpu(fp8: bool) -> None:
    layers, refs = _mla_layers("cuda", fp8)
    derive_all(layers, qk_nope_head_dim=16, v_head_dim=8, block=(8, 16), use_kernel=True)
    torch.cuda.synchronize()
    _check_mla(layers, refs)
