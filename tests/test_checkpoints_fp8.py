"""Contract: the engine loads a checkpoint into an fp8-serving profile (Kimi-K2) whatever its format.

* A bf16 checkpoint without any ``weight_scale_inv`` is quantized on load into the profile's blocks:
  the engine holds exactly what it holds after loading the same weights with their scales.
* A block-fp8 checkpoint in other blocks than the profile's ([16, 16] for the tiny profile's
  [8, 8]) is dequantized with its own scales and re-quantized: the engine holds exactly what it
  holds after loading those dequantized weights as bf16.
* An fp8 weight without its scale, or a checkpoint declaring no block size, is refused naming it.
* The trainer's reader dequantizes with the checkpoint's block size, not the profile's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weightsync.engine.engine import Engine
from weightsync.engine.tp import EngineGroups
from weightsync.models import get_model
from weightsync.models.checkpoint import HFCheckpoint, hf_config_dict, synthetic_hf_tensors, write_hf_checkpoint
from weightsync.models.checkpoint_check import CheckpointError
from weightsync.quant.fp8 import dequantize_block_fp8, quantize_block_fp8
from weightsync.sources.hf_source import global_reader

SPEC = get_model("Kimi-K2", "tiny")


def _engine_state(path: Path) -> dict[str, torch.Tensor]:
    engine = Engine.build(SPEC, EngineGroups.single(), device=torch.device("cpu"))
    engine.load_checkpoint(str(path))
    return {n: t.clone() for n, t in engine.store.items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [n for n in a if not torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))]
    assert not bad, bad[:5]


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return synthetic_hf_tensors(SPEC, seed=3)


def _write(path: Path, tensors: dict[str, torch.Tensor], block: tuple[int, int] | None) -> Path:
    cfg = hf_config_dict(SPEC)
    cfg.pop("quantization_config")
    if block is not None:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}
    return write_hf_checkpoint(path, tensors, cfg)


def test_bf16_checkpoint_is_quantized_on_load(tensors: dict[str, torch.Tensor], tmp_path: Path):
    with_scales = _write(tmp_path / "scaled", tensors, None)
    plain = _write(tmp_path / "plain", {n: t for n, t in tensors.items() if not n.endswith("_scale_inv")}, None)
    _equal(_engine_state(plain), _engine_state(with_scales))


def test_fp8_checkpoint_in_other_blocks_is_requantized(tensors: dict[str, torch.Tensor], tmp_path: Path):
    fp8, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if name + "_scale_inv" in tensors:
            q, scale = quantize_block_fp8(t, (16, 16))
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_block_fp8(q, scale, (16, 16), dtype=torch.bfloat16)
        else:
            fp8[name] = dequantized[name] = t
    _equal(_engine_state(_write(tmp_path / "fp8", fp8, (16, 16))),
           _engine_state(_write(tmp_path / "bf16", dequantized, None)))
    with HFCheckpoint(tmp_path / "fp8") as ckpt:
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        shape = ckpt.meta(name)[0]
        got = global_reader(ckpt, SPEC)(name, tuple((0, d) for d in shape))
    assert torch.equal(got, dequantized[name])


def test_fp8_weight_without_its_scale_is_refused(tensors: dict[str, torch.Tensor], tmp_path: Path):
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    q, _ = quantize_block_fp8(tensors[name], (8, 8))
    broken = {n: t for n, t in tensors.items() if n != name + "_scale_inv"}
    broken[name] = q
    path = _write(tmp_path / "noscale", broken, (8, 8))
    with pytest.raises(CheckpointError, match=rf"{name}_scale_inv missing \(expected \[8, 4\] for blocks \[8, 8\]\)"):
        _engine_state(path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"{name} \(config.json has no quantization_config.weight_block_size"):
        _engine_state(path)
