"""Build, check and time the GPU fast paths in one process on one GPU (one device call).

Sections (each checked bit for bit before it is timed; each failure is recorded, the others go on):

* ``ceiling``  -- a same-GPU ``copy_`` of 4 GiB: the HBM copy rate (bytes counted once);
* ``copy``     -- the p2p sender's direct write of Qwen3-4B (full) and Qwen3-30B-A3B (``--a3b-layers``)
  from a trainer layout to an engine layout on the same GPU (local transport: the same
  :class:`~weightsync.sync.p2p_sender.P2PSender` and device copier as cuda_ipc, without the IPC
  mapping), once per copy method (:data:`~weightsync.transport.cuda_batch.COPY_METHODS`), beside
  one ``cudaMemcpyAsync`` of the same bytes; then a sweep of the copy kernel's chunk and warps;
* ``fp8``      -- Kimi-K2 (``--kimi-layers``) with fp8 [64, 64] blocks: the sender's packing, fused
  (one Triton launch per bucket) against the per-op reference, and a sweep of the fused kernel's
  column group and warps on the first bucket;
* ``mla``      -- the post-load derivation of ``w_kc``/``w_vc``: Kimi-K2's layers after the update,
  and 61 full-size layers (kv_b_proj [16384, 512] fp8), batched kernel against the per-layer loop.

Prints a short table last; ``--out`` gets the full JSON.

Typical usage (on the GPU machine)::

    python scripts/bench_gpu.py --out $OUT/bench_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightsync.launch.bench.data import GlobalData, compare, expected_store, fill_params
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.parallel import Device, RolloutParallel, TrainParallel
from weightsync.plan.inputs import build_inputs
from weightsync.plan.p2p import plan_p2p_for_rank
from weightsync.sync.params import ParamStore

DEV = torch.device("cuda", 0)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Host wall seconds of ``fn`` (device-synchronized before and after) per repeat."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def event_ms(fn: Callable[[], Any], repeats: int = 10) -> float:
    """Median device milliseconds of ``fn`` between two CUDA events."""
    fn()
    sync()
    if DEV.type != "cuda":  # the CPU smoke run (--smoke)
        return 1e3 * min(timed(fn, repeats, warmup=0))
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def ceiling() -> dict[str, Any]:
    n = 4 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = event_ms(lambda: dst.copy_(src))
    src = dst = None
    torch.cuda.empty_cache()
    return {"bytes": n, "ms": ms, "gbps": n / ms / 1e6}


class Case:
    """One model on one GPU: trainer params, engine params on a local transport, expected values."""

    def __init__(self, model: str, scale: str, seed: int = 5) -> None:
        self.spec = get_model(model, scale)
        one = [Device(0, 0)]
        self.inputs = build_inputs(self.spec, TrainParallel(tp=1, pp=1, cp=1, ep=1, etp=1, world_size=1),
                                   RolloutParallel(tp=1, ep=1, dp=1, num_engines=1), trainer_layout=trainer_layout,
                                   engine_layout=engine_layout, placement=(one, one))
        self.data = GlobalData(self.inputs.globals, seed=seed, device=DEV)
        layout = list(self.inputs.source_layouts[0])
        self.source = torch.empty(ParamStore.required_bytes(layout), dtype=torch.uint8, device=DEV)

        class _Block:
            def __init__(self, buf: torch.Tensor) -> None:
                self.buf = buf

            def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
                return self.buf

        self.trainer = ParamStore(layout, DEV, arena=_Block(self.source))
        fill_params(self.data, layout, dict(self.trainer.items()))
        self.engine_layout = list(self.inputs.dest_layout(0))
        self.engine = ParamStore(self.engine_layout, DEV)
        self.expected = expected_store(self.data, self.engine, self.spec)
        self.ops = list(plan_p2p_for_rank(self.inputs, src_rank=0).ops)
        sync()

    def sender(self, method: str, bucket_bytes: int = 1 << 30) -> Any:
        from weightsync.sync.p2p_sender import P2PSender, dest_rank_from_info
        from weightsync.transport import HOST, make_transport

        os.environ["WEIGHTSYNC_DEVICE_COPY"] = method
        dev = 0 if DEV.type == "cuda" else HOST
        rx = make_transport("local", device=dev)
        buf = self.engine._buf  # the engine's one block
        rx.register("params", buf.data_ptr(), buf.numel(), device=dev)
        info = {"descriptor": rx.descriptor().to_json(), "weights": self.engine.transfer_info()}
        dests = {0: dest_rank_from_info(0, info, self.engine_layout)}
        blocks = {g.name: g.block for g in self.inputs.globals.values() if g.block is not None and g.quant_of is None}
        tx = make_transport("local", device=dev)
        s = P2PSender(self.ops, dict(self.trainer.items()), tx, dests, bucket_bytes=bucket_bytes,
                      source_regions=[("params", self.source)], fp8_blocks=blocks)
        s._rx = rx  # kept alive with the sender
        return s

    def poison(self) -> None:
        from weightsync.launch.bench.data import poison

        for _, t in self.engine.items():
            t.zero_()
        poison(self.engine)
        sync()

    def check(self) -> list[str]:
        return compare(self.engine, self.expected)

    def close(self) -> None:
        for x in ("trainer", "engine", "expected", "source"):
            setattr(self, x, None)
        torch.cuda.empty_cache()


def run_sender(case: Case, sender: Any, repeats: int) -> dict[str, Any]:
    case.poison()
    stats = [sender.send(deadline_s=120.0)]
    sync()
    bad = case.check()
    rows = []
    for _ in range(repeats):
        case.poison()
        t0 = time.perf_counter()
        st = sender.send(deadline_s=120.0)
        sync()
        rows.append({"total_s": time.perf_counter() - t0, "pack_s": st.pack_s})
    return {"first_s": stats[0].total_s, "best_s": min(r["total_s"] for r in rows),
            "median_s": statistics.median(r["total_s"] for r in rows),
            "best_pack_s": min(r["pack_s"] for r in rows), "bytes": stats[0].nbytes,
            "bytes_staged": stats[0].bytes_staged, "mismatched": bad[:10], "bit_exact": not bad}


def copy_section(model: str, scale: str, repeats: int) -> dict[str, Any]:
    from weightsync.transport.cuda_batch import COPY_METHODS, KernelBatch, block_runs

    case = Case(model, scale)
    out: dict[str, Any] = {"model": model, "scale": scale, "ops": len(case.ops)}
    total = sum(t.numel() * t.element_size() for _, t in case.engine.items())
    src = torch.randint(0, 255, (min(total, 8 << 30),), dtype=torch.uint8, device=DEV)  # never time zeros
    dst = torch.empty_like(src)
    out["one_copy"] = {"bytes": src.numel(), "ms": event_ms(lambda: dst.copy_(src))}
    out["one_copy"]["gbps"] = src.numel() / out["one_copy"]["ms"] / 1e6
    src = dst = None
    torch.cuda.empty_cache()
    for method in COPY_METHODS:
        try:
            s = case.sender(method)
            batch = next(iter(s._direct.values()))
            out.setdefault("num_runs", len(batch.runs))
            out.setdefault("blocks", len(batch.blocks))
            nbytes = batch.nbytes
            r = run_sender(case, s, repeats)
            r["gbps"] = r["bytes"] / r["best_s"] / 1e9
            out[method] = r
            if method == "kernel":  # sweep on the same runs
                runs = block_runs(batch.blocks)
                sweep = []
                for chunk, block, warps in ((16 << 10, 4096, 4), (64 << 10, 4096, 4), (64 << 10, 8192, 8),
                                            (256 << 10, 8192, 8), (256 << 10, 16384, 8), (1 << 20, 16384, 8)):
                    kb = KernelBatch(runs, DEV, chunk=chunk, block=block, num_warps=warps)
                    ms = event_ms(kb.launch)
                    sweep.append({"chunk": chunk, "block": block, "warps": warps, "ms": ms,
                                  "gbps": nbytes / ms / 1e6})
                out["kernel_sweep"] = sweep
            s.close()
        except Exception:  # recorded, the other methods still run
            out[method] = {"error": traceback.format_exc()[-2000:]}
    case.close()
    return out


def fp8_section(scale: str, repeats: int) -> dict[str, Any]:
    from weightsync.quant.fp8_fused import FusedQuant

    case = Case("Kimi-K2", scale)
    out: dict[str, Any] = {"model": "Kimi-K2", "scale": scale, "ops": len(case.ops),
                           "staged_ops": sum(1 for o in case.ops if o.transform)}
    s = case.sender("kernel")
    out["buckets"] = s.num_buckets
    src_bytes = sum(f.src_bytes for fused, _ in s._packs for f in fused)
    out_bytes = sum(f.out_bytes for fused, _ in s._packs for f in fused)
    out["fused_src_bytes"], out["fused_out_bytes"] = src_bytes, out_bytes
    r = run_sender(case, s, repeats)
    r["pack_gbps_src"] = src_bytes / r["best_pack_s"] / 1e9 if r["best_pack_s"] else None
    out["fused"] = r
    # kernel-only time of every bucket's packing (device events), and a sweep on bucket 0
    out["fused_kernel_ms"] = sum(event_ms(lambda f=f: f.run(), 3) for fused, _ in s._packs for f in fused)
    out["fused_kernel_gbps_src"] = src_bytes / out["fused_kernel_ms"] / 1e6
    tasks = s._packs[0][0][0].tasks
    block = s._packs[0][0][0].block
    b0_src = sum(t.src.numel() * t.src.element_size() for t in tasks)
    sweep = []
    for group in (1, 2, 4):
        for warps in (4, 8):
            f = FusedQuant(tasks, block, group=group, num_warps=warps)
            ms = event_ms(f.run)
            sweep.append({"group": group, "warps": warps, "ms": ms, "gbps_src": b0_src / ms / 1e6})
    out["fused_sweep"] = sweep
    # the per-op reference packing of the same buckets
    s._packs = [([], list(b)) for b in s._buckets]
    out["reference"] = run_sender(case, s, max(2, repeats // 2))
    out["reference"]["pack_gbps_src"] = src_bytes / out["reference"]["best_pack_s"] / 1e9
    s.close()
    out["mla_update"] = mla_on_store(case)
    case.close()
    return out


def mla_on_store(case: Case) -> dict[str, Any]:
    """Post-load on the updated engine (batched) against the reference on the expected store."""
    from weightsync.engine.loader import run_post_load
    from weightsync.launch.bench.data import compare_derived, reference_derived

    reference_derived(case.expected, case.spec)
    first = run_post_load(case.engine, case.spec)
    bad = compare_derived(case.engine, case.expected)
    runs = [run_post_load(case.engine, case.spec) for _ in range(5)]
    return {"layers": len([n for n in case.engine.derived_names() if n.endswith("w_kc")]), "first_s": first,
            "best_s": min(runs), "bit_exact": not bad, "mismatched": bad}


def mla_section(num_layers: int = 61) -> dict[str, Any]:
    from weightsync.quant.fp8 import quantize_block_fp8
    from weightsync.quant.mla import MlaLayer, derive_all

    heads, nope, v, rank, block = 64, 128, 128, 512, (64, 64)
    layers, refs = [], []
    for i in range(num_layers):
        g = torch.Generator(device=DEV).manual_seed(100 + i)
        w = torch.randn(heads * (nope + v), rank, generator=g, device=DEV)
        q, s = quantize_block_fp8(w, block)
        kc = torch.empty(heads, nope, rank, dtype=torch.bfloat16, device=DEV)
        vc = torch.empty(heads, rank, v, dtype=torch.bfloat16, device=DEV)
        layers.append(MlaLayer(kv_b=q, w_kc=kc, w_vc=vc, scale_inv=s))
        refs.append(MlaLayer(kv_b=q, w_kc=torch.empty_like(kc), w_vc=torch.empty_like(vc), scale_inv=s))

    def batched() -> None:
        derive_all(layers, qk_nope_head_dim=nope, v_head_dim=v, block=block, use_kernel=DEV.type == "cuda")

    def loop() -> None:
        derive_all(refs, qk_nope_head_dim=nope, v_head_dim=v, block=block, use_kernel=False)

    tb = timed(batched, 5)
    tr = timed(loop, 3)
    exact = all(torch.equal(a.w_kc.view(torch.int16), b.w_kc.view(torch.int16))
                and torch.equal(a.w_vc.view(torch.int16), b.w_vc.view(torch.int16)) for a, b in zip(layers, refs))
    moved = num_layers * (q.numel() + s.numel() * 4 + 2 * 2 * heads * nope * rank)
    return {"layers": num_layers, "batched_best_s": min(tb), "loop_best_s": min(tr), "bit_exact": exact,
            "bytes_moved": moved, "batched_gbps": moved / min(tb) / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--a3b-layers", type=int, default=24)
    ap.add_argument("--kimi-layers", type=int, default=2)
    ap.add_argument("--only", default="ceiling,copy,fp8,mla")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models: checks the script itself")
    args = ap.parse_args()
    global DEV
    if args.smoke:
        DEV = torch.device("cpu")
    want = set(args.only.split(","))
    name = torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu"
    res: dict[str, Any] = {"device": name, "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None

    def section(name: str, fn: Callable[[], Any]) -> None:
        if name.split(":")[0] not in want:
            return
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception:
            res[name] = {"error": traceback.format_exc()[-3000:]}
        res.setdefault("section_s", {})[name] = time.perf_counter() - t0
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1, default=str))
        print(f"[bench_gpu] {name} done in {time.perf_counter() - t0:.1f} s", flush=True)

    section("ceiling", ceiling)
    small = "tiny" if args.smoke else None
    section("copy:Qwen3-4B", lambda: copy_section("Qwen3-4B", small or "full", args.repeats))
    section("copy:Qwen3-30B-A3B",
            lambda: copy_section("Qwen3-30B-A3B", small or f"layers={args.a3b_layers}", args.repeats))
    section("fp8", lambda: fp8_section(small or f"layers={args.kimi_layers}", args.repeats))
    section("mla", lambda: mla_section(4 if args.smoke else 61))
    print(summary(res))
    return 0


def summary(res: dict[str, Any]) -> str:
    lines = [f"device {res['device']}, torch {res['torch']}, triton {res['triton']}"]
    c = res.get("ceiling", {})
    if "gbps" in c:
        lines.append(f"same-GPU copy_ 4 GiB: {c['ms']:.3f} ms, {c['gbps']:.0f} GB/s")
    for key in ("copy:Qwen3-4B", "copy:Qwen3-30B-A3B"):
        r = res.get(key)
        if not r:
            continue
        if "error" in r:
            lines.append(f"{key}: ERROR {r['error'][-300:]}")
            continue
        oc = r.get("one_copy", {})
        lines.append(f"{key} ({r.get('ops')} ops, {r.get('num_runs')} runs, {r.get('blocks')} blocks); one copy "
                     f"{oc.get('gbps', 0):.0f} GB/s")
        for m in ("runs", "memcpy_batch", "kernel"):
            x = r.get(m, {})
            if "error" in x:
                lines.append(f"  {m:<13} ERROR {x['error'][-400:]}")
            elif x:
                lines.append(f"  {m:<13} best {x['best_s'] * 1e3:8.2f} ms  median {x['median_s'] * 1e3:8.2f} ms  "
                             f"{x['gbps']:7.0f} GB/s  ratio {x['gbps'] / (oc.get('gbps') or 1):.2f}  "
                             f"{'bit-exact' if x['bit_exact'] else 'MISMATCH'}")
        for sw in r.get("kernel_sweep", []):
            lines.append(f"    kernel chunk {sw['chunk'] >> 10:5d} KiB block {sw['block']:5d} warps {sw['warps']}: "
                         f"{sw['ms']:.2f} ms {sw['gbps']:.0f} GB/s")
    f = res.get("fp8")
    if f and "error" in f:
        lines.append(f"fp8: ERROR {f['error'][-800:]}")
    elif f:
        lines.append(f"fp8 Kimi-K2 {f['scale']}: {f['staged_ops']} staged ops, {f['buckets']} buckets, "
                     f"{f['fused_src_bytes'] / 1e9:.1f} GB bf16 -> {f['fused_out_bytes'] / 1e9:.1f} GB fp8+scales")
        for k in ("fused", "reference"):
            x = f[k]
            ok = "bit-exact" if x["bit_exact"] else "MISMATCH"
            lines.append(f"  {k:<9} update best {x['best_s'] * 1e3:8.1f} ms  pack {x['best_pack_s'] * 1e3:8.1f} ms "
                         f"({x['pack_gbps_src'] or 0:.0f} GB/s of bf16)  {ok}")
        lines.append(f"  fused kernels alone: {f['fused_kernel_ms']:.1f} ms, {f['fused_kernel_gbps_src']:.0f} GB/s")
        for sw in f.get("fused_sweep", []):
            lines.append(f"    group {sw['group']} warps {sw['warps']}: {sw['ms']:.2f} ms {sw['gbps_src']:.0f} GB/s")
        m = f.get("mla_update", {})
        lines.append(f"  post-load ({m.get('layers')} MLA layers): best {m.get('best_s', 0) * 1e3:.3f} ms "
                     f"{'bit-exact' if m.get('bit_exact') else 'MISMATCH'}")
    m = res.get("mla")
    if m and "error" in m:
        lines.append(f"mla: ERROR {m['error'][-500:]}")
    elif m:
        lines.append(f"mla {m['layers']} full-size layers: batched {m['batched_best_s'] * 1e3:.2f} ms "
                     f"({m['batched_gbps']:.0f} GB/s), per-layer loop {m['loop_best_s'] * 1e3:.2f} ms, "
                     f"{'bit-exact' if m['bit_exact'] else 'MISMATCH'}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
