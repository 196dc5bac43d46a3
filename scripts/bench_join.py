#!/usr/bin/env python3
"""Time from an engine's start to serving the fleet's current version: from a peer vs from disk.

Starts one peer engine (``weightsync serve --checkpoint DIR``, the fleet's version ``v3``), then,
``--repeats`` times each, a new engine of another layout and measures the wall time from launching
its process to the first moment ``/health`` says ``serving`` at ``v3`` and ``/generate`` answers:

* ``peer``: ``serve --join-from PEER`` -- loads nothing, copies the peer's served weights one-sided
  into its shadow, verifies them by fingerprint, flips (docs/engine.md, "Joining and stale");
* ``disk``: ``serve --checkpoint DIR`` -- loads the same version from the safetensors checkpoint
  (what ``update_weights_from_disk`` reads);
* ``next update``: ``serve --load-format dummy`` -- up without the fleet's weights, it must wait
  for the next trainer update: its start-up is measured, the wait is the update interval
  (``--update-interval-s``, not measured here): on average half of it, at worst all of it.

The checkpoint is written once (synthetic weights of the model at ``--scale``). Prints a table;
``--out FILE`` writes every figure as JSON. Every engine is stopped, always.

    python scripts/bench_join.py --model Qwen3-30B-A3B --scale tiny            # CPU, shm
    python scripts/bench_join.py --model Qwen3-4B --scale layers=2
    python scripts/bench_join.py --device cuda --scale full --out join.json     # one GPU, cuda_ipc
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from weightsync.models.checkpoint import hf_config_dict, synthetic_hf_tensors, write_hf_checkpoint
from weightsync.models.resolve import model_spec
from weightsync.proc import free_port

VERSION = "v3"


@contextmanager
def serve(argv: list[str], port: int, log: Path) -> Iterator[subprocess.Popen]:
    cmd = [sys.executable, "-m", "weightsync.cli", "serve", *argv, "--port", str(port), "--log-level", "warning"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def until_serving(proc: subprocess.Popen, port: int, version: str | None, log: Path, timeout_s: float) -> float:
    """Seconds from now until the engine serves ``version`` (any, when None) and ``/generate`` answers."""
    t0 = time.monotonic()
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited:\n{log.read_text()[-2000:]}")
        try:
            h = httpx.get(f"{url}/health", timeout=5).json()
            if h.get("state") == "serving" and (version is None or h.get("weight_version") == version):
                r = httpx.post(f"{url}/generate", timeout=60,
                               json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
                if r.status_code == 200:
                    return time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"not serving within {timeout_s} s:\n{log.read_text()[-2000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Qwen3-30B-A3B")
    p.add_argument("--scale", default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--peer-tp", type=int, default=1, help="the peer's TP (and EP) size")
    p.add_argument("--tp", type=int, default=1, help="the new engine's TP size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--update-interval-s", type=float, default=60.0,
                   help="the trainer's update interval the 'next update' way waits (not measured)")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", default=None, help="write every figure as JSON here")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-join-"))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    """Every way, ``args.repeats`` times, against one peer; prints and writes the figures."""
    transport = "shm" if args.device == "cpu" else "cuda_ipc"
    spec = model_spec(args.model, args.scale)
    t0 = time.monotonic()
    write_hf_checkpoint(work / "ckpt", synthetic_hf_tensors(spec, 7), hf_config_dict(spec))
    ckpt = str(work / "ckpt")
    print(f"checkpoint of {args.model} {args.scale} written in {time.monotonic() - t0:.1f} s", flush=True)
    common = [args.model, "--scale", args.scale, "--device", args.device, "--transport", transport,
              "--checkpoint", ckpt]
    ways = {
        "peer": ["--tp", str(args.tp), "--join-from", "PEER"],
        "disk": ["--tp", str(args.tp), "--weight-version", VERSION],
        "next update": ["--tp", str(args.tp), "--load-format", "dummy"],
    }
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    peer_port = free_port()
    peer_argv = [*common, "--tp", str(args.peer_tp), "--ep", str(args.peer_tp), "--weight-version", VERSION]
    with serve(peer_argv, peer_port, work / "peer.log") as peer:
        until_serving(peer, peer_port, VERSION, work / "peer.log", args.timeout_s)
        for i in range(args.repeats):
            for way, extra in ways.items():
                argv = [*common, *[f"http://127.0.0.1:{peer_port}" if a == "PEER" else a for a in extra]]
                port, log = free_port(), work / f"{way.replace(' ', '_')}{i}.log"
                start = time.monotonic()
                with serve(argv, port, log) as proc:
                    until_serving(proc, port, None if way == "next update" else VERSION, log, args.timeout_s)
                    seconds[way].append(time.monotonic() - start)
                print(f"  {way:12s} run {i}: {seconds[way][-1]:.2f} s", flush=True)
    med = {w: statistics.median(s) for w, s in seconds.items()}
    result: dict[str, Any] = {
        "model": args.model, "scale": args.scale, "device": args.device, "transport": transport,
        "peer_tp": args.peer_tp, "tp": args.tp, "repeats": args.repeats, "nbytes_per_copy": spec_bytes(spec),
        "start_to_serving_s": seconds, "median_s": med,
        "next_update_expected_s": med["next update"] + args.update_interval_s / 2,
        "next_update_worst_s": med["next update"] + args.update_interval_s,
        "update_interval_s": args.update_interval_s,
        "host": platform.node(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
    }
    print(f"\n{args.model} {args.scale} on {args.device} ({transport}), peer tp {args.peer_tp} -> tp {args.tp}, "
          f"median of {args.repeats}:")
    print(f"  from a peer      {med['peer']:8.2f} s")
    print(f"  from disk        {med['disk']:8.2f} s")
    print(f"  next update      {med['next update']:8.2f} s start + {args.update_interval_s / 2:.0f} s average wait "
          f"(interval {args.update_interval_s:.0f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def spec_bytes(spec: Any) -> int:
    """Bytes of the model's global tensors (what one copy moves)."""
    from weightsync.models.hf import DTYPE_BYTES, global_tensors

    total = 0
    for g in global_tensors(spec).values():
        n = 1
        for d in g.shape:
            n *= d
        total += n * DTYPE_BYTES[g.dtype]
    return total


if __name__ == "__main__":
    sys.exit(main())
