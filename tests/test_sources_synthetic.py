"""The SYNTHETIC trainer: a deterministic weight change that is a function of global coordinates.

Contracts:

* After k steps, the shards of every rank gathered into HF tensors equal
  ``full_tensors_at_step`` / ``reference_global_tensors`` (a reference copy updated whole) bit for
  bit, for dense, MoE and MLA models and configurations with DP, PP, TP and EP (so replicas and
  differently-sharded layouts make the same change).
* Every element of every parameter changes every step; padded vocab rows stay zero.
* The parameters are views of one flat buffer per dtype (``regions()``).
"""

from __future__ import annotations

import pytest
import torch

from weightsync.layout.box import full_box
from weightsync.layout.megatron import trainer_layout
from weightsync.models import get_model
from weightsync.models.checkpoint import hf_config_dict, synthetic_hf_tensors, write_hf_checkpoint
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import TrainParallel
from weightsync.sources.synthetic import (
    SyntheticTrainer,
    SyntheticUpdate,
    full_tensors_at_step,
    pseudo_gradient,
    reference_global_tensors,
)
from weightsync.sources.torch_dist import assemble_box, scatter_local, write_torch_dist

SEED = 1234


def _reader(hf):
    return lambda name, box: hf[name][tuple(slice(a, b) for a, b in box)]


def _trainers(spec, par, hf):
    out = []
    for rank in range(par.world_size):
        initial = {lt.name: assemble_box(lt, full_box(lt.shape), _reader(hf)) for lt in trainer_layout(spec, par, rank)}
        out.append(SyntheticTrainer(spec, par, rank, initial, update=SyntheticUpdate(seed=SEED)))
    return out


def _gather(trainers):
    """The HF tensors the ranks hold (unwritten elements would stay NaN and fail comparisons)."""
    table = global_tensors(trainers[0].spec)
    out: dict[str, torch.Tensor] = {}
    for t in trainers:
        for lt in t.layout:
            for p in lt.pieces:
                if p.global_name not in out:
                    shape = table[p.global_name].shape
                    out[p.global_name] = torch.full(shape, float("nan"), dtype=t.params[lt.name].dtype)
            scatter_local(lt, t.params[lt.name], out)
    return out


CASES = [
    pytest.param("Qwen3-4B", TrainParallel(world_size=8, tp=2, pp=2, cp=2), id="qwen3-tp2-pp2-dp2"),
    pytest.param("GLM-4.5-Air", TrainParallel(world_size=4, tp=2, ep=2, etp=1), id="glm45-tp2-ep2-dp2"),
    pytest.param("Kimi-K2", TrainParallel(world_size=8, tp=2, pp=2, ep=2, etp=2), id="kimi-tp2-pp2-ep2-etp2"),
    pytest.param("Kimi-K2", TrainParallel(world_size=4, tp=2, ep=2, mla_down_proj_replicated=True, etp=1),
                 id="kimi-tp2-ep2-dp2-mla-down-dup"),
    pytest.param("GLM-5", TrainParallel(world_size=2, tp=2, ep=2, mla_down_proj_replicated=True, etp=1),
                 id="glm5-tp2-ep2-mla-down-dup"),
]


@pytest.mark.parametrize(("model", "par"), CASES)
def test_shards_equal_reference_copy(model, par):
    spec = get_model(model, "tiny")
    hf = synthetic_hf_tensors(spec, seed=0)
    trainers = _trainers(spec, par, hf)
    for step in (1, 2, 3):
        for t in trainers:
            assert t.step() == {"step": step, "synthetic": True}
        gathered = _gather(trainers)
        want = full_tensors_at_step(hf, spec, step, SyntheticUpdate(seed=SEED))
        assert sorted(gathered) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(gathered[name], tensor), f"step {step}: {name} differs from the reference copy"


@pytest.mark.parametrize(("model", "par"), CASES[:2])
def test_every_element_changes_every_step(model, par):
    spec = get_model(model, "tiny")
    hf = synthetic_hf_tensors(spec, seed=0)
    trainer = _trainers(spec, par, hf)[1]
    for _ in range(4):
        before = {n: p.clone() for n, p in trainer.params.items()}
        trainer.step()
        for lt in trainer.layout:
            covered = torch.zeros(lt.shape, dtype=torch.bool)
            for p in lt.pieces:
                covered[tuple(slice(a, b) for a, b in p.local_box)] = True
            changed = before[lt.name] != trainer.params[lt.name]
            assert bool(changed[covered].all()), f"{lt.name}: some elements did not change"
            assert not trainer.params[lt.name][~covered].any(), f"{lt.name}: padding changed"


def test_params_live_in_flat_regions():
    spec = get_model("Qwen3-30B-A3B", "tiny")
    trainer = _trainers(spec, TrainParallel(world_size=2, tp=2, ep=2, etp=1), synthetic_hf_tensors(spec, 0))[0]
    regions = dict(trainer.regions())
    assert set(regions) == {"synthetic_params_bfloat16"}
    arena = regions["synthetic_params_bfloat16"]
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel() * arena.element_size()
    assert sum(p.numel() for p in trainer.params.values()) == arena.numel()
    assert all(lo <= p.data_ptr() < hi for p in trainer.params.values())


def test_reference_from_hf_dir_and_trainer_from_torch_dist(tmp_path):
    spec = get_model("GLM-4.5-Air", "tiny")
    hf = synthetic_hf_tensors(spec, seed=0)
    write_hf_checkpoint(tmp_path / "hf", hf, hf_config_dict(spec))
    par = TrainParallel(world_size=2, tp=2, ep=2, etp=1)
    write_torch_dist(tmp_path / "td", spec, par, _reader(hf))
    trainers = [SyntheticTrainer.from_torch_dist(tmp_path / "td", spec, par, r, seed=SEED) for r in range(2)]
    for t in trainers:
        t.step()
        t.step()
    read = reference_global_tensors(tmp_path / "hf", spec, step=2, seed=SEED)
    gathered = _gather(trainers)
    for name in gathered:
        assert torch.equal(gathered[name], read(name)), name


def test_mla_down_proj_replicated_from_torch_dist(tmp_path):
    """Duplicated MLA down projections: every TP rank holds (and changes) the whole tensor, and
    the shards still equal the reference copy."""
    spec = get_model("Kimi-K2", "tiny")
    hf = synthetic_hf_tensors(spec, seed=0)
    write_hf_checkpoint(tmp_path / "hf", hf, hf_config_dict(spec))
    par = TrainParallel(world_size=2, tp=2, ep=2, mla_down_proj_replicated=True, etp=1)
    write_torch_dist(tmp_path / "td", spec, par, _reader(hf))
    trainers = [SyntheticTrainer.from_torch_dist(tmp_path / "td", spec, par, r, seed=SEED) for r in range(2)]
    for t in trainers:
        t.step()
    name = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    assert torch.equal(trainers[0].params[name], trainers[1].params[name])
    read = reference_global_tensors(tmp_path / "hf", spec, step=1, seed=SEED)
    assert torch.equal(trainers[1].params[name], read("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"))
    gathered = _gather(trainers)
    for g in gathered:
        assert torch.equal(gathered[g], read(g)), g


def test_pseudo_gradient_is_a_function_of_global_coordinates():
    full = pseudo_gradient("w", (6, 10), ((0, 6), (0, 10)), step=3, seed=5)
    part = pseudo_gradient("w", (6, 10), ((2, 5), (4, 9)), step=3, seed=5)
    assert torch.equal(full[2:5, 4:9], part)
    assert full.min() >= -1
    assert full.max() < 1
    assert not torch.equal(full, pseudo_gradient("w", (6, 10), ((0, 6), (0, 10)), step=4, seed=5))
    assert not torch.equal(full, pseudo_gradient("v", (6, 10), ((0, 6), (0, 10)), step=3, seed=5))
