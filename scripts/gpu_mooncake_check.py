"""Register a CUDA tensor with Mooncake on both ends and write between them: the GPU check of the
``mooncake`` transport (its CUDA build), as one command.

Two processes on this host: a receiver registers a tensor on its GPU and publishes its
descriptor; a sender registers a tensor with a known pattern on its GPU (the same one, or
``--dst-gpu``), connects, writes it ``--iters`` times (one Mooncake batch each), and the receiver
checks every byte. The protocol is weightsync's choice (``MOONCAKE_PROTOCOL``, default ``auto``:
RDMA where a port is ACTIVE, else TCP). Everything has a deadline (``--timeout-s``); the
children are killed at the end whatever happened.

    python scripts/gpu_mooncake_check.py --out /tmp/mc.json            # on the GPU machine
    python scripts/gpu_mooncake_check.py --device cpu --out /tmp/mc.json   # the same on CPU memory

Writes ``{"ok", "device", "gpus", "mooncake", "protocol", "reason", "bytes", "iters",
"seconds", "gbps_median", "bytes_equal", "error"}`` as JSON to ``--out`` and prints one line.
Without CUDA (a CPU build of torch, or no GPU), ``--device cuda`` says ``no CUDA: <why>``, runs
the CPU-memory check instead and writes ``{"ok": false, "device": "cuda", "error": "no CUDA:
...", "cpu_fallback": {...}}`` (exit status 1: the GPU check did not run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _pattern(nbytes: int, device: str) -> Any:
    import torch

    return (torch.arange(nbytes, dtype=torch.int64, device=device) * 2654435761 >> 11).to(torch.uint8)


def _device(kind: str, gpu: int) -> str:
    return f"cuda:{gpu}" if kind == "cuda" else "cpu"


def _receiver(kind: str, gpu: int, nbytes: int, protocol: str, out: Any, done: Any) -> None:
    try:
        import torch

        from weightsync.transport.mooncake import MooncakeTransport

        if kind == "cuda":
            torch.cuda.set_device(gpu)
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=_device(kind, gpu))
        t = MooncakeTransport(protocol=protocol, hostname="127.0.0.1")
        t.register_tensor("dst", dst)
        out.put(("descriptor", t.descriptor().to_json(), t.protocol))
        if not done.wait(timeout=float(os.environ.get("CHECK_TIMEOUT_S", "300"))):
            out.put(("receiver", "the sender never said it finished", None))
            return
        if kind == "cuda":
            torch.cuda.synchronize()
        equal = bool(torch.equal(dst, _pattern(nbytes, _device(kind, gpu))))
        out.put(("checked", equal, None))
        t.close()
    except BaseException:  # reported to the parent, which writes the JSON
        out.put(("receiver", traceback.format_exc(limit=8), None))


def _sender(kind: str, gpu: int, nbytes: int, iters: int, protocol: str, desc: dict[str, Any], out: Any) -> None:
    try:
        import torch

        from weightsync.transport import PeerDescriptor, deadline_after
        from weightsync.transport.mooncake import MooncakeTransport, choose_protocol

        if kind == "cuda":
            torch.cuda.set_device(gpu)
        src = _pattern(nbytes, _device(kind, gpu))
        if kind == "cuda":
            torch.cuda.synchronize()
        t = MooncakeTransport(protocol=protocol, hostname="127.0.0.1")
        t.register_tensor("src", src)
        peer = t.connect(PeerDescriptor.from_json(desc))
        dst = PeerDescriptor.from_json(desc).region("dst").addr
        seconds = []
        for _ in range(iters):
            t0 = time.perf_counter()
            t.wait(t.write(peer, [(src.data_ptr(), dst, nbytes)]), deadline_after(120))
            seconds.append(time.perf_counter() - t0)
        out.put(("sent", seconds, list(choose_protocol(protocol))))
        t.close()
    except BaseException:
        out.put(("sender", traceback.format_exc(limit=8), None))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The check (module docstring); never raises, the JSON says what failed."""
    report: dict[str, Any] = {"ok": False, "device": args.device, "bytes": args.size_mb << 20, "iters": args.iters,
                              "host": platform.node(), "error": None}
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    nbytes = args.size_mb << 20
    procs = []
    try:
        import torch

        from weightsync.transport.mooncake import mooncake_build

        report["mooncake"] = mooncake_build()
        if args.device == "cuda":
            report["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        recv = ctx.Process(target=_receiver, args=(args.device, args.dst_gpu, nbytes, args.protocol, out, done))
        recv.start()
        procs.append(recv)
        what, value, protocol = out.get(timeout=args.timeout_s)
        if what != "descriptor":
            raise RuntimeError(f"{what}: {value}")
        report["receiver_protocol"] = protocol
        send = ctx.Process(target=_sender, args=(args.device, args.src_gpu, nbytes, args.iters, args.protocol,
                                                 value, out))
        send.start()
        procs.append(send)
        what, value, chosen = out.get(timeout=args.timeout_s)
        if what != "sent":
            raise RuntimeError(f"{what}: {value}")
        report["protocol"], report["reason"] = chosen
        report["seconds"] = value
        report["gbps_median"] = nbytes / statistics.median(value) / 1e9
        done.set()
        what, value, _ = out.get(timeout=args.timeout_s)
        if what != "checked":
            raise RuntimeError(f"{what}: {value}")
        report["bytes_equal"] = value
        report["ok"] = bool(value)
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where to write the JSON")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--src-gpu", type=int, default=0)
    p.add_argument("--dst-gpu", type=int, default=0)
    p.add_argument("--size-mb", type=int, default=256, help="MiB written per iteration")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--protocol", default=os.environ.get("MOONCAKE_PROTOCOL", "auto"), help="auto | tcp | rdma")
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each step")
    args = p.parse_args()
    os.environ["CHECK_TIMEOUT_S"] = str(args.timeout_s)
    no_cuda = _no_cuda() if args.device == "cuda" else None
    if no_cuda:
        # The GPU check cannot run: say so, and run the same check on CPU memory so the rest of
        # the path (Mooncake's build, the protocol choice, the write) is still exercised.
        print(f"no CUDA: {no_cuda}; the GPU check did not run, running the CPU-memory check instead", flush=True)
        args.device = "cpu"
        fallback = run(args)
        report = {"ok": False, "device": "cuda", "error": f"no CUDA: {no_cuda}", "cpu_fallback": fallback}
    else:
        report = fallback = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    rate = f"{fallback['gbps_median']:.2f} GB/s" if fallback.get("gbps_median") else "-"
    print(f"mooncake {fallback.get('mooncake')} {args.device} {fallback.get('protocol')}: {fallback['bytes'] >> 20} "
          f"MiB x {args.iters}, {rate}, bytes equal: {fallback.get('bytes_equal')}, ok: {fallback['ok']}"
          + (f", error: {fallback['error']}" if fallback["error"] else ""))
    if no_cuda:
        print(f"GPU check: NOT RUN (no CUDA: {no_cuda}); ok: False")
    return 0 if report["ok"] else 1


def _no_cuda() -> str | None:
    """Why CUDA cannot be used here, or None."""
    try:
        import torch
    except ImportError as exc:
        return f"torch does not import ({exc})"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return None


if __name__ == "__main__":
    sys.exit(main())
