#!/usr/bin/env python3
"""An update that loses an engine, and the updates after it: p2p vs broadcast.

Starts ``--engines`` engines (``weightsync serve``, dummy weights) and one trainer rank in this
process (a gloo group of one, random weights of the trainer layout), then for each mode
(``p2p``, ``broadcast``), with ``UpdaterConfig(on_engine_failure="drop")`` and every update
verified:

* ``normal``: ``--repeats`` updates into every engine (after one warm-up update);
* ``with the drop``: one update during which engine 0 is SIGKILLed as the write starts: the
  others verify and publish; broadcast rebuilds its weight-update groups for the survivors
  (``UpdateStats.group_rebuild_s``), p2p skips the dead engine's ranks (nothing rebuilt);
* ``after the drop``: ``--repeats`` updates into the survivors (p2p: the same compiled sender;
  broadcast: the survivors' new groups);

then restarts engine 0 (fresh dummy weights) and times ``refresh()`` (which has it join the
published version from a peer) and the next update into all of them. Every figure is the wall
time of ``update()`` / ``refresh()`` on the trainer rank. Prints a table; ``--out FILE`` writes
every figure as JSON. Every engine is stopped, always.

    python scripts/bench_fleet.py                                   # CPU, Qwen3-4B tiny, 3 engines
    python scripts/bench_fleet.py --scale layers=2 --repeats 3
    python scripts/bench_fleet.py --device cuda --scale full --out fleet.json   # GPU (not yet run)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weightsync import UpdaterConfig, WeightUpdater
from weightsync.layout.megatron import trainer_layout
from weightsync.models.parallel import TrainParallel
from weightsync.models.resolve import model_spec
from weightsync.proc import free_port
from weightsync.sync.engine_client import EngineClient

TRAIN = TrainParallel(world_size=1)


@contextmanager
def serve(argv: list[str], port: int, log: Path) -> Any:
    """``weightsync serve ARGV`` on ``port`` until the block ends (its process group killed then)."""
    cmd = [sys.executable, "-m", "weightsync.cli", "serve", *argv, "--port", str(port), "--log-level", "warning"]
    with log.open("a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    client = EngineClient(f"http://127.0.0.1:{port}")
    try:
        client.wait_healthy(timeout_s=600, proc_alive=lambda: proc.poll() is None)
        yield proc
    finally:
        client.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Fleet:
    """The engines, on fixed ports (a restarted one keeps its URL)."""

    def __init__(self, argv: list[str], n: int, work: Path) -> None:
        self.argv, self.work = argv, work
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.stacks = [ExitStack() for _ in range(n)]
        self.procs: list[Any] = [None] * n

    def start(self, i: int) -> None:
        self.procs[i] = self.stacks[i].enter_context(serve(self.argv, self.ports[i], self.work / f"engine{i}.log"))

    def kill(self, i: int) -> None:
        """SIGKILL engine ``i`` and its ranks (no goodbye)."""
        os.killpg(self.procs[i].pid, signal.SIGKILL)
        self.stacks[i].close()
        self.stacks[i] = ExitStack()

    def close(self) -> None:
        for s in self.stacks:
            s.close()


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def one_mode(mode: str, fleet: Fleet, args: argparse.Namespace, spec: Any, group: Any) -> dict[str, Any]:
    """The figures of one mode (module docstring); leaves every engine running."""
    gen = torch.Generator().manual_seed(1)
    device = torch.device(args.device)
    params = {t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype)).to(device)
              for t in trainer_layout(spec, TRAIN, 0)}
    cfg = UpdaterConfig(mode=mode, on_engine_failure="drop", verify_every=1, http_timeout_s=120.0,
                        group_timeout_s=args.group_timeout_s, deadline_s=args.group_timeout_s)
    version = 0

    def update() -> tuple[float, Any]:
        nonlocal version
        version += 1
        for t in params.values():
            t.add_(1e-3)
        s, stats = timed(lambda: updater.update(version))
        if not stats.verified:
            raise RuntimeError(f"{mode} update {version} was not verified")
        return s, stats

    out: dict[str, Any] = {}
    with WeightUpdater(params, spec=spec, train=TRAIN, engine_urls=fleet.urls, group=group, config=cfg) as updater:
        update()
        out["normal_s"] = [update()[0] for _ in range(args.repeats)]
        real = updater.write

        def write_killing(m: Any = "p2p", **kwargs: Any) -> Any:
            updater.write = real
            fleet.kill(0)
            return real(m, **kwargs)

        updater.write = write_killing
        s, stats = update()
        if list(stats.dropped) != [0]:
            raise RuntimeError(f"{mode}: expected engine 0 dropped, got {stats.dropped}")
        out["with_drop_s"], out["group_rebuild_s"] = s, stats.group_rebuild_s
        after = [update() for _ in range(args.repeats)]
        out["after_drop_s"] = [s for s, _ in after]
        out["after_drop_group_rebuild_s"] = [st.group_rebuild_s for _, st in after]
        fleet.start(0)
        out["refresh_s"], _ = timed(updater.refresh)
        if updater.excluded:
            raise RuntimeError(f"{mode}: engine 0 not back after refresh(): {updater.excluded}")
        out["back_s"] = update()[0]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Qwen3-4B")
    p.add_argument("--scale", default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default="p2p,broadcast")
    p.add_argument("--group-timeout-s", type=float, default=120.0,
                   help="the weight-update groups' timeout and the write deadline (what a stuck survivor would wait)")
    p.add_argument("--out", default=None, help="write every figure as JSON here")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    spec = model_spec(args.model, args.scale)
    transport = "shm" if args.device == "cpu" else "cuda_ipc"
    argv = [args.model, "--scale", args.scale, "--device", args.device, "--transport", transport,
            "--load-format", "dummy", "--group-timeout-s", str(args.group_timeout_s)]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    group = dist.new_group(ranks=[0], backend="gloo")
    work = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    fleet = Fleet(argv, args.engines, work)
    results: dict[str, Any] = {}
    try:
        for i in range(args.engines):
            fleet.start(i)
        for mode in args.modes.split(","):
            results[mode] = one_mode(mode, fleet, args, spec, group)
            print(f"{mode}: {json.dumps(results[mode])}", flush=True)
    finally:
        fleet.close()
        dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    report(results, args)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "model": args.model, "scale": args.scale, "device": args.device, "engines": args.engines,
            "repeats": args.repeats, "results": results, "host": platform.node(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d")}, indent=1))
    return 0


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    med = statistics.median
    print(f"\n{args.model} {args.scale} on {args.device}, {args.engines} engines, median of {args.repeats} "
          "(seconds, update() wall time):")
    print(f"  {'mode':10s} {'normal':>8s} {'with drop':>10s} {'rebuild':>8s} {'after drop':>11s} {'refresh':>8s} "
          f"{'back':>8s}")
    for mode, r in results.items():
        print(f"  {mode:10s} {med(r['normal_s']):8.3f} {r['with_drop_s']:10.3f} {r['group_rebuild_s']:8.3f} "
              f"{med(r['after_drop_s']):11.3f} {r['refresh_s']:8.3f} {r['back_s']:8.3f}")


if __name__ == "__main__":
    sys.exit(main())
