"""Contract: the fingerprint is one function of the bytes, whoever computes it, and it catches what
a wrong write does.

* The torch path, the numpy path and every batch execution equal the definition computed over
  Python integers (:func:`~weightsync.fingerprint.hash.element_hash`), for 1-, 2- and 4-byte
  elements, element indices past 2^32 and any seed; the Triton kernel too, run by Triton's
  interpreter on the CPU (skipped where Triton is not installed) and on a GPU (marked ``gpu``).
* For one position the hash is a bijection of the element's bits: one differing element always
  changes the fingerprint.
* A flipped bit, a run written at a wrong offset, a write that did not happen over a different old
  value and a write of anyone else all change it; partials over disjoint element ranges, taken in
  any order and cut anywhere, add up to the whole.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import REPO_ROOT
from weightsync.fingerprint import MASK64, FingerprintBatch, fingerprint_tensor, whole_tensors
from weightsync.fingerprint.batch import (
    COUNT,
    FIRST,
    OFFSET,
    SLOT,
    SOURCE,
    SPAN_FIELDS,
    split_at_index_period,
    triton_available,
)
from weightsync.fingerprint.copy_batch import CopyFingerprintBatch
from weightsync.fingerprint.hash import element_bits, element_hash, hash_elements, hash_elements_np

SEED = 0x0DDB_A11_5EED


def _reference(t: torch.Tensor, first: int = 0, seed: int = SEED) -> int:
    """The fingerprint by the definition, one Python integer per element."""
    bits = element_bits(t).tolist()
    return sum(element_hash(b, first + i, seed) for i, b in enumerate(bits)) & MASK64


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(37, 29, generator=gen).to(torch.bfloat16),
        torch.randn(301, generator=gen),  # float32
        torch.randn(64, 3, generator=gen).to(torch.float8_e4m3fn),
        torch.randint(-(1 << 31), (1 << 31) - 1, (55,), generator=gen, dtype=torch.int32),
        torch.randn(5, generator=gen).to(torch.float16),
    ]


@pytest.mark.parametrize("first", [0, 12345, (1 << 32) - 3, 5 << 32])
@pytest.mark.parametrize("seed", [0, 1, SEED, (1 << 63) - 1])
def test_every_path_computes_the_definition(first: int, seed: int) -> None:
    rng = np.random.default_rng(first ^ seed)
    bits = rng.integers(0, 1 << 32, 200, dtype=np.uint64)
    bits[:4] = [0, 1, (1 << 32) - 1, 1 << 31]
    k = np.arange(first, first + 200, dtype=np.uint64)
    want = [element_hash(int(b), int(i), seed) for b, i in zip(bits, k, strict=True)]
    by_torch = hash_elements(torch.from_numpy(bits.astype(np.int64)), torch.from_numpy(k.astype(np.int64)), seed)
    assert [v & MASK64 for v in by_torch.tolist()] == want
    assert hash_elements_np(bits.copy(), k, seed).tolist() == want


@pytest.mark.parametrize("method", ["numpy", "torch"])
def test_batches_equal_the_definition(method: str) -> None:
    ts = _tensors()
    out = torch.zeros(len(ts), dtype=torch.int64)
    whole_tensors(ts, method=method).run(out, SEED)
    assert [v & MASK64 for v in out.tolist()] == [_reference(t) for t in ts]
    assert [fingerprint_tensor(t, seed=SEED) for t in ts] == [_reference(t) for t in ts]


def test_one_position_is_a_bijection_of_the_bits() -> None:
    """Every 16-bit value at one index hashes differently (so does every value of a sample of 32 bits)."""
    for k in (0, 7, (1 << 32) + 1):
        all16 = hash_elements_np(np.arange(1 << 16, dtype=np.uint64), np.full(1 << 16, k, dtype=np.uint64), SEED)
        assert len(np.unique(all16)) == 1 << 16
    sample = np.random.default_rng(0).choice(1 << 32, 1 << 16, replace=False).astype(np.uint64)
    assert len(np.unique(hash_elements_np(sample, np.zeros(1 << 16, dtype=np.uint64), SEED))) == 1 << 16


def _fp(t: torch.Tensor, seed: int = SEED) -> int:
    return fingerprint_tensor(t, seed=seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_every_flipped_bit_changes_it(dtype: torch.dtype) -> None:
    t = torch.randn(16, 16).to(dtype)
    base = _fp(t)
    raw = t.view(-1).view(torch.uint8)
    for byte in (0, 1, raw.numel() // 2, raw.numel() - 1):
        for bit in range(8):
            raw[byte] ^= 1 << bit
            assert _fp(t) != base, (byte, bit)
            raw[byte] ^= 1 << bit
    assert _fp(t) == base


def test_a_run_at_a_wrong_offset_a_missing_write_and_a_foreign_write_change_it() -> None:
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    new = old + torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    want = _fp(new)
    for shift in (1, 2, 32, 33):  # row 5 written `shift` elements further on
        wrong = new.clone().view(-1)
        wrong[5 * 32 : 6 * 32] = old.view(-1)[5 * 32 : 6 * 32]
        wrong[5 * 32 + shift : 6 * 32 + shift] = new.view(-1)[5 * 32 : 6 * 32]
        assert _fp(wrong) != want, shift
    missing = new.clone()
    missing[7] = old[7]  # one op did not happen
    assert _fp(missing) != want
    foreign = new.clone()
    foreign[63, 31] = 0.5 if float(new[63, 31]) != 0.5 else 0.25
    assert _fp(foreign) != want
    swapped = new.clone()
    swapped[[2, 3]] = new[[3, 2]]  # the same bytes, two rows exchanged
    assert not torch.equal(swapped, new)
    assert _fp(swapped) != want
    assert _fp(new, seed=SEED + 1) != want


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=999), max_size=12, unique=True), seed=st.integers(0, 2**63 - 1),
       order=st.randoms(use_true_random=False))
def test_partials_over_disjoint_ranges_add_up_to_the_whole(cuts: list[int], seed: int, order) -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    bounds = [0, *sorted(cuts), 1000]
    ranges = list(itertools.pairwise(bounds))
    order.shuffle(ranges)
    parts = [fingerprint_tensor(t[a:b], first=a, seed=seed) for a, b in ranges]
    assert sum(parts) & MASK64 == fingerprint_tensor(t, seed=seed)
    spans = np.array([(0, 2 * a, b - a, 2, a, 0) for a, b in ranges], dtype=np.int64)
    out = torch.zeros(1, dtype=torch.int64)
    FingerprintBatch([t], spans, num_slots=1, method="numpy").run(out, seed)
    assert out.item() & MASK64 == fingerprint_tensor(t, seed=seed)


@pytest.mark.parametrize(("first", "count", "esize", "want"), [
    (0, 5, 2, [(0, 5)]),
    (5, 3, 2, [(5, 3)]),
    (5, 4, 2, [(5, 3), (8, 1)]),
    (5, 20, 4, [(5, 3), (8, 8), (16, 8), (24, 1)]),
    (16, 8, 1, [(16, 8)]),
], ids=["inside", "ends-at-boundary", "crosses-once", "crosses-thrice", "one-whole-period"])
def test_spans_are_cut_where_the_element_index_crosses_a_period(first: int, count: int, esize: int,
                                                                 want: list[tuple[int, int]]) -> None:
    """The kernel takes an element index's high half as its program's: the table builder cuts
    every span at the multiples of the period (2^32; 8 here), keeping its elements and order."""
    spans = np.array([[1, 64, count, esize, first, 2]], dtype=np.int64)
    out = split_at_index_period(spans, period=8)
    assert [(int(f), int(n)) for f, n in out[:, [FIRST, COUNT]]] == want
    assert (out[:, OFFSET] == 64 + (out[:, FIRST] - first) * esize).all()
    assert (out[:, SOURCE] == 1).all()
    assert (out[:, SLOT] == 2).all()


def test_a_span_outside_its_source_or_misaligned_is_refused() -> None:
    t = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside their source"):
        FingerprintBatch([t], np.array([[0, 0, 11, 2, 0, 0]]), num_slots=1)
    with pytest.raises(ValueError, match="not aligned"):
        FingerprintBatch([t], np.array([[0, 1, 2, 2, 0, 0]]), num_slots=1)
    with pytest.raises(ValueError, match="slots outside"):
        FingerprintBatch([t], np.array([[0, 0, 2, 2, 0, 1]]), num_slots=1)


def _mixed_batch(method: str, device: str, num_spans: int = 60) -> tuple[FingerprintBatch, list[int]]:
    """Spans over every element size, at odd and aligned offsets, crossing chunk boundaries, with
    element indices past 2^32, from sources that are not 16-byte aligned too; and the expected
    slot values by the definition."""
    gen = torch.Generator().manual_seed(5)
    block = torch.randint(0, 256, (1 << 16,), generator=gen, dtype=torch.uint8)
    # One fresh allocation on the device, then a view one byte in: on every device (CPU too) the
    # second source starts 1 byte past an allocation's aligned start, so the spans below (aligned
    # to their element size from that address) are the same spans everywhere.
    whole = block.to(device, copy=True)
    sources = [whole, whole[1:]]  # the second one is not 16-byte aligned
    assert sources[0].data_ptr() % 16 == 0
    assert sources[1].data_ptr() % 16 == 1
    rng = np.random.default_rng(6)
    rows, want = [], [0, 0, 0]
    for _ in range(num_spans):
        src, esize = int(rng.integers(0, 2)), int(rng.choice([1, 2, 4]))
        base = 0 if src == 0 else 1
        off = int(rng.integers(0, 20_000)) // esize * esize
        if (base + off) % esize:
            off += esize - (base + off) % esize
        count = int(rng.integers(1, 5000))
        first = int(rng.choice([0, 1000, (1 << 32) - 100, 3 << 32]))
        slot = int(rng.integers(0, 3))
        rows.append((src, off, count, esize, first, slot))
        raw = block[base + off : base + off + count * esize]
        elems = raw.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[esize])
        want[slot] = (want[slot] + _reference(elems, first)) & MASK64
    spans = np.array(rows, dtype=np.int64).reshape(-1, SPAN_FIELDS)
    return FingerprintBatch(sources, spans, num_slots=3, method=method, chunk_bytes=1024, block=128), want


@pytest.mark.parametrize("method", ["numpy", "torch"])
def test_a_mixed_batch_equals_the_definition(method: str) -> None:
    batch, want = _mixed_batch(method, "cpu")
    out = torch.zeros(3, dtype=torch.int64)
    batch.run(out, SEED)
    assert [v & MASK64 for v in out.tolist()] == want


def run_kernel_on_cpu() -> None:
    """The Triton kernel through the interpreter (``TRITON_INTERPRET=1`` set before Triton is imported)."""
    batch, want = _mixed_batch("kernel", "cpu", num_spans=20)
    assert len(batch._tables) == 2, "both alignment classes"
    for seed in (SEED, 3):  # a small seed arrives as int32, a large one as int64
        out, expect = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
        batch.run(out, seed)
        _mixed_batch("numpy", "cpu", num_spans=20)[0].run(expect, seed)
        assert out.tolist() == expect.tolist()
        if seed == SEED:
            assert [v & MASK64 for v in out.tolist()] == want
    ts = _tensors()
    out = torch.zeros(len(ts), dtype=torch.int64)
    whole_tensors(ts, method="kernel").run(out, SEED)
    assert [v & MASK64 for v in out.tolist()] == [_reference(t) for t in ts]
    print("kernel ok")


def run_copy_kernel_on_cpu() -> None:
    """The copy-and-hash kernel through the interpreter: rows of every element size, with source
    and destination agreeing modulo 16 and not, crossing chunks and an element index of 2^32; the
    destination gets exactly the source's bytes (and nothing else changes), the slots the values
    the definition gives (as a :class:`FingerprintBatch` over the source computes them)."""
    gen = torch.Generator().manual_seed(8)
    src = torch.randint(0, 256, (1 << 16,), generator=gen, dtype=torch.uint8)
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    rng = np.random.default_rng(9)
    rows, spans, want = [], [], dst.clone()
    dst_at = 0
    for _ in range(24):
        esize = int(rng.choice([1, 2, 4]))
        off = int(rng.integers(0, 20_000)) // esize * esize
        dst_at = (dst_at + int(rng.choice([0, 16, esize * int(rng.integers(1, 8))]))) // esize * esize
        count = int(rng.integers(1, 700))
        first, slot = int(rng.choice([0, 7, (1 << 32) - 50])), int(rng.integers(0, 3))
        rows.append((src.data_ptr() + off, dst.data_ptr() + dst_at, count, esize, first, slot))
        spans.append((0, off, count, esize, first, slot))
        want[dst_at : dst_at + count * esize] = src[off : off + count * esize]
        dst_at += count * esize
    batch = CopyFingerprintBatch(np.array(rows), src, dst, num_slots=3, chunk_bytes=512, block=64)
    assert len(batch.tables) == 2, "both alignment classes"
    out, expect = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    batch.run(out, SEED)
    FingerprintBatch([src], np.array(spans), num_slots=3, method="numpy").run(expect, SEED)
    assert torch.equal(dst, want)
    assert out.tolist() == expect.tolist()
    print("kernel ok")


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed (the GPU images have it; the CPU "
                    "set-up does not install it)")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", ["run_kernel_on_cpu", "run_copy_kernel_on_cpu"])
def test_the_triton_kernel_in_the_interpreter_equals_the_definition(run: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"from tests.test_fingerprint_hash import {run}; {run}()"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=580)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "kernel ok" in done.stdout, done.stdout


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed (the GPU images have it; the CPU "
                    "set-up does not install it)")
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("copy", [False, True], ids=["hash", "copy-and-hash"])
def test_the_triton_kernel_compiles_for_hopper(copy: bool, aligned: bool) -> None:
    """Compiled ahead of time for sm_90 (Triton's own ptxas, no GPU): the interpreter runs the
    kernel's Python, and does not refuse what the compiler does (branches of different types)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from weightsync.fingerprint import _kernel

    sig = {"table": "*i64", "src_base": "*u8", "dst_base": "*u8", "out": "*i64", "seed": "i64", "BLOCK": "constexpr",
           "ALIGNED": "constexpr", "COPY": "constexpr"}
    src = ASTSource(fn=_kernel._chunks, signature=sig, constexprs={"BLOCK": 1024, "ALIGNED": aligned, "COPY": copy},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    compiled = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton")
def test_the_triton_kernel_on_a_gpu_equals_the_torch_path() -> None:
    for method in ("kernel", "torch"):
        batch, want = _mixed_batch(method, "cuda")
        out = torch.zeros(3, dtype=torch.int64, device="cuda")
        batch.run(out, SEED)
        assert [v & MASK64 for v in out.tolist()] == want, method
    big = torch.randn(1 << 24, device="cuda").to(torch.bfloat16)
    outs = []
    for method in ("kernel", "torch"):
        out = torch.zeros(1, dtype=torch.int64, device="cuda")
        whole_tensors([big], method=method).run(out, SEED)
        outs.append(out.item())
    assert outs[0] == outs[1]
