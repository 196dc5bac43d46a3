"""Benchmark: N Mooncake batch writes in flight at once versus the same writes one after another.

One writer (this process) and ``--dests`` receiver processes (each a Mooncake TransferEngine on
127.0.0.1 with one registered buffer, published by descriptor). Every step writes ``--size-mb``
MiB to every receiver as one batch of ``--run-kb`` KiB runs -- one batch per (destination,
bucket), as the p2p sender issues them. Two ways, alternating step by step so that both see the
same machine load:

* ``serialized``: a transport with ``workers=1`` (what the transport had before: one batch at a
  time);
* ``concurrent``: ``workers=--dests``, every batch issued before any is waited for.

After a warm-up write per destination (connection set-up), ``--repeats`` steps of each; the median
seconds per step and GB/s (bytes of all destinations / seconds, 10^9) are printed, and every
receiver's bytes are checked against the source at the end. ``--json PATH`` writes the results.

    python scripts/bench_mooncake_concurrency.py --dests 4 --size-mb 64 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from weightsync.transport import PeerDescriptor, deadline_after
from weightsync.transport.mooncake import MooncakeTransport

DEADLINE_S = 300.0


def receiver(nbytes: int, conn: Any) -> None:
    """One destination: register a buffer, publish it, answer its checksum when asked, exit."""
    t = MooncakeTransport(protocol="tcp", hostname="127.0.0.1")
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    t.register_tensor("dst", dst)
    conn.send(t.descriptor().to_json())
    conn.recv()
    conn.send(int(dst.to(torch.int64).sum()))
    conn.recv()
    t.close()


def runs(src: torch.Tensor, dst_addr: int, run_bytes: int) -> np.ndarray:
    n = src.numel() // run_bytes
    off = np.arange(n, dtype=np.int64) * run_bytes
    return np.stack([src.data_ptr() + off, dst_addr + off, np.full(n, run_bytes, dtype=np.int64)], axis=1)


def step(t: MooncakeTransport, batches: list[Any], peers: list[Any]) -> float:
    t0 = time.perf_counter()
    handles = [t.write(p, b) for p, b in zip(peers, batches)]
    for h in handles:
        t.wait(h, deadline_after(DEADLINE_S))
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dests", type=int, default=4)
    ap.add_argument("--size-mb", type=int, default=64, help="MiB per destination per step")
    ap.add_argument("--run-kb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    nbytes = args.size_mb << 20
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(args.dests):
        a, b = ctx.Pipe()
        p = ctx.Process(target=receiver, args=(nbytes, b), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    descs = [PeerDescriptor.from_json(c.recv()) for c in pipes]
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    modes = {"serialized": 1, "concurrent": args.dests}
    setups = {}
    for mode, workers in modes.items():
        t = MooncakeTransport(protocol="tcp", hostname="127.0.0.1", workers=workers)
        t.register_tensor("src", src)
        peers = [t.connect(d) for d in descs]
        batches = [t.prepare(p, runs(src, d.region("dst").addr, args.run_kb << 10)) for p, d in zip(peers, descs)]
        step(t, batches, peers)  # warm-up: open every segment
        setups[mode] = (t, batches, peers)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, (t, batches, peers) in setups.items():
            times[mode].append(step(t, batches, peers))
    want = int(src.to(torch.int64).sum())
    for c in pipes:
        c.send("sum")
    ok = all(c.recv() == want for c in pipes)
    for t, _, _ in setups.values():
        t.close()
    for c in pipes:
        c.send("exit")
    for p in procs:
        p.join(timeout=30)
    total = nbytes * args.dests
    out: dict[str, Any] = {
        "dests": args.dests, "mib_per_dest": args.size_mb, "run_kib": args.run_kb, "repeats": args.repeats,
        "bytes_per_step": total, "bytes_exact": ok, "cpus": mp.cpu_count(), "machine": platform.node(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).resolve().parent.parent).stdout.strip(),
    }
    for mode in modes:
        med = statistics.median(times[mode])
        out[mode] = {"workers": modes[mode], "median_s": med, "min_s": min(times[mode]), "gbps": total / med / 1e9,
                     "all_s": times[mode]}
        print(f"{mode:>10} (workers={modes[mode]}): median {med * 1e3:8.1f} ms, min {min(times[mode]) * 1e3:8.1f} ms,"
              f" {total / med / 1e9:.2f} GB/s")
    speedup = out["serialized"]["median_s"] / out["concurrent"]["median_s"]
    out["speedup"] = speedup
    print(f"concurrent / serialized: {speedup:.2f}x on {total / 2**20:.0f} MiB per step; bytes exact: {ok}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
