"""Contract of the checkpoint layer the engine loads from (weightsync/models/checkpoint.py) and of
the loader's refusals:

* the synthetic checkpoint has exactly the global tensors of the model, and its fp8 weights are
  fp8-exact (quantize -> dequantize gives the bf16 weight back, bit for bit);
* files round-trip, sharded or not, and slices are read lazily;
* dummy weights equal the synthetic checkpoint of the same seed, byte for byte;
* a real-fp8 checkpoint (float8 weights + scales in the file) loads the same bytes as the bf16 one;
* unknown, missing and mis-shaped tensors are refused together, by name; tensors of layers beyond
  the model (MTP) are ignored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine_helpers import FAMILY_MODELS, SEED, one_torch_thread, tiny  # noqa: F401 -- autouse fixture
from weightsync.engine.engine import Engine
from weightsync.engine.loader import CheckpointError, validate_checkpoint
from weightsync.engine.tp import EngineGroups
from weightsync.models.checkpoint import (
    HFCheckpoint,
    hf_config_dict,
    read_hf_checkpoint,
    synthetic_hf_tensor,
    synthetic_hf_tensors,
    write_hf_checkpoint,
)
from weightsync.models.hf import global_tensors
from weightsync.quant.fp8 import dequantize_block_fp8, quantize_block_fp8


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_synthetic_checkpoint_matches_global_tensors(name: str) -> None:
    spec = tiny(name)
    tensors = synthetic_hf_tensors(spec, SEED)
    table = global_tensors(spec)
    assert list(tensors) == list(table)
    for n, t in tensors.items():
        assert tuple(t.shape) == table[n].shape, n
        assert str(t.dtype) == f"torch.{table[n].dtype}", n
    one = next(iter(table))
    assert torch.equal(synthetic_hf_tensor(spec, one, SEED), tensors[one])
    cfg = hf_config_dict(spec)
    assert cfg["architectures"] == [spec.hf_architecture]
    assert cfg["num_hidden_layers"] == spec.num_layers


def test_fp8_synthetic_weights_are_exact() -> None:
    spec = tiny("Kimi-K2")
    tensors = synthetic_hf_tensors(spec, SEED)
    quantized = [gt for gt in global_tensors(spec).values() if gt.block is not None and gt.quant_of is None]
    assert quantized
    for gt in quantized:
        w = tensors[gt.name]
        q, scale = quantize_block_fp8(w, gt.block)
        assert torch.equal(scale, tensors[gt.name + "_scale_inv"])
        assert torch.equal(torch.log2(scale), torch.log2(scale).round()), "power-of-two scales"
        assert torch.equal(dequantize_block_fp8(q, scale, gt.block), w)


def test_sharded_round_trip_and_lazy_slices(tmp_path: Path) -> None:
    spec = tiny("GLM-5")
    tensors = synthetic_hf_tensors(spec, SEED)
    write_hf_checkpoint(tmp_path, tensors, hf_config_dict(spec), max_shard_bytes=64_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    back, cfg = read_hf_checkpoint(tmp_path)
    assert cfg == hf_config_dict(spec)
    assert set(back) == set(tensors)
    assert all(torch.equal(back[n], tensors[n]) for n in tensors)
    with HFCheckpoint(tmp_path) as ckpt:
        name = "model.layers.1.mlp.experts.3.up_proj.weight"
        assert ckpt.meta(name) == (tuple(tensors[name].shape), "bfloat16")
        assert torch.equal(ckpt.get_slice(name, ((2, 5), (0, 7))), tensors[name][2:5, :7])


def _engine(name: str) -> Engine:
    return Engine.build(tiny(name), EngineGroups.single(), device=torch.device("cpu"))


@pytest.mark.parametrize("name", ["Kimi-K2", "GLM-4.5-Air"])
def test_dummy_weights_equal_the_synthetic_checkpoint(name: str, tmp_path: Path) -> None:
    spec = tiny(name)
    write_hf_checkpoint(tmp_path, synthetic_hf_tensors(spec, SEED), hf_config_dict(spec))
    a, b = _engine(name), _engine(name)
    a.load_dummy(SEED)
    b.load_checkpoint(str(tmp_path))
    for n, t in a.store.items():
        assert torch.equal(t.reshape(-1).view(torch.uint8), b.store[n].reshape(-1).view(torch.uint8)), n


def test_fp8_checkpoint_loads_the_same_bytes_as_bf16(tmp_path: Path) -> None:
    spec = tiny("Kimi-K2")
    tensors = synthetic_hf_tensors(spec, SEED)
    fp8 = dict(tensors)
    for gt in global_tensors(spec).values():
        if gt.block is not None and gt.quant_of is None:
            fp8[gt.name], fp8[gt.name + "_scale_inv"] = quantize_block_fp8(tensors[gt.name], gt.block)
    write_hf_checkpoint(tmp_path / "bf16", tensors, hf_config_dict(spec))
    write_hf_checkpoint(tmp_path / "fp8", fp8, hf_config_dict(spec))
    a, b = _engine("Kimi-K2"), _engine("Kimi-K2")
    a.load_checkpoint(str(tmp_path / "bf16"))
    b.load_checkpoint(str(tmp_path / "fp8"))
    assert a.checker.checksum() == b.checker.checksum()


def test_mismatched_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    spec = tiny("Qwen3-4B")
    tensors = synthetic_hf_tensors(spec, SEED)
    tensors.pop("model.norm.weight")
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(5, 5, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.zeros(spec.vocab_size, spec.hidden_size, dtype=torch.bfloat16)
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)  # beyond num_layers: ignored (MTP)
    write_hf_checkpoint(tmp_path, tensors, hf_config_dict(spec))
    engine = _engine("Qwen3-4B")
    before = engine.checker.checksum()
    with pytest.raises(CheckpointError) as err:
        engine.load_checkpoint(str(tmp_path))
    msg = str(err.value)
    assert "1 unknown tensors: lm_head.weight" in msg  # tied model: no lm_head
    assert "1 missing tensors: model.norm.weight" in msg
    assert "1 mis-shaped tensors: model.layers.2.mlp.up_proj.weight [5, 5] (expected [128, 64])" in msg
    assert "layers.9" not in msg
    assert engine.checker.checksum() == before, "a refused checkpoint writes nothing"
    tensors.pop("lm_head.weight")
    tensors["model.norm.weight"] = torch.ones(spec.hidden_size, dtype=torch.bfloat16)
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(128, 64, dtype=torch.bfloat16)
    write_hf_checkpoint(tmp_path, tensors, hf_config_dict(spec))
    with HFCheckpoint(tmp_path) as ckpt:
        assert validate_checkpoint(spec, ckpt) == ["model.layers.9.mlp.up_proj.weight"]
