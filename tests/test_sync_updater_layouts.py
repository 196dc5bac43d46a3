"""Contract: a trainer updates an engine in whatever layout the engine serves, learnt from what the
engine publishes, not from the trainer's own idea of the model.

* fp8 blocks: an engine serving a [16, 16] block-fp8 checkpoint (the tiny equivalent of Kimi-K2's
  [128, 128] one) is updated by a trainer whose model says the profile's [8, 8]: the trainer
  quantizes into [16, 16] (the engine's scale sizes tell), and every engine parameter's checksum
  equals the trainer's weights quantized into those blocks (``stats.verified``), in both modes.
* layout options: an engine started with options other than sglang 0.5.23's defaults (a GLM-4.5-Air
  router in the model dtype and its shared expert apart at ep 1) is updated with the plan of those
  options, verified.

One trainer rank (a gloo group of one, in this process) and one ``weightsync serve`` engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import test_sync_updater_engine as base
from tests.e2e_helpers import serve_engine
from weightsync import UpdaterConfig, WeightUpdater
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang_options import layout_options
from weightsync.models import get_model
from weightsync.models.checkpoint import hf_config_dict, synthetic_hf_tensors, write_hf_checkpoint
from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec
from weightsync.quant.fp8 import quantize_block_fp8

group = base.group  # the fixture: a gloo group of this one trainer rank

TRAIN = TrainParallel(world_size=1)


def _params(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {t.name: (torch.randn(t.shape, generator=gen) * 0.05).to(getattr(torch, t.dtype))
            for t in trainer_layout(spec, TRAIN, 0)}


def _update_twice(spec: ModelSpec, url: str, group: object) -> WeightUpdater:
    params = _params(spec, 0)
    updater = WeightUpdater(params, spec=spec, train=TRAIN, engine_urls=[url], group=group,
                            config=UpdaterConfig(mode="both", verify_every=1, bucket_bytes=1 << 18))
    try:
        for version in (1, 2):  # p2p, then broadcast
            for t in params.values():
                t.add_(torch.randn(t.shape).to(t.dtype), alpha=1e-2)
            stats = updater.update(version)
            assert stats.verified, stats
    except BaseException:
        updater.close()
        raise
    return updater


@pytest.mark.timeout(300)
def test_trainer_quantizes_into_the_engines_fp8_blocks(group: object, tmp_path: Path):
    spec = get_model("Kimi-K2", "tiny")  # the profile's blocks: [8, 8]
    tensors = synthetic_hf_tensors(spec, seed=2)
    stored = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if name + "_scale_inv" in tensors:
            stored[name], stored[name + "_scale_inv"] = quantize_block_fp8(t, (16, 16))
        else:
            stored[name] = t
    cfg = hf_config_dict(spec)
    cfg["quantization_config"]["weight_block_size"] = [16, 16]
    ckpt = write_hf_checkpoint(tmp_path / "ckpt16", stored, cfg)
    argv = ["Kimi-K2", "--scale", "tiny", "--tp", "2", "--transport", "shm", "--checkpoint", str(ckpt)]
    with serve_engine(argv, tmp_path / "engine.log") as url:
        updater = _update_twice(spec, url, group)
        try:
            assert updater.spec.fp8_block == (16, 16)
            assert updater.inputs.globals["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"].shape == (4, 2)
        finally:
            updater.close()


@pytest.mark.timeout(300)
def test_trainer_follows_the_engines_layout_options(group: object, tmp_path: Path):
    spec = get_model("GLM-4.5-Air", "tiny")
    argv = ["GLM-4.5-Air", "--scale", "tiny", "--tp", "2", "--transport", "shm", "--load-format", "dummy",
            "--router-dtype", "model", "--disable-shared-experts-fusion"]
    with serve_engine(argv, tmp_path / "engine.log") as url:
        updater = _update_twice(spec, url, group)
        try:
            rollout = updater.inputs.rollout
            opts = layout_options(spec, rollout)
            assert (opts.router_fp32, opts.shared_experts_fusion) == (False, False)
            names = {t.name: t.dtype for t in updater.inputs.dest_layout(0)}
            assert names["model.layers.1.mlp.gate.weight"] == "bfloat16"
            assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in names
        finally:
            updater.close()
