"""Planner benchmark: whole plan + verification, and one rank's own part, on a full-size profile.

Prints, per mode:

* ``layouts``: computing every trainer and engine rank's layout (the layout modules' cost);
* ``whole``: the whole plan, then its verification (wall and CPU seconds, ops);
* ``rank``: one trainer rank's ops and one rollout rank's ops (``plan_for_rank``), given the
  layouts, and again in a fresh process that first computes the layouts it needs.

Usage::

    .venv/bin/python scripts/bench_plan.py                       # Kimi-K2, 256 + 256, both modes
    .venv/bin/python scripts/bench_plan.py --model GLM-5 --modes p2p
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from weightsync.layout.megatron import trainer_layout  # noqa: E402
from weightsync.layout.sglang import engine_layout  # noqa: E402
from weightsync.models import get_model, get_profile  # noqa: E402
from weightsync.plan.api import build_plan, plan_for_rank, verify_plan  # noqa: E402
from weightsync.plan.inputs import build_inputs  # noqa: E402


def _timed(f):
    w, c = time.perf_counter(), time.process_time()
    out = f()
    return out, time.perf_counter() - w, time.process_time() - c


def _inputs(args):
    prof = get_profile(args.model)
    spec = get_model(args.model, args.scale)
    return build_inputs(spec, prof.train, prof.rollout, trainer_layout=trainer_layout, engine_layout=engine_layout)


def one_rank(args) -> dict:
    """In a fresh process: layouts needed by one rank, then its plan (the ``--one`` mode)."""
    which, _, value = args.one.partition("=")
    rank = int(value)
    (inputs, lw, lc) = _timed(lambda: _inputs(args))
    kw = {"src_rank": rank} if which == "src" else {"dst_rank": rank}
    plan, pw, pc = _timed(lambda: plan_for_rank(inputs, args.modes, **kw))
    return {"layouts_wall": lw, "layouts_cpu": lc, "plan_wall": pw, "plan_cpu": pc, "ops": plan.num_ops}


def bench_mode(args, inputs, mode: str, layout_wall: float) -> None:
    try:
        plan, pw, pc = _timed(lambda: build_plan(inputs, mode))
    except ValueError as exc:
        print(f"{mode}: planning refused: {exc}")
        return
    _, vw, vc = _timed(lambda: verify_plan(plan, inputs))
    print(f"{mode}: whole plan {pw:.2f} s wall ({pc:.2f} s CPU), {plan.num_ops:,} ops; verify {vw:.2f} s wall "
          f"({vc:.2f} s CPU); plan + verify {pw + vw:.2f} s wall, with the layouts {layout_wall + pw + vw:.2f} s")
    for which, rank in (("src", args.src_rank), ("dst", args.dst_rank)):
        kw = {"src_rank": rank} if which == "src" else {"dst_rank": rank}
        part, w, c = _timed(lambda kw=kw: plan_for_rank(inputs, mode, **kw))
        cmd = [sys.executable, __file__, "--model", args.model, "--scale", args.scale, "--modes", mode,
               "--one", f"{which}={rank}"]
        fresh = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        side = "trainer" if which == "src" else "rollout"
        print(f"{mode}: {side} rank {rank}: {part.num_ops:,} ops in {w:.2f} s wall ({c:.2f} s CPU) given the layouts; "
              f"fresh process: layouts {fresh['layouts_wall']:.2f} s + plan {fresh['plan_wall']:.2f} s wall")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Kimi-K2")
    p.add_argument("--scale", default="full")
    p.add_argument("--modes", default="p2p,broadcast")
    p.add_argument("--src-rank", type=int, default=0)
    p.add_argument("--dst-rank", type=int, default=0)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_rank(args)))
        return 0
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    prof = get_profile(args.model)
    print(f"{args.model} ({args.scale}) train {prof.train.world_size} + rollout {prof.rollout.world_size} ranks; "
          f"{os.cpu_count()} CPUs ({platform.processor() or 'cpu'}); "
          f"commit {commit}; load {os.getloadavg()[0]:.1f}")
    inputs, lw, lc = _timed(lambda: _inputs(args))
    print(f"layouts: {lw:.2f} s wall ({lc:.2f} s CPU)")
    for mode in args.modes.split(","):
        bench_mode(args, inputs, mode, lw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
