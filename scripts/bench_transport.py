"""Benchmark the transports against the copy rate of the same machine, measured in the same run.

CPU (``--transport shm|mooncake|dist|cpu``, ``cpu`` = all three)::

    python scripts/bench_transport.py --transport cpu --size-mb 256

measures a plain in-process memcpy (``ctypes.memmove``) of the buffer, then for each transport
a receiver process (destination in ``new_arena``, published by descriptor) and a writer in this
process: the first write (cold: page-table set-up) and the best / median of the next
``--repeats``. GB/s are bytes moved / seconds (10^9); the ratio is to the memcpy.

GPU (``--transport cuda_ipc``)::

    python scripts/bench_transport.py --transport cuda_ipc --size-gb 4

measures a same-GPU copy (``copy_``, HBM rate), a GPU0 -> GPU1 ``copy_`` (the link rate, when
two GPUs are visible), then our cuda_ipc write from this process (GPU 0) into a receiver
process (GPU 1, or GPU 0 with one GPU): one run, and the same bytes as shuffled 1 MiB runs
(no coalescing possible: per-run issue cost). The ratio is to the link rate, or to the same-GPU
copy with one GPU.

``--run-kb K`` splits every write into K KiB runs in shuffled order (default: one run);
``--json PATH`` also writes the results.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from weightsync.proc import free_port
from weightsync.transport import HOST, PeerDescriptor, deadline_after, make_transport

CPU_KINDS = ("shm", "mooncake", "dist")
DEADLINE_S = 600.0


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(first call seconds, seconds of each of ``repeats`` further calls)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, times


def row(name: str, nbytes: int, first: float | None, times: list[float], ref: float | None) -> dict[str, Any]:
    best, med = gbps(nbytes, min(times)), gbps(nbytes, statistics.median(times))
    out = {"name": name, "bytes": nbytes, "best_gbps": best, "median_gbps": med}
    if first is not None:
        out["first_gbps"] = gbps(nbytes, first)
    if ref:
        out["ratio_best"] = best / ref
    cold = f"first {out['first_gbps']:7.2f}  " if first is not None else " " * 15
    ratio = f"  x{out['ratio_best']:.3f} of reference" if ref else "  (reference)"
    print(f"{name:<34} {cold}best {best:8.2f}  median {med:8.2f} GB/s{ratio}", flush=True)
    return out


def make_runs(src: int, dst: int, nbytes: int, run_bytes: int, seed: int = 0) -> list[tuple[int, int, int]]:
    if run_bytes <= 0 or run_bytes >= nbytes:
        return [(src, dst, nbytes)]
    offs = np.arange(0, nbytes, run_bytes)
    np.random.default_rng(seed).shuffle(offs)
    return [(src + o, dst + o, min(run_bytes, nbytes - o)) for o in offs.tolist()]


# ----------------------------------------------------------------------------------------------
# Receiver process


def receiver_main(kind: str, nbytes: int, device: int, port: int, conn: Any) -> None:
    """Allocate and publish the destination; serve "post"/"sum"/"exit" requests from the writer."""
    cfg: dict[str, Any] = {}
    if kind == "dist":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
        cfg["group"] = dist.group.WORLD
    if kind == "cuda_ipc":
        torch.cuda.set_device(device)
        cfg["device"] = device
    with make_transport(kind, **cfg) as t:
        arena = t.new_arena(nbytes, device="cpu" if device == HOST else f"cuda:{device}")
        dest = arena.empty((nbytes,), torch.uint8)
        dest.zero_()
        t.register("params", arena.base, arena.nbytes, device=device)
        conn.send(t.descriptor().to_json())
        peer = None
        while True:
            msg = conn.recv()
            if msg[0] == "exit":
                break
            if msg[0] == "sum":
                conn.send(int(dest.view(torch.int64).sum().item()))
            elif msg[0] == "post":  # dist: receive one write of these runs
                if peer is None:
                    peer = t.connect(PeerDescriptor.from_json(msg[1]))
                t.wait(t.post_recv(peer, msg[2]), deadline_after(DEADLINE_S))
                conn.send("ok")


class Receiver:
    def __init__(self, kind: str, nbytes: int, device: int, port: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(kind, nbytes, device, port, child), daemon=True)
        self.proc.start()

    def descriptor(self) -> PeerDescriptor:
        return PeerDescriptor.from_json(self.conn.recv())

    def close(self) -> None:
        self.conn.send(("exit",))
        self.proc.join(timeout=60)


# ----------------------------------------------------------------------------------------------
# CPU


def bench_memcpy(nbytes: int, repeats: int) -> dict[str, Any]:
    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    first, times = timed(lambda: ctypes.memmove(b.data_ptr(), a.data_ptr(), nbytes), repeats)
    return row("memcpy (in-process, ctypes)", nbytes, first, times, None)


def bench_cpu_transport(kind: str, nbytes: int, repeats: int, run_bytes: int, ref: float) -> dict[str, Any]:
    port = free_port()
    recv = Receiver(kind, nbytes, HOST, port)
    cfg: dict[str, Any] = {}
    if kind == "dist":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        cfg["group"] = dist.group.WORLD
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    try:
        with make_transport(kind, **cfg) as t:
            t.register_tensor("staging", src)
            desc = recv.descriptor()
            peer = t.connect(desc)
            runs = make_runs(src.data_ptr(), desc.region("params").addr, nbytes, run_bytes)
            batch = t.prepare(peer, runs)
            mine = t.descriptor().to_json()

            def once() -> None:
                if not t.one_sided:
                    recv.conn.send(("post", mine, runs))
                t.wait(t.write(peer, batch), deadline_after(DEADLINE_S))
                if not t.one_sided:
                    recv.conn.recv()

            first, times = timed(once, repeats)
            recv.conn.send(("sum",))
            if recv.conn.recv() != int(src.view(torch.int64).sum().item()):
                raise RuntimeError(f"{kind}: destination bytes differ from the source after the writes")
            label = f"{kind}" + (f" ({len(runs)} x {run_bytes >> 10} KiB runs)" if len(runs) > 1 else "")
            return row(label, nbytes, first, times, ref)
    finally:
        recv.close()
        if kind == "dist":
            import torch.distributed as dist

            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# GPU


def cuda_time(fn, repeats: int) -> tuple[float, list[float]]:
    def synced() -> None:
        fn()
        torch.cuda.synchronize()

    return timed(synced, repeats)


def copy_rate(src: torch.Tensor, device: int, label: str, repeats: int, ref: float | None) -> dict[str, Any]:
    """Rate of ``copy_`` from ``src`` into a new tensor on ``device``."""
    dst = torch.empty(src.numel(), dtype=torch.uint8, device=f"cuda:{device}")
    return row(label, src.numel(), *cuda_time(lambda: dst.copy_(src), repeats), ref)


def bench_gpu(nbytes: int, repeats: int, run_bytes: int) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        raise SystemExit("cuda_ipc benchmark needs CUDA (torch.cuda.is_available() is false)")
    n_gpu = torch.cuda.device_count()
    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    rows = [copy_rate(a, 0, "same-GPU copy_ (cuda:0)", repeats, None)]
    ref = rows[-1]["best_gbps"]
    dst_dev = 1 if n_gpu > 1 else 0
    if n_gpu > 1:
        rows.append(copy_rate(a, 1, "GPU0 -> GPU1 copy_ (link)", repeats, ref))
        ref = rows[-1]["best_gbps"]
    torch.cuda.empty_cache()
    recv = Receiver("cuda_ipc", nbytes, dst_dev, 0)
    try:
        with make_transport("cuda_ipc", device=0) as t:
            t.register_tensor("staging", a)
            desc = recv.descriptor()
            peer = t.connect(desc)
            for rb in dict.fromkeys([0, run_bytes or (1 << 20)]):
                runs = make_runs(a.data_ptr(), desc.region("params").addr, nbytes, rb)
                batch = t.prepare(peer, runs)
                first, times = timed(lambda b=batch: t.wait(t.write(peer, b), deadline_after(DEADLINE_S)), repeats)
                label = f"cuda_ipc GPU0 -> GPU{dst_dev}" + (f" ({len(runs)} x {rb >> 10} KiB)" if len(runs) > 1 else "")
                rows.append(row(label, nbytes, first, times, ref))
            recv.conn.send(("sum",))
            if recv.conn.recv() != int(a.view(torch.int64).sum().item()):
                raise RuntimeError("cuda_ipc: destination bytes differ from the source after the writes")
    finally:
        recv.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", choices=[*CPU_KINDS, "cpu", "cuda_ipc"], default="cpu")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--size-mb", type=float, help="bytes per write, MiB (default 256 on CPU)")
    size.add_argument("--size-gb", type=float, help="bytes per write, GiB (default 4 on GPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--run-kb", type=int, default=0, help="split each write into shuffled runs of this many KiB")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    gpu = args.transport == "cuda_ipc"
    if args.size_gb is not None:
        nbytes = int(args.size_gb * (1 << 30))
    elif args.size_mb is not None:
        nbytes = int(args.size_mb * (1 << 20))
    else:
        nbytes = (4 << 30) if gpu else (256 << 20)
    nbytes -= nbytes % 8
    print(f"# {nbytes / 2**20:.0f} MiB per write, {args.repeats} repeats, pid {os.getpid()}", flush=True)
    if gpu:
        rows = bench_gpu(nbytes, args.repeats, args.run_kb << 10)
    else:
        rows = [bench_memcpy(nbytes, args.repeats)]
        kinds = CPU_KINDS if args.transport == "cpu" else (args.transport,)
        for kind in kinds:
            rows.append(bench_cpu_transport(kind, nbytes, args.repeats, args.run_kb << 10, rows[0]["best_gbps"]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
