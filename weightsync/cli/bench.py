"""``weightsync bench MODEL``: p2p vs broadcast vs the link's own copy rate, measured in one run
(see :mod:`weightsync.launch.bench`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from weightsync.launch.bench.config import build_config
from weightsync.launch.bench.summary import format_table, summarize
from weightsync.plan.broadcast import DEFAULT_BUCKET_GB
from weightsync.plan.records import Mode
from weightsync.transport import AUTO, run_choices

DEFAULT_TRAIN = "tp=2,pp=1,cp=1,ep=1,etp=1,world=2"
"""Trainer TP 2 on 2 ranks, whatever the profile's sizes (``mla_rep`` stays the profile's)."""
DEFAULT_ROLLOUT = "tp=2,ep=1,dp=1,engines=1"
"""One engine of TP 2, whatever the profile's sizes."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registry model name (weightsync list)")
    p.add_argument("--scale", default="tiny", help="full | layers=N | tiny (default tiny)")
    p.add_argument("--train", default=DEFAULT_TRAIN,
                   help="trainer sizes: tp=..,pp=..,cp=..,ep=..,etp=..,world=..,dp=..,last=..,mla_rep=0|1 replace the "
                        "run profile's, keys not given keep the profile's (the world size too unless world= or dp=; "
                        f"\"\": the profile's) (default {DEFAULT_TRAIN})")
    p.add_argument("--rollout", default=DEFAULT_ROLLOUT,
                   help="engine sizes: tp=..,ep=..,dp=..,engines=.. replace the run profile's (\"\": the "
                        f"profile's) (default {DEFAULT_ROLLOUT})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where trainer and engine ranks run")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.BOTH.value, help="the modes measured")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode, after one warm-up run")
    p.add_argument(
        "--placement",
        choices=("split", "colocated"),
        default="split",
        help="cuda: split = every rank on a GPU of its own (trainers first); colocated = "
        "trainer rank i and rollout rank i share GPU i",
    )
    p.add_argument(
        "--transport",
        choices=run_choices(),
        metavar="KIND",
        default=AUTO,
        help="p2p transport: %(choices)s (auto: the written policy over the placement; a kind: forced for every pair)",
    )
    p.add_argument("--bucket-gb", type=float, default=DEFAULT_BUCKET_GB,
                   help="staging / broadcast bucket size in GiB, 2**30 bytes, as BUCKET_SIZE_GB of run (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--seed", type=int, default=1234, help="seed of the weights' values")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck benchmark is stopped")
    p.add_argument("--out", default=None, help="write the JSON record here (else it is printed as one BENCH_JSON "
                   "line)")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg, notes = build_config(args)
    except ValueError as exc:
        print(f"weightsync bench: {exc}", file=sys.stderr)
        return 2
    modes = "+".join(cfg.modes)
    print(
        f"weightsync bench {cfg.model} {cfg.scale}: train {args.train} ({cfg.train.world_size} ranks) -> rollout "
        f"{args.rollout} ({cfg.rollout.world_size} ranks), {cfg.device}/{cfg.transport.kind}, modes {modes}, "
        f"{cfg.repeats} timed runs after a warm-up",
        flush=True,
    )
    for n in notes:
        print(f"note: {n}", flush=True)
    # spawns the ranks; imports torch, which the parser of every command must not
    from weightsync.launch.bench.launcher import run_processes

    t0 = time.perf_counter()
    results = run_processes(cfg)
    summary = summarize(cfg, results, notes)
    summary["wall_s"] = time.perf_counter() - t0
    print(format_table(summary), flush=True)
    line = json.dumps(summary, sort_keys=True)
    if args.out:  # the record goes to the file alone: it is several KB, not for the console
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(line + "\n")
        print(f"results: {path}", flush=True)
    else:
        print("BENCH_JSON " + line, flush=True)
    if not summary["verified"]:
        print("weightsync bench: an engine rank's parameters differ from the expected values", file=sys.stderr)
        return 1
    return 0
