"""Shared pieces of the rollout engine tests: the models, prompts, tolerances and checkpoints.

Tolerances: the engine computes in float32 on CPU over the same bf16 (or fp8-exact) weights as
the float32 reference, so the only differences are summation order (TP all-reduces, fused vs
unfused projections, absorbed vs plain MLA). Observed differences are ~1e-5 on logits of
magnitude ~5-40; the bounds below leave a margin of about 10x.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.engine.control import Op
from weightsync.engine.scheduler import Scheduler
from weightsync.engine.session import UpdateSessions
from weightsync.models import get_model
from weightsync.models.checkpoint import hf_config_dict, synthetic_hf_tensors, write_hf_checkpoint
from weightsync.models.spec import ModelSpec

FAMILY_MODELS = ("Qwen3-4B", "Qwen3-30B-A3B", "GLM-4.5-Air", "Kimi-K2", "GLM-4.7-Flash", "GLM-5")
"""One registry model per family and variant: Qwen3 dense, Qwen3-MoE, GLM-4.5 MoE, and the three
DeepSeek-V3-architecture models (fp8 Kimi-K2, GLM-4.7-Flash, GLM-5 with the DSA indexer)."""
MOE_MODELS = tuple(m for m in FAMILY_MODELS if get_model(m, "tiny").is_moe)

PROMPTS = ([5, 17, 250, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [299, 0, 42])
"""Fixed prompts: lengths differ (padding), one is longer than GLM-5 tiny's index_topk (8)."""

LOGIT_ATOL = 2e-4
LOGIT_RTOL = 1e-4
LOGPROB_ATOL = 2e-4
SEED = 1


def tiny(name: str) -> ModelSpec:
    return get_model(name, "tiny")


def write_tiny_checkpoint(name: str, path: Path, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Write the synthetic HF checkpoint of ``name`` at tiny scale; returns its tensors."""
    spec = tiny(name)
    tensors = synthetic_hf_tensors(spec, seed)
    write_hf_checkpoint(path, tensors, hf_config_dict(spec))
    return tensors


def two_tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[str, str]:
    """Two checkpoints of ``name`` at tiny scale with different weights (seeds 1 and 2): the
    version an engine serves and the one an update brings."""
    a, b = tmp_path_factory.mktemp("w1"), tmp_path_factory.mktemp("w2")
    write_tiny_checkpoint(name, a, seed=1)
    write_tiny_checkpoint(name, b, seed=2)
    return str(a), str(b)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; on a loaded 2-core machine two threads are ~20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def start_sessions(driver: Any, **kwargs: Any) -> UpdateSessions:
    """Rank 0's control of an in-process engine, as ``weightsync serve`` builds it: a
    :class:`Scheduler` with its :class:`UpdateSessions` (``kwargs``: the sessions'), started.
    Stop it with ``sessions.scheduler.stop()``."""
    sched = Scheduler(driver)
    sessions = UpdateSessions(sched, transfer_infos=driver.run(Op.TRANSFER_INFO), **kwargs)
    sched.start()
    return sessions


@contextmanager
def serve_process(args: list[str], port: int, log: Path, log_level: str = "warning") -> Iterator[subprocess.Popen]:
    """``weightsync serve ARGS --port PORT`` in a session of its own, its output in ``log``; the
    whole process group is SIGKILLed when the block ends (a test's engine leaves nothing)."""
    cmd = [sys.executable, "-m", "weightsync.cli", "serve", *args, "--port", str(port), "--log-level", log_level]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
