#!/usr/bin/env python3
"""What the engines wait for per verified update: paused vs pause-free (swap, copy), one call.

Starts one engine (``weightsync serve``, dummy weights, a shadow copy where it fits) and, in this
process, one trainer rank whose parameters are synthetic tensors on the same device (colocated on
one GPU, or both on the CPU), then runs verified updates through :class:`weightsync.WeightUpdater`
in three ways against the same engine and weights:

* ``paused``: ``pause_free="off"`` -- generation stops from pause to continue (write, end,
  verification, version inside the pause);
* ``swap`` / ``copy``: pause-free -- the update lands in the shadow while the engine serves, and
  only the flip stops generation.

Every update is verified (``verify_every=1``). For each way it reports the median of the engines'
idle time (``UpdateStats.engine_idle_s``), the write, the verification and the whole update, beside
a device copy of the engine's bytes measured in the same run (the copy flip's floor). Prints a
table last; ``--out FILE`` writes every figure as JSON. The engine is stopped at the end, always.

    python scripts/bench_pause_free.py --model Qwen3-4B --scale tiny            # CPU, shm
    python scripts/bench_pause_free.py --device cuda --scale full --out r.json  # one GPU, cuda_ipc
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

from weightsync import UpdaterConfig, WeightUpdater
from weightsync.layout.megatron import trainer_layout
from weightsync.models import get_model
from weightsync.models.parallel import TrainParallel
from weightsync.proc import free_port

WAYS = {"paused": {"pause_free": "off"}, "swap": {"pause_free": "on", "flip": "swap"},
        "copy": {"pause_free": "on", "flip": "copy"}}


def start_engine(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    transport = "cuda_ipc" if args.device == "cuda" else "shm"
    cmd = [sys.executable, "-m", "weightsync.cli", "serve", args.model, "--scale", args.scale, "--tp", "1",
           "--device", args.device, "--transport", transport, "--load-format", "dummy", "--port", str(port),
           "--die-with-parent"]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"engine exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"engine not healthy within {deadline_s:.0f} s:\n{log.read_text()[-3000:]}")


COPY_PROBE_BYTES = 4 << 30
"""The device copy is timed on at most this many bytes and scaled to the update's (a copy's time is
linear in its size at this scale; two buffers of the model's size would not fit beside the engine)."""


def device_copy_s(nbytes: int, device: torch.device, repeats: int = 10) -> float:
    """Median time of one copy of ``nbytes`` between two buffers on ``device`` (timed on at most
    :data:`COPY_PROBE_BYTES` and scaled)."""
    probe = min(nbytes, COPY_PROBE_BYTES)
    return _copy_s(probe, device, repeats) * nbytes / probe


def _copy_s(nbytes: int, device: torch.device, repeats: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    times = []
    for _ in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return statistics.median(times[2:])


def run_way(name: str, params: dict, spec, train: TrainParallel, url: str, group, args) -> list[dict]:
    # on one GPU, broadcast hands full tensors over by CUDA IPC (NCCL cannot hold two ranks on one GPU)
    colocated = args.device == "cuda" and args.mode == "broadcast"
    config = UpdaterConfig(mode=args.mode, bucket_bytes=args.bucket_mb << 20, verify_every=1, colocated=colocated,
                           **WAYS[name])
    out = []
    with WeightUpdater(params, spec=spec, train=train, engine_urls=[url], group=group, config=config) as up:
        for i in range(args.updates):
            with torch.no_grad():  # the "optimizer step": every weight changes
                for t in params.values():
                    t.add_(1)
            s = up.update(f"{name}-{i}")
            if not s.verified:
                raise SystemExit(f"{name} update {i} not verified")
            out.append({"engine_idle_s": s.engine_idle_s, "update_s": s.update_s, "pause_free": s.pause_free,
                        "flip": s.flip, "phases": s.phases, "idle_phases": s.idle_phases, "bytes": s.bytes,
                        "pause_reason": s.pause_reason})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen3-4B")
    p.add_argument("--scale", default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--mode", default="p2p", choices=("p2p", "broadcast"))
    p.add_argument("--updates", type=int, default=5, help="per way; the first is left out of the medians")
    p.add_argument("--ways", default="paused,swap,copy")
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device(args.device)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="bench_pause_free_")) / "engine.log"
    engine = start_engine(args, port, log)
    results: dict = {"model": args.model, "scale": args.scale, "device": args.device, "mode": args.mode}
    try:
        wait_healthy(url, engine, log, deadline_s=600)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        group = dist.new_group(backend="gloo")
        spec = get_model(args.model, args.scale)
        train = TrainParallel(world_size=1)
        torch.manual_seed(0)  # generated where they live: GBs of random numbers are slow on a host
        params = {t.name: torch.randn(t.shape, device=device).to(getattr(torch, t.dtype))
                  for t in trainer_layout(spec, train, rank=0)}
        nbytes = sum(t.numel() * t.element_size() for t in params.values())
        results["trainer_bytes"] = nbytes
        for name in args.ways.split(","):
            results[name] = run_way(name, params, spec, train, url, group, args)
        results["device_copy_s"] = device_copy_s(nbytes, device)
    finally:
        os.killpg(engine.pid, signal.SIGTERM)
        try:
            engine.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(engine.pid, signal.SIGKILL)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    copy_ms = results["device_copy_s"] * 1e3
    print(f"{args.model} {args.scale} on {args.device}, {args.mode}, {nbytes / 1e9:.2f} GB per update; "
          f"a device copy of those bytes: {copy_ms:.2f} ms")
    print(f"{'way':8} {'idle ms':>10} {'idle/copy':>10} {'write ms':>10} {'verify ms':>10} {'update ms':>10}")
    for name in args.ways.split(","):
        rows = results[name][1:] or results[name]
        med = {k: statistics.median(r[k] for r in rows) for k in ("engine_idle_s", "update_s")}
        verify = statistics.median(r["phases"].get("verify", 0.0) for r in rows)
        write = statistics.median(r["phases"].get("wire", r["phases"].get("write", 0.0)) for r in rows)
        print(f"{name:8} {med['engine_idle_s'] * 1e3:10.2f} {med['engine_idle_s'] * 1e3 / copy_ms:10.2f} "
              f"{write * 1e3:10.2f} {verify * 1e3:10.2f} {med['update_s'] * 1e3:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
