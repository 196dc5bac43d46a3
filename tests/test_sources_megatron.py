"""The megatron-core adapter against live megatron-core 0.16.1 (CPU, gloo, 2 spawned ranks).

Contracts, for every family (Qwen3, Qwen3-MoE, GLM-4.5, and the MLA models Kimi-K2,
GLM-4.7-Flash, GLM-5) at TP 2 (EP 2 for MoE), sequence parallel on:

* ``build_gpt_model`` builds a ``GPTModel`` whose parameter names (and router ``expert_bias``
  buffers), order, shapes, dtypes and ``tensor_model_parallel`` / ``partition_dim`` attributes are
  exactly the trainer layout's (``check_against_layout`` raises otherwise);
* megatron-core's own ``sharded_state_dict()`` of that model has exactly the ShardedTensor keys,
  global shapes, offsets and local shapes, and the ShardedObject keys, that
  ``weightsync.sources.dist_layout`` predicts -- the format weightsync writes;
* megatron-core's own loader (``dist_checkpointing.load``) reads the torch_dist checkpoint
  weightsync wrote from one process at another parallel configuration (a single rank), and the
  parameters it loads equal weightsync's reader's bit for bit.

MLA builds on CPU thanks to ``megatron_compat`` (see weightsync.sources.megatron_model). The
forward/training checks are in ``scripts/gpu_trainer_check.py`` (run on CPU below, on GPUs by
the lead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import warnings

import pytest

pytest.importorskip("megatron.core")

MODELS = ["Qwen3-4B", "Qwen3-30B-A3B", "GLM-4.5-Air", "Kimi-K2", "GLM-4.7-Flash", "GLM-5"]
WORLD = 2


def _par(spec):
    from weightsync.models.parallel import TrainParallel

    return TrainParallel(world_size=WORLD, tp=2, ep=2 if spec.is_moe else 1, etp=1)


def _sharded_records(model):
    """(ShardedTensor records, ShardedObject unique keys) of megatron-core's sharded_state_dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from weightsync.sources.megatron_model import megatron_compat

    tensors, objects = set(), set()

    def walk(d):
        for v in d.values():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, ShardedTensorFactory):
                built = v.build()
                for s in built if isinstance(built, list) else [built]:
                    tensors.add((s.key, tuple(s.global_shape), tuple(s.global_offset), tuple(s.local_shape)))
            elif isinstance(v, ShardedTensor):
                tensors.add((v.key, tuple(v.global_shape), tuple(v.global_offset), tuple(v.local_shape)))
            elif isinstance(v, ShardedObject):
                objects.add(v.unique_key)

    with megatron_compat():
        walk(model.sharded_state_dict())
    return tensors, objects


def _check_model(name, rank, ckpt_root):
    import torch

    from weightsync.models import get_model
    from weightsync.sources.dist_layout import dist_chunks, extra_state_objects
    from weightsync.sources.megatron_load import load_with_megatron
    from weightsync.sources.megatron_model import build_gpt_model, check_against_layout, model_tensors
    from weightsync.sources.torch_dist import read_rank_tensors

    spec = get_model(name, "tiny")
    par = _par(spec)
    model = build_gpt_model(spec, par, rank)
    layout = check_against_layout(model, spec, par, rank)
    live_tensors, live_objects = _sharded_records(model)
    ours = {(c.key, c.global_shape, c.global_offset, c.chunk_shape[len(c.global_shape) - len(c.local_box):])
            for c in dist_chunks(spec, par, rank)}
    our_objects = {o.unique_key for o in extra_state_objects(spec, par, rank)}
    problems = []
    if live_tensors != ours:
        problems.append(f"sharded tensors: megatron-only {sorted(live_tensors - ours)[:3]}, "
                        f"weightsync-only {sorted(ours - live_tensors)[:3]}")
    if live_objects != our_objects:
        problems.append(f"sharded objects differ: {sorted(live_objects ^ our_objects)[:3]}")
    ckpt = os.path.join(ckpt_root, name)
    load_with_megatron(model, ckpt)
    mine = read_rank_tensors(ckpt, spec, par, rank)
    live = model_tensors(model)
    differ = [n for n in mine if not torch.equal(mine[n], live[n].data)]
    if differ:
        problems.append(f"megatron's loader and weightsync's reader differ on {differ[:5]}")
    return {"params": len(layout), "problems": problems}


def _worker(rank, port, ckpt_root, out_dir):
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from weightsync.models import get_model
    from weightsync.sources.megatron_model import destroy_parallel_state, init_parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {}
    for name in MODELS:
        init_parallel_state(_par(get_model(name, "tiny")))
        try:
            results[name] = _check_model(name, rank, ckpt_root)
        except Exception:  # recorded per model; the test reports every failure
            results[name] = {"problems": [traceback.format_exc(limit=8)]}
        finally:
            destroy_parallel_state()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_live_models_match_layout_and_checkpoint_format(tmp_path, free_port):
    import torch.multiprocessing as mp

    from weightsync.models import get_model
    from weightsync.models.checkpoint import synthetic_hf_tensors
    from weightsync.models.parallel import TrainParallel
    from weightsync.sources.torch_dist import write_torch_dist

    for name in MODELS:  # written at a single rank: the live models read it resharded
        spec = get_model(name, "tiny")
        hf = synthetic_hf_tensors(spec, seed=0)
        write_torch_dist(tmp_path / name, spec, TrainParallel(world_size=1),
                         lambda n, box, hf=hf: hf[n][tuple(slice(a, b) for a, b in box)])
    out = tmp_path / "results"
    out.mkdir()
    mp.spawn(_worker, args=(free_port, str(tmp_path), str(out)), nprocs=WORLD)
    failures = []
    for rank in range(WORLD):
        results = json.loads((out / f"rank{rank}.json").read_text())
        assert sorted(results) == sorted(MODELS)
        failures += [f"rank {rank} {name}: {p}" for name, r in results.items() for p in r["problems"]]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_trainer_check_script_passes_on_cpu(repo_root, tmp_path):
    """scripts/gpu_trainer_check.py on 2 CPU processes: logits parity with the engine and the
    reference forward (every family), loss going down and TP replicas in step (Qwen3, Qwen3-MoE),
    MLA layouts. The same script runs on 2 GPUs with --device cuda."""
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "gpu_trainer_check.py"), "--device", "cpu", "--quick",
         "--all-families", "--steps", "3", "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(out)],
        capture_output=True, text=True, timeout=850, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.is_file(), proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    failed = [c for c in summary["checks"] if not c.get("passed")]
    assert not failed, json.dumps(failed, indent=1)[-4000:]
    kinds = {(c["check"], c["model"]) for c in summary["checks"]}
    assert {("logits", m) for m in MODELS} <= kinds
    assert {("train", "Qwen3-4B"), ("train", "Qwen3-30B-A3B")} <= kinds
    assert proc.returncode == 0


def test_duplicated_mla_down_projections_are_refused_not_mismatched():
    """The local spec builds MLA down projections TP-split: a model with them duplicated (the TE
    spec) is refused with the reason, before any parallel state is needed."""
    import dataclasses

    from weightsync.models import get_model
    from weightsync.sources.megatron_model import build_gpt_model

    spec = get_model("Kimi-K2", "tiny")
    par = dataclasses.replace(_par(spec), mla_down_proj_replicated=True)
    with pytest.raises(ValueError, match=r"mla_down_proj_replicated.*local spec"):
        build_gpt_model(spec, par, 0)
