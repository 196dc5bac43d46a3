"""The ``run`` command's per-step checksum gate follows sglang's checksum: the values it expects
are sglang's algorithm (checked against the plain numpy reference of tests/sglang_reference.py,
as the stand-in sglang computes them), and it reads an engine's answer in either sglang release's
shape (sglang 0.5.23 ``managers/io_struct.py`` ``ChecksumInfo``: ``parallelism_info`` a list of
role dicts; 0.5.16: one object), so ``run`` attached to a real sglang verifies."""

from __future__ import annotations

import pytest
import torch

from tests.sglang_fake import expected_checksums as reference_checksums
from tests.sglang_reference import per_gpu_checksum
from weightsync.launch.validate import engine_checksum_mismatches, expected_checksums
from weightsync.models import get_model
from weightsync.models.dtypes import torch_dtype
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import RolloutParallel

SPEC = get_model("Qwen3-4B", "tiny")
PAR = RolloutParallel(tp=2)


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {g.name: (torch.randn(g.shape, generator=gen) * 0.02).to(torch_dtype(g.dtype))
            for g in global_tensors(SPEC).values()}


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu_tensor_hash", "sha256"])
def test_the_gate_expects_sglangs_checksums(gpu: bool) -> None:
    """GPU engines: gpu_tensor_hash; CPU engines: sha256's first 8 bytes -- per rank, every listed
    parameter, equal to the reference sglang values of the same tensors."""
    full = full_tensors(seed=1)
    for rank in range(PAR.tp):
        got = expected_checksums(SPEC, PAR, rank, full.__getitem__, gpu=gpu)
        assert got == reference_checksums(SPEC, PAR, rank, full, gpu=gpu)
        assert len(got) > 10


def answer(per_rank: list[dict[str, str]], *, release: str) -> dict:
    """A ``/weights_checker`` checksum answer as that sglang release shapes it (one entry per TP rank)."""
    ranks = []
    for r, sums in enumerate(per_rank):
        info = {"tp_rank": r, "tp_size": len(per_rank), "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                "rank": r, "size": len(per_rank)}
        ranks.append({"checksums": sums, "per_gpu_checksum": per_gpu_checksum(sums),
                      "parallelism_info": [{"role": "target", **info}] if release == "0.5.23" else info})
    return {"success": True, "message": "Success.", "ranks": ranks, "per_engine_checksum": "0" * 64}


@pytest.mark.parametrize("release", ["0.5.23", "0.5.16"])
def test_the_gate_reads_either_release_and_names_what_differs(release: str) -> None:
    full = full_tensors(seed=2)
    want = [expected_checksums(SPEC, PAR, r, full.__getitem__, gpu=True) for r in range(PAR.tp)]
    assert engine_checksum_mismatches(answer(want, release=release), want) == []
    # ranks answered out of order (each DP-attention leader answers for its group): read by tp_rank
    shuffled = answer(want, release=release)
    shuffled["ranks"].reverse()
    assert engine_checksum_mismatches(shuffled, want) == []

    stale = [dict(w) for w in want]
    name = "model.layers.0.mlp.down_proj.weight"
    stale[1][name] = "0" * 16
    assert engine_checksum_mismatches(answer(stale, release=release), want) == [
        f"rank 1: 1 tensors differ, e.g. ['{name}']"]

    missing = answer(want, release=release)
    missing["ranks"].pop()
    assert engine_checksum_mismatches(missing, want) == ["rank 1: not in the answer (ranks [0])"]


def test_a_failed_checksum_answer_is_named() -> None:
    with pytest.raises(ValueError, match="not a successful checksum answer"):
        engine_checksum_mismatches({"success": False, "message": "Unsupported action=checksum"}, [{}])
