"""What an update's verification costs: the fingerprint on the engine side, on the trainer side,
and the verify phase, each against a device copy of the same bytes measured in the same run.

One engine rank's parameters (a ParamStore on the device, filled as a complete update leaves it)
and one trainer rank holding the whole model (trainer layout, world 1), in one process:

* ``device_copy``: one copy of the engine rank's parameter block within the device (the rate the
  fingerprint is measured against; bytes counted once);
* ``engine_fingerprint``: the checker's ``fingerprint`` action (``WeightChecker.fingerprint``:
  every non-derived parameter in one batch, answers read back), and ``engine_batch`` the batch
  alone (one or two Triton launches on a GPU); ``engine_torch`` the torch fallback (a GPU without
  Triton) once;
* ``trainer_hash``: the trainer's partials of its whole plan share as p2p hashes them while it
  sends (direct runs from the parameters, transformed ones from packed staging, packing left out);
  ``trainer_hash_only``: broadcast's hash-only pass (packing included);
* ``verify_p2p`` / ``verify_broadcast``: the verify phase of an update without the HTTP round trip:
  (broadcast: the hash-only pass, then) the partials summed over the trainer group (gloo, one
  rank), the engine's fingerprint, the comparison;
* ``sweep`` (CUDA): the engine batch's GB/s over Triton block, warps and chunk sizes.

It also checks that the trainer's expected fingerprints equal the engine's (exit 1 otherwise).

Usage (CPU, tiny; the GPU run is the second line, one command)::

    python scripts/bench_verify.py --out verify_cpu.json
    python scripts/bench_verify.py --device cuda --scale full --out $OUT/verify_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.distributed as dist

from weightsync.engine.checker import WeightChecker
from weightsync.fingerprint import FingerprintBatch, to_hex, whole_tensors
from weightsync.fingerprint.batch import SPAN_FIELDS, default_method, triton_available
from weightsync.launch.bench.data import GlobalData, expected_store, fill_params
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.dtypes import torch_dtype
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.inputs import PlanInputs, build_inputs
from weightsync.plan.p2p import plan_p2p_for_rank
from weightsync.proc import free_port
from weightsync.sync.p2p_pack import DestParam, Packer, fp8_blocks
from weightsync.sync.params import ParamStore
from weightsync.sync.share_fingerprint import ShareFingerprint
from weightsync.sync.verify import Verifier

SEED = 12345


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Best wall seconds of ``fn`` over ``repeats`` (after one warm-up), device-synchronized."""
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def _row(nbytes: int, seconds: float, copy_s: float) -> dict[str, float]:
    return {"best_s": seconds, "gbps": nbytes / seconds / 1e9, "time_over_copy": seconds / copy_s}


def _sweep(store: ParamStore, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """The engine batch's rate over kernel shapes (CUDA with Triton only)."""
    names = [n for n, _ in store.items() if not store.meta[n].derived]
    tensors = [store[n] for n in names]
    spans = np.array([(i, 0, t.numel(), t.element_size(), 0, i) for i, t in enumerate(tensors)],
                     dtype=np.int64).reshape(-1, SPAN_FIELDS)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    rows = []
    for block in (512, 1024, 2048):
        for warps in (4, 8):
            for chunk in (16 << 10, 64 << 10, 256 << 10):
                batch = FingerprintBatch(tensors, spans, num_slots=len(tensors), method="kernel", chunk_bytes=chunk,
                                         block=block, num_warps=warps)
                s = _timed(lambda b=batch: b.run(out, SEED), device, repeats)
                rows.append({"block": block, "num_warps": warps, "chunk_bytes": chunk, "best_s": s,
                             "gbps": nbytes / s / 1e9})
                print(f"  sweep block={block:5d} warps={warps} chunk={chunk >> 10:4d} KiB  "
                      f"{nbytes / s / 1e9:8.1f} GB/s", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen3-4B")
    ap.add_argument("--scale", default="tiny")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-gb", type=float, default=1.0)
    ap.add_argument("--no-sweep", action="store_true", help="skip the kernel-shape sweep (CUDA)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the CPU paths are single-threaded (numpy); so is the copy they are measured against
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        return run(args, device)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> int:
    spec = get_model(args.model, args.scale)
    train, rollout = TrainParallel(world_size=1), RolloutParallel()
    inputs = build_inputs(spec, train, rollout, trainer_layout=trainer_layout, engine_layout=engine_layout)
    data = GlobalData(inputs.globals, seed=0, device=device)
    t0 = time.perf_counter()
    layout = list(engine_layout(spec, rollout, 0))
    store = expected_store(data, ParamStore(layout, device), spec)  # what a complete update leaves
    params = {t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype), device=device)
              for t in trainer_layout(spec, train, 0)}
    fill_params(data, trainer_layout(spec, train, 0), params)
    ops = list(plan_p2p_for_rank(inputs, src_rank=0).ops)
    nbytes = sum(t.numel() * t.element_size() for n, t in store.items() if not store.meta[n].derived)
    out: dict[str, Any] = {
        "model": args.model, "scale": args.scale,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
        "triton": triton_available(), "method": default_method(device), "bytes": nbytes, "tensors": len(layout),
        "ops": len(ops), "setup_s": time.perf_counter() - t0,
    }
    print(f"{args.model} {args.scale} on {out['device']}: {nbytes / 1e6:.2f} MB in {len(layout)} tensors, "
          f"{len(ops)} ops, fingerprint method {out['method']}", flush=True)
    copy_s = _copy_seconds(store, device, args.repeats)
    out["device_copy"] = {"best_s": copy_s, "gbps": store.nbytes / copy_s / 1e9}
    checker = WeightChecker(store)
    out.update(_engine(checker, store, nbytes, copy_s, device, args.repeats))
    verifier = Verifier(inputs, ops, params, rank=0, pg=dist.group.WORLD, bucket_bytes=int(args.bucket_gb * (1 << 30)))
    out.update(_trainer(verifier, checker, inputs, ops, params, layout, copy_s, device, args))
    if device.type == "cuda" and triton_available() and not args.no_sweep:
        out["sweep"] = _sweep(store, device, args.repeats)
    _print(out)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return 0 if out["expected_equals_engine"] else 1


def _copy_seconds(store: ParamStore, device: torch.device, repeats: int) -> float:
    """One copy of the store's parameter block into another on the same device (freed after)."""
    target = ParamStore(store.layout, device)
    return _timed(lambda: target.copy_from(store), device, repeats)


def _engine(checker: WeightChecker, store: ParamStore, nbytes: int, copy_s: float, device: torch.device,
            repeats: int) -> dict[str, Any]:
    """The engine side: the checker's action, its batch alone, the torch fallback (CUDA)."""
    out = {"engine_fingerprint": _row(nbytes, _timed(lambda: checker.fingerprint(SEED), device, repeats), copy_s)}
    names = [n for n, _ in store.items() if not store.meta[n].derived]
    batch = whole_tensors([store[n] for n in names])
    slots = torch.zeros(len(names), dtype=torch.int64, device=device)
    out["engine_batch"] = _row(nbytes, _timed(lambda: batch.run(slots, SEED), device, repeats), copy_s)
    if device.type == "cuda":
        slow = whole_tensors([store[n] for n in names], method="torch")
        out["engine_torch"] = _row(nbytes, _timed(lambda: slow.run(slots, SEED), device, 0), copy_s)
    return out


def _trainer(verifier: Verifier, checker: WeightChecker, inputs: PlanInputs, ops: list, params: dict,
             layout: list, copy_s: float, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """The trainer side (as p2p hashes while sending, and broadcast's hash-only pass) and the
    verify phases; checks that the expected fingerprints equal the engine's."""
    dests = {0: {t.name: DestParam(addr=0, shape=t.shape, dtype=torch_dtype(t.dtype)) for t in layout if not t.derived}}
    packer = Packer([op for op in ops if op.transform], params, dests, bucket_bytes=int(args.bucket_gb * (1 << 30)),
                    fp8_blocks=fp8_blocks(inputs))
    staging = torch.empty(packer.capacity, dtype=torch.uint8, device=device)
    packer.compile(lambda i: staging)
    share = ShareFingerprint(ops, params, dests, packer, verifier.slots, lambda i: staging)

    def hash_sent(p: torch.Tensor, *, pack: bool) -> None:
        share.hash_direct(p, SEED)
        for i in range(packer.num_buckets):
            if pack:
                packer.pack(i)
            share.hash_bucket(i, p, SEED)

    p2p = verifier.new_partials()
    hash_sent(p2p, pack=True)
    scratch = verifier.new_partials()
    out: dict[str, Any] = {
        # what send() adds to a p2p write: the hashing (the packing is the sender's anyway)
        "trainer_hash": _row(share.nbytes, _timed(lambda: hash_sent(scratch, pack=False), device, args.repeats),
                             copy_s),
        "trainer_hash_only": _row(share.nbytes, _timed(lambda: verifier.hash_share(scratch, SEED), device,
                                                       args.repeats), copy_s),
    }

    def verify(broadcast: bool) -> bool:
        partials = p2p
        if broadcast:  # p2p's partials were hashed during its write: its verify phase is the rest
            partials = verifier.new_partials()
            verifier.hash_share(partials, SEED)
        expected = verifier.expected(partials, SEED, same_for_every_engine=broadcast)
        engine = checker.fingerprint(SEED)["fingerprints"]
        assert expected is not None
        want = {n: to_hex(v) for n, v in expected[0].items()}
        return engine == want

    out["expected_equals_engine"] = verify(False) and verify(True)
    nbytes = share.nbytes
    out["verify_p2p"] = _row(nbytes, _timed(lambda: verify(False), device, args.repeats), copy_s)
    out["verify_broadcast"] = _row(nbytes, _timed(lambda: verify(True), device, args.repeats), copy_s)
    return out


def _print(out: dict[str, Any]) -> None:
    print(f"{'':20s} {'ms':>10s} {'GB/s':>9s} {'x copy time':>12s}")
    for key in ("device_copy", "engine_fingerprint", "engine_batch", "engine_torch", "trainer_hash",
                "trainer_hash_only", "verify_p2p", "verify_broadcast"):
        if key in out:
            r = out[key]
            ratio = f"{r['time_over_copy']:12.2f}" if "time_over_copy" in r else f"{'1.00':>12s}"
            print(f"{key:20s} {r['best_s'] * 1e3:10.2f} {r['gbps']:9.2f} {ratio}", flush=True)
    print(f"trainer's expected fingerprints equal the engine's: {out['expected_equals_engine']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
