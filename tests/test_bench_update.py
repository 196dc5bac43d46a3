"""The transfer benchmark (``weightsync bench``): data, checks, placement, and one CPU run.

Contracts:

* the benchmark's global values are a function of (seed, tensor, element) only: any box equals
  the same box cut out of the whole tensor, on every process;
* the check is bit-exact and complete: a poisoned parameter, one changed element, or a padding
  row that a stray write touched is reported by name;
* a CPU run (tiny Qwen3, trainer TP 2 -> engine TP 2, both modes) exits 0 with both modes
  verified bit for bit, p2p moves exactly each engine rank's shard while broadcast moves the whole
  model to every rank, and the run imports none of megatron, mooncake, fastapi, pydantic, httpx,
  uvicorn, xxhash (the GPU machines lack some of them);
* the command line surface is pinned.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from weightsync.cli import bench as bench_cli
from weightsync.launch.bench import config as bench
from weightsync.launch.bench.data import GlobalData, compare, expected_store, fill_params, poison
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.inputs import build_inputs
from weightsync.plan.p2p import plan_p2p
from weightsync.sync.params import ParamStore

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = ("megatron", "mooncake", "fastapi", "pydantic", "httpx", "uvicorn", "xxhash")


def _slices(box):
    return tuple(slice(a, b) for a, b in box)


@pytest.fixture(scope="module")
def tiny():
    spec = get_model("Qwen3-4B", "tiny")
    inputs = build_inputs(
        spec,
        TrainParallel(world_size=2, tp=2),
        RolloutParallel(tp=2),
        trainer_layout=trainer_layout,
        engine_layout=engine_layout,
    )
    return spec, inputs, GlobalData(inputs.globals, seed=5, device=torch.device("cpu"))


@pytest.mark.parametrize(
    "box", [((0, 300), (0, 64)), ((17, 160), (8, 40)), ((299, 300), (63, 64))], ids=["whole", "inner", "corner"]
)
def test_box_is_a_slice_of_the_whole_tensor(tiny, box):
    _, inputs, data = tiny
    name = "model.embed_tokens.weight"
    whole = data.box(name, ((0, 300), (0, 64)))
    assert whole.shape == inputs.globals[name].shape
    assert torch.equal(data.box(name, box), whole[_slices(box)])


def test_values_depend_on_seed_tensor_and_row_only(tiny):
    _, inputs, data = tiny
    again = GlobalData(inputs.globals, seed=5, device=torch.device("cpu"))
    other = GlobalData(inputs.globals, seed=6, device=torch.device("cpu"))
    box = ((0, 64), (0, 64))
    name = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(data.box(name, box), again.box(name, box))
    assert not torch.equal(data.box(name, box), other.box(name, box))
    rows = data.box(name, box)
    assert len({tuple(r.tolist()) for r in rows}) == rows.shape[0]  # every row its own stretch
    assert not torch.equal(rows, data.box("model.layers.1.self_attn.o_proj.weight", box))


def _replay_plan(spec, inputs, data):
    """Engine stores filled by replaying the p2p plan in one process from filled trainer shards."""
    trainers = []
    for layout in inputs.source_layouts:
        store = ParamStore(list(layout), torch.device("cpu"))
        fill_params(data, list(layout), dict(store.items()))
        trainers.append(store)
    engines = [ParamStore(list(inputs.dest_layout(d)), torch.device("cpu")) for d in range(inputs.num_dest)]
    for e in engines:
        poison(e)
    for op in plan_p2p(inputs).ops:
        assert op.transform is None
        src = trainers[op.src_rank][op.src_param][_slices(op.src_box)]
        dst = engines[op.dst_rank][op.dst_param][_slices(op.dst_box)]
        dst.copy_(src.reshape(dst.shape))
    return engines


def test_plan_replay_matches_expected_and_check_catches_damage(tiny):
    spec, inputs, data = tiny
    engines = _replay_plan(spec, inputs, data)
    expected = [expected_store(data, e, spec) for e in engines]
    assert [compare(e, x) for e, x in zip(engines, expected, strict=True)] == [[], []]
    e0, x0 = engines[0], expected[0]
    e0["model.norm.weight"][3] += 1  # one element
    poison_name = "model.layers.1.mlp.down_proj.weight"
    for p in next(t for t in e0.layout if t.name == poison_name).pieces:  # a whole tensor never written
        e0[poison_name][_slices(p.local_box)].fill_(float("nan"))
    assert compare(e0, x0) == ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"]
    e1 = engines[1]
    e1["model.embed_tokens.weight"][-1, 0] = 1.0  # a padding row: belongs to no global tensor
    assert compare(e1, expected[1]) == ["model.embed_tokens.weight"]


def test_poison_leaves_padding_and_covers_every_piece(tiny):
    _, inputs, _ = tiny
    store = ParamStore(list(inputs.dest_layout(1)), torch.device("cpu"))
    poison(store)
    emb = store["model.embed_tokens.weight"]
    assert torch.isnan(emb[:140]).all()  # rank 1 holds 140 real rows of 160 ...
    assert (emb[140:] == 0).all()  # ... and 20 padding rows
    assert all(torch.isnan(t).all() for n, t in store.items() if n != "model.embed_tokens.weight")


@pytest.mark.parametrize(
    ("num_train", "num_rollout", "placement", "gpus", "expect"),
    [
        (1, 1, "split", 2, ((0,), (1,))),
        (2, 2, "split", 4, ((0, 1), (2, 3))),
        (2, 2, "colocated", 2, ((0, 1), (0, 1))),
        (1, 1, "colocated", 1, ((0,), (0,))),
        (2, 2, "split", 2, "needs 4 GPUs"),
        (2, 1, "colocated", 1, "needs 2 GPUs"),
    ],
    ids=["1+1-split", "2+2-split", "2+2-colocated", "1+1-one-gpu", "too-few-split", "too-few-colocated"],
)
def test_gpu_placement(num_train, num_rollout, placement, gpus, expect):
    if isinstance(expect, str):
        with pytest.raises(ValueError, match=expect):
            bench.gpu_placement(num_train, num_rollout, placement, gpus)
    else:
        assert bench.gpu_placement(num_train, num_rollout, placement, gpus) == expect


def test_broadcast_skipped_when_a_group_shares_a_gpu():
    assert bench.broadcast_skip_reason("cuda", (0,), (1,), [0]) is None
    assert bench.broadcast_skip_reason("cpu", (0,), (0,), [0]) is None
    assert "own GPU" in bench.broadcast_skip_reason("cuda", (0, 1), (0, 1), [0])


def test_cli_surface():
    """The options of ``weightsync bench`` (extend deliberately; the GPU command line uses them)."""
    p = argparse.ArgumentParser(add_help=False)
    bench_cli.add_arguments(p)
    opts = sorted(o for a in p._actions for o in a.option_strings if o.startswith("--"))
    assert opts == [
        "--bucket-gb",
        "--device",
        "--mode",
        "--out",
        "--placement",
        "--repeats",
        "--rollout",
        "--scale",
        "--seed",
        "--threads",
        "--timeout",
        "--train",
        "--transport",
    ]


BLOCKER = textwrap.dedent(f"""
    import importlib.abc, sys
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {FORBIDDEN!r}:
                raise ImportError("weightsync bench must not import " + name)
            return None
    sys.meta_path.insert(0, _Block())
""")


@pytest.mark.timeout(240)
def test_cpu_run_tiny_both_modes(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)  # applies to the spawned ranks too
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync.cli",
            "bench",
            "Qwen3-4B",
            "--scale",
            "tiny",
            "--train",
            "tp=2,cp=1,world=2",
            "--rollout",
            "tp=2,engines=1",
            "--device",
            "cpu",
            "--mode",
            "both",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=230,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    s = json.loads(out.read_text())
    assert s["verified"]
    assert s["p2p"]["check"]["ok"]
    assert s["broadcast"]["check"]["ok"]
    assert s["p2p"]["check"]["params_checked"] > 0
    # p2p moves no redundant bytes; broadcast sends every rank the whole model.
    assert s["p2p"]["bytes_per_receiver"] == s["p2p"]["shard_bytes"]
    full = sum(g.nbytes for g in global_tensors(get_model("Qwen3-4B", "tiny")).values())
    assert set(s["broadcast"]["bytes_per_receiver"].values()) == {full}
    assert s["memcpy"]["bytes"] == s["p2p"]["bytes_total"]
    assert s["ratio_wire_to_memcpy"] > 0
    assert s["speedup_p2p_vs_broadcast"] > 0
    # what a pause-free update stops the engines for: a flip of a whole shard, by swap and by copy
    assert s["engine_idle"]["bytes_per_rank"] > 0
    assert 0 <= s["engine_idle"]["swap_s"] < s["engine_idle"]["copy_s"]
    assert "engines idle per pause-free update" in proc.stdout
    assert "p2p update" in proc.stdout
    assert "broadcast update" in proc.stdout
    assert "BENCH_JSON" not in proc.stdout, "with --out the record goes to the file only"
    assert f"results: {out}" in proc.stdout


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({}, {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x400000"}),
        (
            {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
            {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.cpu.x86_non_temporal_threshold=0x400000"},
        ),
        ({"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x100000"}, {}),
    ],
    ids=["unset", "other-tunable-kept", "caller-choice-kept"],
)
def test_host_copy_env(env, expect):
    from weightsync.launch.bench.launcher import host_copy_env

    assert host_copy_env(env) == expect


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_cuda_run_tiny(tmp_path):
    """The CUDA path end to end: GPU0 -> GPU1 with both modes when two GPUs are visible, else
    p2p between two processes on one GPU (NCCL cannot broadcast within one GPU)."""
    two = torch.cuda.device_count() >= 2
    extra = ["--mode", "both"] if two else ["--mode", "p2p", "--placement", "colocated"]
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync.cli",
            "bench",
            "Qwen3-4B",
            "--scale",
            "tiny",
            "--train",
            "tp=1,cp=1,world=1",
            "--rollout",
            "tp=1,engines=1",
            "--device",
            "cuda",
            "--repeats",
            "1",
            "--timeout",
            "200",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=290,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    s = json.loads(out.read_text())
    assert s["verified"]
    assert s["p2p"]["bytes_per_receiver"] == s["p2p"]["shard_bytes"]
    assert s["transport"] == "cuda_ipc"
