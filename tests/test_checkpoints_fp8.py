"""Contract: the engine serves a checkpoint of an fp8 profile (Kimi-K2) whatever its format, and
never re-quantizes fp8 weights.

sglang serves a block-fp8 checkpoint in the checkpoint's ``quantization_config.weight_block_size``
(``layers/quantization/fp8.py``: ``Fp8Config.from_config``) and refuses shards that cut a block
(``Fp8LinearMethod.create_weights`` / ``Fp8MoEMethod.create_weights``: "... is not divisible by
weight quantization block").

* A bf16 checkpoint without any ``weight_scale_inv`` is quantized on load into the profile's blocks:
  the engine holds exactly what it holds after loading the same weights with their scales.
* A block-fp8 checkpoint in other blocks than the profile's ([16, 16] for the tiny profile's
  [8, 8]; Kimi-K2's real one: [128, 128] for [64, 64]) is served in its own blocks where no shard
  cuts them: the engine's fp8 bytes and scales are the checkpoint's. Where a shard cuts them (tp 4:
  a q_b_proj shard of 24 rows, an expert FFN shard of 8), it is re-blocked into the profile's blocks,
  which tile them: the fp8 bytes stay, each scale is copied to its sub-blocks. Either way every
  weight dequantizes to the checkpoint's values bit for bit (RMS change 0).
* Blocks the profile's cannot tile ([12, 12]) are refused in one line before any rank starts, at
  the first projection they cut (an attention one included); an engine never loads such a
  checkpoint by re-quantizing it.
* An fp8 weight without its scale, or a checkpoint declaring no block size, is refused naming it.
* The trainer's reader dequantizes with the checkpoint's block size, not the profile's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weightsync.engine.engine import Engine
from weightsync.engine.loader import load_checkpoint
from weightsync.engine.tp import EngineGroups
from weightsync.layout.box import Box, box_shape
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.checkpoint import HFCheckpoint, hf_config_dict, synthetic_hf_tensors, write_hf_checkpoint
from weightsync.models.checkpoint_check import CheckpointError
from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import ModelSpec
from weightsync.quant.fp8 import dequantize_block_fp8, quantize_block_fp8
from weightsync.sources.hf_source import global_reader
from weightsync.sync.params import ParamStore

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


def _fp8(tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> tuple[dict[str, torch.Tensor],
                                                                         dict[str, torch.Tensor]]:
    """The checkpoint's weights in block fp8 of ``block`` (with scales), and their dequantized values."""
    fp8, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if name + "_scale_inv" in tensors:
            q, scale = quantize_block_fp8(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_block_fp8(q, scale, block, dtype=torch.float32)
        else:
            fp8[name] = dequantized[name] = t
    return fp8, dequantized


def _served(path: Path, **sizes: int):
    from weightsync.engine.bootstrap import check_config
    from weightsync.engine.config import ServeConfig

    return check_config(ServeConfig(model="Kimi-K2", scale="tiny", checkpoint=str(path), **sizes))


def _dequantized_pieces(store: ParamStore, spec: ModelSpec) -> dict[str, list[tuple[torch.Tensor, Box]]]:
    """Every fp8 weight's local values dequantized with the engine's own scales, cut by its pieces:
    global name -> [(values, global box)]."""
    out: dict[str, list[tuple[torch.Tensor, Box]]] = {}
    assert spec.fp8_block is not None
    for t in store.layout:
        if t.dtype != "float8_e4m3fn":
            continue
        q, scale = store[t.name], store[t.name + "_scale_inv"]
        full = (torch.stack([dequantize_block_fp8(q[j], scale[j], spec.fp8_block, torch.float32)
                             for j in range(q.shape[0])]) if q.dim() == 3
                else dequantize_block_fp8(q, scale, spec.fp8_block, torch.float32))
        for p in t.pieces:
            region = full[tuple(slice(a, b) for a, b in p.local_box)]
            out.setdefault(p.global_name, []).append((region.reshape(box_shape(p.global_box)), p.global_box))
    return out


@pytest.mark.parametrize(("tp", "ep", "served"), [
    pytest.param(1, 1, (16, 16), id="tp1-own-blocks"),
    pytest.param(2, 2, (16, 16), id="tp2-ep2-own-blocks"),
    pytest.param(4, 1, (8, 8), id="tp4-reblocked"),
])
def test_fp8_checkpoint_is_served_bit_identical(tensors: dict[str, torch.Tensor], tmp_path: Path, tp: int, ep: int,
                                                served: tuple[int, int], caplog: pytest.LogCaptureFixture):
    fp8, dequantized = _fp8(tensors, (16, 16))
    path = _write(tmp_path / "fp8", fp8, (16, 16))
    with caplog.at_level("WARNING", logger="weightsync.layout.sglang_fp8"):
        spec, par = _served(path, tp=tp, ep=ep)
    assert spec.fp8_block == served
    assert any("lossless" in r.getMessage() for r in caplog.records) == (served != (16, 16))
    seen: dict[str, int] = {}
    for rank in range(tp):
        store = ParamStore(engine_layout(spec, par, rank), device=torch.device("cpu"))
        load_checkpoint(store, spec, str(path))
        for name, regions in _dequantized_pieces(store, spec).items():
            for values, box in regions:
                want = dequantized[name][tuple(slice(a, b) for a, b in box)]
                assert torch.equal(values, want), f"rank {rank} {name}{box}: the served weight is not the checkpoint's"
                seen[name] = seen.get(name, 0) + values.numel()
        if served == (16, 16):  # its own blocks: the very bytes and scales of the checkpoint
            for t in store.layout:
                for p in t.pieces:
                    got = store[t.name][tuple(slice(a, b) for a, b in p.local_box)].reshape(box_shape(p.global_box))
                    want = fp8[p.global_name][tuple(slice(a, b) for a, b in p.global_box)]
                    if got.dtype == torch.float8_e4m3fn:
                        got, want = got.view(torch.uint8), want.view(torch.uint8)
                    assert torch.equal(got.float(), want.float()), (rank, t.name)
        store.close()
    quantized = [n for n in dequantized if n + "_scale_inv" in fp8]
    assert sorted(seen) == sorted(quantized)  # every fp8 weight was checked, and wholly (per replica)
    assert all(seen[n] % dequantized[n].numel() == 0 for n in quantized)


def test_trainer_reader_dequantizes_in_the_checkpoint_blocks(tensors: dict[str, torch.Tensor], tmp_path: Path):
    fp8, dequantized = _fp8(tensors, (16, 16))
    with HFCheckpoint(_write(tmp_path / "fp8", fp8, (16, 16))) as ckpt:
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        shape = ckpt.meta(name)[0]
        got = global_reader(ckpt, SPEC)(name, tuple((0, d) for d in shape))
    assert torch.equal(got.float(), dequantized[name].to(got.dtype).float())


def test_fp8_blocks_the_profile_cannot_tile_are_refused(tensors: dict[str, torch.Tensor], tmp_path: Path):
    fp8, _ = _fp8(tensors, (12, 12))
    path = _write(tmp_path / "fp8", fp8, (12, 12))
    with pytest.raises(ValueError, match=r"cannot be re-blocked losslessly into \[8, 8\]") as err:
        _served(path, tp=2)
    assert "\n" not in str(err.value)
    # an engine of the profile's blocks does not load it by re-quantizing
    store = ParamStore(engine_layout(SPEC, RolloutParallel(), 0), device=torch.device("cpu"))
    with pytest.raises(CheckpointError, match="re-quantize"):
        load_checkpoint(store, SPEC, str(path))


def test_attention_block_cut_is_refused_in_one_line_before_any_rank_starts(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]):
    """At tp 2 the attention projections' shards (kv_b_proj: 64 rows, o_proj: 32 columns) cut [12, 12]
    blocks (the expert FFN shards of 24 and the replicated dense MLP do not): ``weightsync serve``
    exits 2 with one line naming the tensor, before it starts any rank."""
    from weightsync.cli import build_parser
    from weightsync.cli.serve import main

    spec = SPEC.replace(moe_intermediate_size=48, fp8_block=(12, 12))
    fp8, _ = _fp8(synthetic_hf_tensors(spec, seed=1), (12, 12))
    path = write_hf_checkpoint(tmp_path / "ckpt", fp8, hf_config_dict(spec))
    args = build_parser().parse_args(["serve", "Kimi-K2", "--scale", "tiny", "--tp", "2", "--moe-dense-tp-size", "1",
                                      "--checkpoint", str(path), "--port", "9"])
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "fp8 block (12, 12) is cut by model.layers.0.self_attn." in err


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
