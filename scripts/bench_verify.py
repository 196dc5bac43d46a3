"""Where an update's verification spends its time: the checksum of one engine rank's parameters.

The update is published only after every engine parameter's checksum (xxh64 of its raw bytes, as
sglang's ``/weights_checker`` ``checksum`` reports it) matches the trainer's expectation, and the
engines stay paused meanwhile. This measures, on one engine rank's parameters (one ParamStore on
the device, random contents), in one process:

* ``checker``: the engine's own ``WeightChecker.checksum`` (each parameter copied to host memory,
  then hashed);
* ``d2h_pageable`` / ``d2h_pinned``: the device-to-host copy alone, into fresh pageable memory per
  tensor (what ``.to("cpu")`` does) and into one reused pinned buffer;
* ``xxh64_host``: hashing host copies that already exist;
* ``trainer_expected``: the trainer side's expectation as ``weightsync/sync/verify.py`` builds it
  (full tensors on the device laid out into a host copy of the engine rank's parameters by
  ``write_global``, then hashed);
* ``device_copy``: the same bytes copied within the device (the rate a device-side hash could
  approach).

Usage::

    python scripts/bench_verify.py --model Qwen3-4B --scale layers=2 [--device cuda] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import xxhash

from weightsync.engine.checker import WeightChecker
from weightsync.layout.box import box_slices
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import RolloutParallel
from weightsync.sync.params import ParamStore, write_global


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen3-4B")
    ap.add_argument("--scale", default="layers=2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    spec = get_model(args.model, args.scale)
    store = ParamStore(engine_layout(spec, RolloutParallel(), 0), device)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = dict(store.items())
    for t in tensors.values():
        if t.is_floating_point() and t.element_size() >= 2:
            t.normal_(generator=gen)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    checker = WeightChecker(store)
    host = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in tensors.items()}
    pin = torch.empty(max(t.numel() * t.element_size() for t in tensors.values()), dtype=torch.uint8,
                      pin_memory=device.type == "cuda")
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def d2h_pageable() -> None:
        for t in tensors.values():
            t.to("cpu")

    def d2h_pinned() -> None:
        for t in tensors.values():
            b = t.reshape(-1).view(torch.uint8)
            pin[: b.numel()].copy_(b)

    def xxh64_host() -> None:
        for t in host.values():
            xxhash.xxh64(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()

    def device_copy() -> None:
        off = 0
        for t in tensors.values():
            b = t.reshape(-1).view(torch.uint8)
            scratch[off: off + b.numel()].copy_(b)
            off += b.numel()

    for n, t in tensors.items():
        host[n].copy_(t)
    full = {n: torch.randn(g.shape, generator=gen, device=device).to(torch.bfloat16)
            for n, g in global_tensors(spec).items() if g.quant_of is None and store.pieces_of(n)}
    host_store = ParamStore(engine_layout(spec, RolloutParallel(), 0), torch.device("cpu"), pin=True)  # as verify.py

    def trainer_expected() -> None:
        for name, t in full.items():
            write_global(host_store, spec, name, lambda box, t=t: t[box_slices(box)])
        for _, t in host_store.items():
            xxhash.xxh64(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    out: dict[str, object] = {"model": args.model, "scale": args.scale, "device": str(device),
                              "tensors": len(tensors), "bytes": nbytes}
    for name, fn in (("checker", checker.checksum), ("d2h_pageable", d2h_pageable), ("d2h_pinned", d2h_pinned),
                     ("xxh64_host", xxh64_host), ("trainer_expected", trainer_expected),
                     ("device_copy", device_copy)):
        s = _timed(fn, device, args.repeats)
        out[name] = {"best_s": s, "gbps": nbytes / s / 1e9}
        print(f"{name:16s} {s * 1e3:10.1f} ms  {nbytes / s / 1e9:8.2f} GB/s", flush=True)
    got = checker.checksum()["checksums"]
    want = {n: xxhash.xxh64(t.reshape(-1).view(torch.uint8).numpy()).hexdigest() for n, t in host.items()}
    out["checker_digests_equal_host"] = got == want
    print(f"checker digests equal the host copies' one-shot xxh64: {got == want}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if got == want else 1


if __name__ == "__main__":
    sys.exit(main())
