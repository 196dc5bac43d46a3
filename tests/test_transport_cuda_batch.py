"""Batched device copies: the chunk-table arithmetic keeps every byte, and the kernels copy exactly.

Contract: expanding 2-D blocks gives back the runs they were grouped from; splitting runs into
aligned bodies and unaligned heads/tails, and cutting them into chunks, keeps the same
(source, destination) byte pairs. On a GPU (marked ``gpu``) each method of
:data:`~weightsync.transport.cuda_batch.COPY_METHODS` copies random scattered runs (odd offsets,
odd lengths, long runs) so that every written byte equals its source and every other byte keeps
its sentinel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightsync.transport.cuda_batch import block_runs, chunk_runs, copy_method, split_aligned
from weightsync.transport.runs import strided_blocks


def _runs(seed: int, n: int = 300) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows, dst = [], 1 << 20
    for _ in range(n):
        size = int(rng.integers(1, 5000))
        rows.append((int(rng.integers(1 << 12, 1 << 19)), dst, size))
        dst += size + int(rng.integers(0, 40))
    for i in range(20):  # strided equal runs: a 2-D block
        rows.append((1 << 22 | i * 4096, dst + i * 1024, 512))
    return np.array(rows, dtype=np.int64)


def _pairs(runs: np.ndarray) -> np.ndarray:
    """Every (src byte, dst byte) pair of ``runs``, sorted."""
    out = np.concatenate([np.stack([np.arange(s, s + n), np.arange(d, d + n)], 1) for s, d, n in runs.tolist()])
    return out[np.lexsort((out[:, 1], out[:, 0]))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_table_arithmetic_keeps_every_byte(seed: int) -> None:
    runs = _runs(seed)
    assert np.array_equal(block_runs(strided_blocks(runs)), runs)
    aligned, unaligned = split_aligned(runs)
    assert (aligned % 16 == 0).all()
    pieces = np.concatenate([chunk_runs(aligned, 4096), chunk_runs(unaligned, 4096)])
    assert (pieces[:, 2] <= 4096).all()
    assert (pieces[:, 2] > 0).all()
    assert np.array_equal(_pairs(pieces), _pairs(runs))


def test_copy_method_names_the_choices() -> None:
    assert copy_method("runs") == "runs"
    with pytest.raises(ValueError, match="kernel, memcpy_batch, runs"):
        copy_method("fast")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["kernel", "memcpy_batch", "runs"])
def test_device_copier_methods_copy_exactly(method: str) -> None:
    from weightsync.transport._cuda import CudaRuntime, DeviceCopier

    size = 8 << 20
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    dst = torch.full((size,), 0xA5, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(3)
    rows, off = [], 0
    while off < size - (1 << 20):
        n = int(rng.choice([1, 7, 100, 4097, 70000, 300000]))
        so = int(rng.integers(0, size - n))
        rows.append((src.data_ptr() + so, dst.data_ptr() + off, n))
        off += n + int(rng.integers(0, 33))
    runs = np.array(rows, dtype=np.int64)
    copier = DeviceCopier(CudaRuntime(), torch.cuda.current_device(), method=method)
    try:
        blocks = strided_blocks(runs)
        for _ in range(2):  # the second submission replays the prepared batch
            assert copier.wait(copier.submit(blocks), deadline=1e18)
    finally:
        copier.close()
    want = torch.full_like(dst, 0xA5).cpu()
    s_cpu = src.cpu()
    for s, d, n in runs.tolist():
        want[d - dst.data_ptr() : d - dst.data_ptr() + n] = s_cpu[s - src.data_ptr() : s - src.data_ptr() + n]
    assert torch.equal(dst.cpu(), want), f"{method}: {int((dst.cpu() != want).sum())} bytes differ"
