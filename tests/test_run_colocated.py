"""Contract: ``run --placement colocated`` works on CPU, trains with megatron-core when asked, and
picks its defaults by machine.

On CPU, colocated means trainer and engine ranks share the host's memory: p2p writes through shm
(as split does) and broadcast takes the colocated path (full tensors handed over in shared memory
through ``/update_weights_from_tensor``); the run says so. With ``--trainer megatron`` each step
is a megatron-core GRPO step on the engines' rollouts (toy reward of synthetic weights: the share
of even token ids), and the run reports loss, mean reward, grad norm and the train/rollout
logprob difference per step; every validation gate passes on every update.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.e2e_helpers import e2e_ckpt_fixture, run_in_process  # noqa: F401 -- the e2e_ckpt fixture
from weightsync.cli import build_parser
from weightsync.launch.config import env_settings


@pytest.mark.timeout(400)
def test_colocated_megatron_training_on_cpu(tmp_path: Path, e2e_ckpt: Path):
    run = run_in_process(["Qwen3-4B", "--placement", "colocated", "--mode", "both", "--trainer", "megatron",
                          "--num-rollout", "3", "--lr", "1e-3"], ckpt_dir=e2e_ckpt, log_dir=tmp_path)
    assert run.returncode == 0, run.describe()
    assert "placement colocated on CPU: trainer and engine ranks share this host's memory; p2p writes through shm" \
        in run.output, run.describe()
    assert "memory at set-up: engine parameters" in run.output
    assert "optimizer_state" in run.output
    meta, steps = run.meta, run.steps
    assert meta["gpu_placement"] == "colocated"
    assert meta["trainer"].startswith("megatron")
    assert [(s["mode"], s["path"]) for s in steps] == [("p2p", "p2p"), ("broadcast", "tensor")] * 2
    for s in steps:
        assert all(v in ("pass", "skipped") for v in s["validation"].values()), s["validation"]
        assert s["validation"]["update_checksums"] == "pass"
    trained = [s["train"] for s in steps[1:]]
    for t in trained:
        for k in ("loss", "mean_reward", "grad_norm", "logprob_diff"):
            assert math.isfinite(t[k]), t
    assert trained[0]["grad_norm"] > 0
    assert trained[-1]["mean_reward"] > trained[0]["mean_reward"], trained  # the toy reward is learnt
    assert "lp |d| t/r" in run.output  # the training table beside the update table


def _resolve(argv: list[str], gpus: int, monkeypatch: pytest.MonkeyPatch):
    from weightsync.cli import run as run_cli
    from weightsync.launch import resolve

    monkeypatch.setattr(resolve, "cuda_device_count", lambda: gpus)  # the machine the run is resolved on
    return run_cli.resolve(build_parser().parse_args(["run", *argv]), env_settings({}))


def test_defaults_by_machine(monkeypatch: pytest.MonkeyPatch):
    one_gpu = ["Qwen3-4B", "--device", "cuda", "--scale", "tiny", "--train", "tp=1,cp=1,world=1", "--rollout",
               "tp=1,engines=1"]
    cfg = _resolve(one_gpu, 1, monkeypatch)
    assert (cfg.placement, cfg.trainer) == ("colocated", "megatron")
    assert _resolve(one_gpu, 2, monkeypatch).placement == "split"
    with pytest.raises(ValueError, match=r"needs 2 GPUs .* --placement colocated shares the GPUs"):
        _resolve([*one_gpu, "--placement", "split"], 1, monkeypatch)
    cpu = _resolve(["Qwen3-4B"], 0, monkeypatch)
    assert (cpu.placement, cpu.trainer, cpu.device) == ("split", "synthetic", "cpu")


def test_pause_free_and_flip_reach_the_run(monkeypatch: pytest.MonkeyPatch):
    """``--pause-free`` / ``--flip`` land on the run's config (the session hands them to every trainer
    rank's UpdaterConfig); the defaults are pause-free where possible, flipped by swapping."""
    default = _resolve(["Qwen3-4B"], 0, monkeypatch)
    assert (default.pause_free, default.flip) == ("auto", "swap")
    cfg = _resolve(["Qwen3-4B", "--pause-free", "off", "--flip", "copy"], 0, monkeypatch)
    assert (cfg.pause_free, cfg.flip) == ("off", "copy")
    with pytest.raises(SystemExit):
        _resolve(["Qwen3-4B", "--flip", "move"], 0, monkeypatch)
