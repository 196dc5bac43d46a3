"""The benchmark's launcher side: one spawned process per trainer and rollout rank, their replies.

Every process runs :func:`~weightsync.launch.bench.worker.rank_main` and puts one
:class:`~weightsync.launch.messages.Reply` on a queue: its result, or its traceback.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch.multiprocessing as mp

from weightsync.launch.bench.config import GPU_ENV, BenchConfig
from weightsync.launch.bench.worker import RankResult, rank_main
from weightsync.launch.messages import Reply
from weightsync.proc import end_child

NT_THRESHOLD_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
NT_THRESHOLD_BYTES = 4 << 20
"""glibc switches memcpy to non-temporal (streaming) stores above this size. Its default is 3/4 of
the shared cache it detects, which a VM can report far too large: the 2-core CPU machines report a
256 MiB L3 (the EPYC has 32 MiB), so every copy below 192 MiB used cached stores, and a 64 MiB copy
ran at 3.4 GB/s against 6.1 GB/s with streaming stores (same machine, alternating runs). The
parameter runs of a p2p update are 1-100 MiB each, while one large reference copy is not: without
this, the benchmark would compare the two under different copy loops."""


def host_copy_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``GLIBC_TUNABLES`` value that sets :data:`NT_THRESHOLD_BYTES` for processes started with
    ``environ`` (kept as is when the caller already set that tunable). Read at process start only."""
    current = environ.get("GLIBC_TUNABLES", "")
    if NT_THRESHOLD_TUNABLE in current:
        return {}
    entry = f"{NT_THRESHOLD_TUNABLE}={NT_THRESHOLD_BYTES:#x}"
    return {"GLIBC_TUNABLES": f"{current}:{entry}" if current else entry}


def run_processes(cfg: BenchConfig) -> list[RankResult]:
    """Spawn one process per trainer and rollout rank, collect their results (rank order).

    SIGTERM (e.g. from ``timeout``) stops the children too; they also die with this process.

    Raises:
        RuntimeError: a process failed (its traceback is in the message) or the benchmark ran past
            its timeout; every process is stopped first.
    """
    os.environ.update({**GPU_ENV, **host_copy_env(os.environ)})  # spawned children inherit it
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, cfg, results), daemon=True) for r in range(cfg.world_size)]
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for p in procs:
            p.start()
        got, errors = _collect(procs, results, cfg.timeout_s + 30)
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise RuntimeError(f"benchmark ranks {sorted(errors)} failed:\n{text}")
        if len(got) < len(procs):
            raise RuntimeError(f"benchmark did not finish in {cfg.timeout_s + 30:.0f} s")
        for p in procs:
            p.join(timeout=60)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            end_child(p, 10)
    return [got[r] for r in range(len(procs))]


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _collect(procs: Sequence[Any], results: Any, timeout_s: float) -> tuple[dict[int, RankResult], dict[int, str]]:
    """Results and errors by rank, until every process answered, one died, or ``timeout_s``.

    After the first error the others get 5 s to report theirs (they usually fail in turn, a peer
    having closed its connections), so that the first cause is in the message.
    """
    got: dict[int, RankResult] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            reply: Reply[RankResult] = results.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got and i not in errors]
            if dead:
                errors[dead[0]] = f"exited with code {procs[dead[0]].exitcode} without a result"
                deadline = min(deadline, time.monotonic() + 5.0)
            continue
        if reply.ok and reply.value is not None:
            got[reply.rank] = reply.value
        else:
            errors[reply.rank] = reply.error or "no result"
            deadline = min(deadline, time.monotonic() + 5.0)
    return got, errors
