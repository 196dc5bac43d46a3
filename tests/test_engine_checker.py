"""Contract: the weight checker proves that a reload restores every byte, and names exactly the
tensors that differ.

snapshot -> reset_tensors -> reload the same checkpoint -> compare: all equal (fp8 weights,
their scales and the derived MLA w_kc/w_vc included); then perturb one tensor -> compare and
checksum name exactly that tensor. reset_tensors leaves vocab padding alone (no update writes it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine_helpers import one_torch_thread, tiny, write_tiny_checkpoint  # noqa: F401 -- autouse fixture
from weightsync.engine.engine import Engine
from weightsync.engine.tp import EngineGroups


@pytest.fixture(params=["Kimi-K2", "Qwen3-30B-A3B", "Qwen3-4B"])
def engine_and_ckpt(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Engine, str]:
    write_tiny_checkpoint(request.param, tmp_path)
    engine = Engine.build(tiny(request.param), EngineGroups.single(), device=torch.device("cpu"))
    engine.load_checkpoint(str(tmp_path))
    return engine, str(tmp_path)


def _perturbable(engine: Engine) -> str:
    """A bf16 tensor written by updates (not fp8, not derived)."""
    for name, t in engine.store.items():
        if t.dtype == torch.bfloat16 and not engine.store.meta[name].derived and "layers.1." in name and t.dim() == 2:
            return name
    raise AssertionError("no perturbable tensor")


def test_checker_cycle_reload_then_perturb(engine_and_ckpt: tuple[Engine, str]) -> None:
    engine, ckpt = engine_and_ckpt
    checker = engine.checker
    snap = checker.snapshot()
    assert snap["num_tensors"] == len(engine.store.names())
    before = checker.checksum()["checksums"]

    checker.reset_tensors(seed=5)
    reset = checker.compare()
    written = {n for n, t in engine.store.meta.items() if t.pieces or t.derived}
    assert not reset["equal"]
    assert {m["name"] for m in reset["mismatches"]} == written

    engine.load_checkpoint(ckpt)
    assert checker.compare() == {"equal": True, "num_tensors": snap["num_tensors"], "mismatches": []}
    assert checker.checksum()["checksums"] == before

    name = _perturbable(engine)
    engine.store[name][0, 0] += 1.0
    result = checker.compare()
    assert [m["name"] for m in result["mismatches"]] == [name]
    assert result["mismatches"][0]["num_diff"] == 1
    assert 0.5 <= result["mismatches"][0]["max_abs_diff"] <= 1.5
    after = checker.checksum()["checksums"]
    assert {n for n in after if after[n] != before[n]} == {name}


def test_reset_leaves_vocab_padding_zero(engine_and_ckpt: tuple[Engine, str]) -> None:
    engine, _ = engine_and_ckpt
    vocab = engine.spec.vocab_size
    embed = engine.store["model.embed_tokens.weight"]
    assert embed.shape[0] > vocab, "tiny vocab 300 is padded to 320"
    engine.checker.reset_tensors(seed=1)
    assert torch.count_nonzero(embed[vocab:]) == 0
    assert torch.count_nonzero(embed[:vocab]) > 0


def test_compare_without_snapshot_is_refused(engine_and_ckpt: tuple[Engine, str]) -> None:
    with pytest.raises(ValueError, match="no snapshot"):
        engine_and_ckpt[0].checker.compare()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_checksums_are_sglangs_where_the_parameters_are(device: str) -> None:
    """sglang's ``tensor_hash`` (``managers/mm_utils.py``): ``gpu_tensor_hash`` of a GPU tensor,
    the sha256 prefix of a CPU one; fp8 weights hashed dequantized (their scales not listed)."""
    from tests.sglang_reference import sglang_checksum
    from weightsync.engine.checker import WeightChecker
    from weightsync.layout.sglang import engine_layout
    from weightsync.models import get_model
    from weightsync.models.parallel import RolloutParallel
    from weightsync.sync.params import ParamStore
    from weightsync.sync.sglang_checksum import dequant_bf16

    store = ParamStore(engine_layout(get_model("Kimi-K2", "tiny"), RolloutParallel(), 0), torch.device(device))
    gen = torch.Generator().manual_seed(1)
    for name, t in store.items():
        values = torch.randint(0, 120 if name.endswith("_scale_inv") or t.dtype == torch.float8_e4m3fn else 256,
                               (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
        t.reshape(-1).view(torch.uint8).copy_(values)  # fp8 and scales: finite values (k/v scales: 0-dim)
    got = WeightChecker(store).checksum()["checksums"]
    gpu = device == "cuda"
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    scale = store[name + "_scale_inv"]
    assert got[name] == sglang_checksum(dequant_bf16(store[name].cpu(), scale.cpu()), gpu=gpu)
    assert not [n for n in got if n.endswith("_scale_inv")]
    assert not [n for n in got if n.endswith(("w_kc", "w_vc"))], "derived tensors are not sglang parameters"
    assert not [n for n in got if n.endswith((".k_scale", ".v_scale"))], "sglang skips the constant k/v scales"
    norm = "model.layers.0.input_layernorm.weight"
    assert got[norm] == sglang_checksum(store[norm], gpu=gpu)
