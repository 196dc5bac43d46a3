"""Contract: weightsync computes sglang's weight checksum exactly -- the hash, its composition per
tile, which tensors are listed, and the answer's two shapes.

* ``gpu_tensor_hash`` (torch int64, any device) equals the plain numpy reference
  (tests/sglang_reference.py) on every dtype and size, and the values sglang's own Triton kernel
  (``kernels/ops/memory/gpu_tensor_hash.py``, 0.5.23, run by Triton's interpreter with
  ``TRITON_INTERPRET=1``) printed for the same bytes (:data:`FROM_SGLANGS_KERNEL`).
* The CPU hash is sha256's first 8 bytes (``managers/mm_utils.py`` ``tensor_hash``).
* Words added tile by tile, split anywhere and in any order, give the whole tensor's hash.
* The listing (``utils/weight_checker.py`` ``_compute_checksum`` / ``_build_quantized_set``): a
  block-fp8 weight is hashed dequantized to bfloat16 with its scale (``fp8_utils.py``
  ``block_quant_dequant``), its scale is not listed, the skip list drops other tensors only.
* ``ranks[i].parallelism_info`` is a list of role dicts (0.5.23, ``io_struct.py`` ``ChecksumInfo``)
  or one object (0.5.16); both are read by TP rank.
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from tests.sglang_reference import gpu_hash_bytes, raw_bytes
from weightsync.sync.sglang_checksum import (
    TileSums,
    as_words,
    checksums,
    checksums_by_rank,
    dequant_bf16,
    gpu_tensor_hash,
    tensor_checksum,
)


def pattern(nbytes: int) -> torch.Tensor:
    """Deterministic bytes (the inputs :data:`FROM_SGLANGS_KERNEL` was computed on)."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 2654435761) >> 7 & 255).to(torch.uint8)


FROM_SGLANGS_KERNEL = [
    (14, torch.bfloat16, "17f37d832c42b0ef"),
    (60, torch.float32, "bdf351dcafca4120"),
    (13, torch.float8_e4m3fn, "0cbd28f6731e445f"),
    (2 * (8192 * 3 + 17), torch.bfloat16, "32dfdbca071a995e"),
]
"""``(bytes, dtype, hash)``: sglang 0.5.23's kernels on ``pattern(bytes).view(dtype)`` (0.5.16's
kernel file gives the same values)."""


@pytest.mark.parametrize(("nbytes", "dtype", "value"), FROM_SGLANGS_KERNEL, ids=lambda x: str(x))
def test_the_hash_is_sglangs_kernels(nbytes: int, dtype: torch.dtype, value: str) -> None:
    t = pattern(nbytes).view(dtype)
    assert f"{gpu_tensor_hash(t):016x}" == value
    assert f"{gpu_hash_bytes(raw_bytes(t)):016x}" == value, "the reference too"


SIZES = [0, 1, 2, 3, 4, 5, 4 * 8191 + 3, 4 * 8192, 4 * 8192 + 1, 4 * 3 * 8192 + 6, 4 * 40000 + 2]


@pytest.mark.parametrize("nbytes", SIZES)
def test_the_hash_equals_the_reference(nbytes: int) -> None:
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert gpu_tensor_hash(raw) == gpu_hash_bytes(raw.numpy().tobytes())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int32])
def test_every_dtype_hashes_its_raw_bytes(dtype: torch.dtype) -> None:
    t = torch.randn(37, 11, generator=torch.Generator().manual_seed(3)).mul(8).to(dtype)
    assert tensor_checksum(t, gpu=True) == f"{gpu_hash_bytes(raw_bytes(t)):016x}"
    sha = hashlib.sha256(raw_bytes(t)).digest()[:8]
    assert tensor_checksum(t, gpu=False) == f"{int.from_bytes(sha, 'big'):016x}"
    assert tensor_checksum(t) == tensor_checksum(t, gpu=False), "a CPU tensor hashes as sglang on the CPU does"


def test_tiles_compose_in_any_split_and_order() -> None:
    nbytes = 4 * (3 * 8192 + 100) + 2
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    words = as_words(raw)
    cuts = sorted(random.Random(1).sample(range(1, words.numel()), 40))
    pieces = [(a, b) for a, b in zip([0, *cuts], [*cuts, words.numel()])]
    random.Random(2).shuffle(pieces)
    sums = TileSums(nbytes)
    for a, b in pieces:
        sums.add(words[a:b], torch.arange(a, b))
    assert sums.value() == gpu_tensor_hash(raw)
    sums.add(words[:1], torch.arange(0, 1))  # a word counted twice is another hash
    assert sums.value() != gpu_tensor_hash(raw)


def sglang_block_dequant(q: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    """``block_quant_dequant`` as sglang writes it: scales repeated per block, cut, one fp32 multiply."""
    rep = s.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :q.shape[-2], :q.shape[-1]]
    return (q.to(torch.float32) * rep).to(torch.bfloat16)


def test_the_listing_dequantizes_fp8_and_drops_scales() -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 20, 16, generator=gen).to(torch.float8_e4m3fn)  # experts, 8x8 blocks
    s = torch.rand(3, 3, 2, generator=gen) + 0.5
    norm = torch.randn(16, generator=gen).to(torch.bfloat16)
    named = [("model.layers.0.mlp.experts.w13_weight", q), ("model.layers.0.mlp.experts.w13_weight_scale_inv", s),
             ("model.layers.0.input_layernorm.weight", norm), ("lm_head.weight", norm),
             ("model.layers.0.self_attn.attn_mqa.k_scale", torch.ones(())),  # _skip_weight_check (kv_cache.py)
             ("model.layers.0.self_attn.rotary_emb.cos_sin_cache", norm)]  # a non-persistent buffer
    got = checksums(named, skip=["lm_head", "experts"], gpu=True)
    assert list(got) == ["model.layers.0.mlp.experts.w13_weight", "model.layers.0.input_layernorm.weight"], (
        "scales, k/v scales and rotary caches never listed; the skip list drops plain tensors, not quantized weights")
    want = sglang_block_dequant(q, s, 8)
    assert torch.equal(dequant_bf16(q, s).view(torch.int16), want.view(torch.int16))
    assert got["model.layers.0.mlp.experts.w13_weight"] == f"{gpu_hash_bytes(raw_bytes(want)):016x}"
    with pytest.raises(ValueError, match="cannot infer the fp8 block"):
        dequant_bf16(q, s[..., :1].expand(3, 3, 3).contiguous())


def test_both_answer_shapes_are_read_by_tp_rank() -> None:
    place = {"tp_rank": 1, "tp_size": 2, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 1, "size": 2}
    v0523 = {"success": True, "message": "Success.", "per_engine_checksum": "x",
             "ranks": [{"checksums": {"a": "2"}, "per_gpu_checksum": "p", "parallelism_info": [
                 {"role": "target", **place}]},
                       {"checksums": {"a": "1"}, "per_gpu_checksum": "p", "parallelism_info": [
                           {"role": "target", **place, "tp_rank": 0}, {"role": "draft", **place, "tp_rank": 0}]},
                       {"checksums": {"a": "other"}, "per_gpu_checksum": "p", "parallelism_info": [
                           {"role": "target", **place}]}]}
    assert checksums_by_rank(v0523) == {0: {"a": "1"}, 1: {"a": "2"}}, "by tp_rank; a repeated rank keeps its first"
    v0516 = {"success": True, "message": "Success.", "per_engine_checksum": "x",
             "ranks": [{"checksums": {"a": "1"}, "per_gpu_checksum": "p", "parallelism_info": place}]}
    assert checksums_by_rank(v0516) == {1: {"a": "1"}}
    with pytest.raises(ValueError, match="not a successful checksum answer"):
        checksums_by_rank({"success": False, "message": "Unsupported action=x"})
