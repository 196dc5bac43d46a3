"""``weightsync bench MODEL``: the transfer benchmark -- link rate, p2p update, broadcast update.

In one run, on one machine, with the same model and the same processes:

* **link**: a plain copy of the update's bytes -- inside one process (CPU ``memmove``; CUDA
  GPU-to-GPU peer copy and same-GPU copy), and between the benchmark's own processes: each
  trainer rank writes the bytes it sends in p2p as one run per destination, through the same
  transport into the same engine arenas (the figure p2p's wire rate is compared with);
* **p2p**: trainer ranks holding Megatron-layout shards of random global tensors write with
  :class:`~weightsync.sync.p2p_sender.P2PSender` into engine ranks holding sglang-layout
  parameters in one registered arena (``shm`` on CPU, ``cuda_ipc`` on GPU);
* **broadcast**: the same model through the baseline path (stage sources gather and broadcast
  bucket by bucket; engine ranks keep their pieces).

Every update is timed between barriers of all processes, after one warm-up run, ``--repeats``
times; afterwards every engine rank compares its parameters bit for bit with the expected
slicing of the global tensors. Prints a table and one ``BENCH_JSON {...}`` line; ``--out``
writes the JSON to a file.

Typical usage::

    weightsync bench Qwen3-4B --scale layers=2 --train tp=2 --rollout tp=2 --device cpu
    weightsync bench Qwen3-30B-A3B --scale layers=16 --train tp=1 --rollout tp=1 --device cuda \\
        --out $OUT/bench.json
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import queue
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from weightsync.launch.config import RunMode
from weightsync.models.fit import profile_sizes
from weightsync.plan.records import Mode
from weightsync.proc import free_port

log = logging.getLogger(__name__)


def gpu_placement(
    num_train: int, num_rollout: int, placement: str, num_gpus: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """GPU of each trainer and rollout rank.

    Raises:
        ValueError: the machine has too few GPUs for the placement.
    """
    if placement == "split":
        need = num_train + num_rollout
        if need > num_gpus:
            raise ValueError(
                f"split placement needs {need} GPUs ({num_train} trainer + {num_rollout} rollout "
                f"ranks), this machine has {num_gpus}: lower tp or use --placement colocated"
            )
        return tuple(range(num_train)), tuple(range(num_train, need))
    need = max(num_train, num_rollout)
    if need > num_gpus:
        raise ValueError(f"colocated placement needs {need} GPUs, this machine has {num_gpus}")
    return tuple(range(num_train)), tuple(range(num_rollout))


def broadcast_skip_reason(
    device: str, train_gpus: tuple[int, ...], rollout_gpus: tuple[int, ...], sources: list[int]
) -> str | None:
    """Why broadcast cannot run with this placement (NCCL refuses two ranks of a group on one GPU)."""
    if device != "cuda":
        return None
    for s in sources:
        members = [train_gpus[s], *rollout_gpus]
        if len(set(members)) != len(members):
            return (
                f"NCCL needs every rank of a weight-update group on its own GPU; source rank {s} and the "
                f"rollout ranks use GPUs {members} (use --placement split)"
            )
    return None


def build_config(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """The :class:`BenchConfig` of the command line, and notes about what was changed or skipped."""
    from weightsync.launch.bench_worker import BenchConfig, bench_placement
    from weightsync.layout.megatron import trainer_layout
    from weightsync.layout.sglang import engine_layout
    from weightsync.models import get_model
    from weightsync.plan.broadcast import bucket_bytes_from_gb, plan_broadcast
    from weightsync.plan.inputs import build_inputs
    from weightsync.transport import TransportConfig

    train, rollout = profile_sizes(args.model, args.train, args.rollout)
    spec = get_model(args.model, args.scale)
    modes = RunMode.parse(args.mode).modes
    notes: list[str] = []
    train_gpus: tuple[int, ...] = ()
    rollout_gpus: tuple[int, ...] = ()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible")
        train_gpus, rollout_gpus = gpu_placement(
            train.world_size, rollout.world_size, args.placement, torch.cuda.device_count()
        )
    bucket_bytes = bucket_bytes_from_gb(args.bucket_gb, what="--bucket-gb")
    inputs = build_inputs(spec, train, rollout, trainer_layout=trainer_layout, engine_layout=engine_layout)
    sources = sorted({b.src_rank for b in plan_broadcast(inputs, bucket_bytes=bucket_bytes, dst_rank=0).buckets})
    if Mode.BROADCAST in modes:
        why = broadcast_skip_reason(args.device, train_gpus, rollout_gpus, sources)
        if why is not None:
            notes.append("broadcast skipped: " + why)
            modes = tuple(m for m in modes if m is not Mode.BROADCAST)
            from weightsync.launch.bench_colocated import TENSOR_MODE, tensor_skip_reason

            why_not = tensor_skip_reason(args.device, train.world_size, rollout.world_size)
            if why_not is None:
                notes.append("the colocated baseline (update_weights_from_tensor over CUDA IPC) runs instead")
                modes = (*modes, TENSOR_MODE)
            else:
                notes.append("colocated baseline skipped: " + why_not)
    trainers, engines = bench_placement(args.device, train, rollout, train_gpus, rollout_gpus)
    transport = TransportConfig.resolve(
        args.transport, [(a, b) for a in trainers for b in engines], on_gpu=args.device == "cuda"
    )
    cfg = BenchConfig(
        model=args.model,
        scale=args.scale,
        train=train,
        rollout=rollout,
        device=args.device,
        modes=modes,
        repeats=args.repeats,
        bucket_bytes=bucket_bytes,
        seed=args.seed,
        master_port=free_port(),
        group_ports={s: free_port() for s in sources},
        train_gpus=train_gpus,
        rollout_gpus=rollout_gpus,
        transport=transport,
        threads=args.threads,
        timeout_s=args.timeout,
    )
    return cfg, notes


def run_processes(cfg: Any) -> list[dict[str, Any]]:
    """Spawn one process per trainer and rollout rank, collect their results (rank order).

    SIGTERM (e.g. from ``timeout``) stops the children too; they also die with this process.

    Raises:
        RuntimeError: a process failed (its traceback is in the message) or the benchmark ran past
            its timeout; every process is stopped first.
    """
    import torch.multiprocessing as mp

    from weightsync.launch.bench_worker import GPU_ENV, host_copy_env, rank_main

    os.environ.update({**GPU_ENV, **host_copy_env(os.environ)})  # spawned children inherit it
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, cfg, results), daemon=True) for r in range(cfg.world_size)]
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for p in procs:
            p.start()
        got, errors = _collect(procs, results, cfg.timeout_s + 30)
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise RuntimeError(f"benchmark ranks {sorted(errors)} failed:\n{text}")
        if len(got) < len(procs):
            raise RuntimeError(f"benchmark did not finish in {cfg.timeout_s + 30:.0f} s")
        for p in procs:
            p.join(timeout=60)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=10)
    return [got[r] for r in range(len(procs))]


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _collect(procs: list[Any], results: Any, timeout_s: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Results and errors by rank, until every process answered, one died, or ``timeout_s``.

    After the first error the others get 5 s to report theirs (they usually fail in turn, a peer
    having closed its connections), so that the first cause is in the message.
    """
    got: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got and i not in errors]
            if dead:
                errors[dead[0]] = f"exited with code {procs[dead[0]].exitcode} without a result"
                deadline = min(deadline, time.monotonic() + 5.0)
            continue
        if status == "ok":
            got[rank] = payload
        else:
            errors[rank] = payload
            deadline = min(deadline, time.monotonic() + 5.0)
    return got, errors


def _gbps(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 else None


def _runs_of(rank: dict[str, Any], key: str) -> list[dict[str, Any]]:
    part = rank[key]
    return part["runs"] if isinstance(part, dict) else part


def _timed_runs(ranks: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Per run (warm-up first): the slowest process's window, and the wire and pack times of the
    trainer rank with the longest wire time (p2p: the slowest sender; broadcast: the source)."""
    out = []
    for i in range(len(_runs_of(ranks[0], key))):
        rows = [_runs_of(r, key)[i] for r in ranks]
        trainers = [row for row, r in zip(rows, ranks, strict=True) if r["role"] == "trainer"]
        slowest = max(trainers, key=lambda row: row.get("wire_s", row.get("own_s", 0.0)), default={})
        out.append(
            {
                "window_s": max(row["window_s"] for row in rows),
                "warmup": rows[0]["warmup"],
                "wire_s": slowest.get("wire_s", slowest.get("own_s", 0.0)),
                "pack_s": slowest.get("pack_s", 0.0),
            }
        )
    return out


def _stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    timed = [r for r in runs if not r["warmup"]] or runs
    first = runs[0]["window_s"]
    best = min(r["window_s"] for r in timed)
    return {
        "first_s": first,
        "best_s": best,
        "mean_s": sum(r["window_s"] for r in timed) / len(timed),
        "best_wire_s": min(r["wire_s"] for r in timed),
        "median_wire_s": statistics.median(r["wire_s"] for r in timed),
        "best_pack_s": min(r["pack_s"] for r in timed),
        "runs_s": [r["window_s"] for r in timed],
    }


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def git_commit() -> str | None:
    """The checkout's commit (with ``+dirty`` when tracked files changed), or None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = _git(root, "rev-parse", "--short", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _local_copy(lc: dict[str, Any] | None) -> dict[str, Any]:
    if not lc:
        return {}
    out: dict[str, Any] = {"bytes": lc["bytes"]}
    for key in ("memmove_s", "same_gpu_s", "peer_gpu_s"):
        if key in lc:
            out[key] = lc[key]
            out[key.removesuffix("_s") + "_gbps"] = _gbps(lc["bytes"], lc[key])
    if "peer_gpu" in lc:
        out["peer_gpu"] = lc["peer_gpu"]
    return out


def _checks(engines: list[dict[str, Any]], key: str) -> dict[str, Any]:
    checks = [e[key]["check"] for e in engines]
    return {
        "ok": all(c["mismatched"] == 0 for c in checks),
        "params_checked": sum(c["params"] for c in checks),
        "mismatched": {
            str(e["local_rank"]): c["names"] for e, c in zip(engines, checks, strict=True) if c["mismatched"]
        },
    }


def _p2p_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    trainers = [r for r in results if r["role"] == "trainer"]
    engines = [r for r in results if r["role"] == "engine"]
    st = _stats(_timed_runs(results, "p2p"))
    by_dest: dict[int, int] = {}
    for t in trainers:
        for d, n in t["p2p"]["runs"][-1]["bytes_by_dest"].items():
            by_dest[int(d)] = by_dest.get(int(d), 0) + n
    total = sum(by_dest.values())
    mem = _stats(_timed_runs(results, "memcpy"))
    mem_bytes = sum(t["memcpy"][-1]["bytes"] for t in trainers)
    memcpy = {
        **mem,
        "bytes": mem_bytes,
        "gbps": _gbps(mem_bytes, mem["best_wire_s"]),
        "window_gbps": _gbps(mem_bytes, mem["best_s"]),
    }
    p2p = {
        **st,
        "bytes_total": total,
        "bytes_per_receiver": {str(d): n for d, n in sorted(by_dest.items())},
        "shard_bytes": {str(e["local_rank"]): e["shard_bytes"] for e in engines},
        "gbps": _gbps(total, st["best_s"]),
        "wire_gbps": _gbps(total, st["best_wire_s"]),
        "ops": sum(t["ops"] for t in trainers),
        "staged_ops": sum(t["staged_ops"] for t in trainers),
        "plan_s": max(t["plan_s"] for t in trainers),
        "sender_setup_s": max(t["sender_s"] for t in trainers),
        "check": _checks(engines, "p2p"),
    }
    return {"memcpy": memcpy, "p2p": p2p}


def _broadcast_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    engines = [r for r in results if r["role"] == "engine"]
    st = _stats(_timed_runs(results, "broadcast"))
    per_rx = {str(e["local_rank"]): int(e["broadcast"]["runs"][-1]["bytes"]) for e in engines}
    total = sum(per_rx.values())
    return {
        **st,
        "bytes_total": total,
        "bytes_per_receiver": per_rx,
        "gbps": _gbps(total, st["best_s"]),
        "buckets": engines[0]["broadcast"]["buckets"],
        "check": _checks(engines, "broadcast"),
    }


def _post_load_summary(results: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """The post-load phase after each ``key`` update: the slowest engine's own seconds per run."""
    engines = [r for r in results if r["role"] == "engine"]
    if not engines or not engines[0][key].get("post_load"):
        return None
    runs = range(len(engines[0][key]["post_load"]))
    per_run = [max(e[key]["post_load"][i]["own_s"] for e in engines) for i in runs]
    timed = per_run[1:] or per_run
    return {"first_s": per_run[0], "best_s": min(timed), "median_s": statistics.median(timed), "runs_s": timed}


def _tensor_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    engines = [r for r in results if r["role"] == "engine"]
    trainers = [r for r in results if r["role"] == "trainer"]
    st = _stats(_timed_runs(results, "tensor"))
    timed = [i for i, r in enumerate(trainers[0]["tensor"]["runs"]) if not r["warmup"]]
    part = engines[0]["tensor"]
    return {
        **st,
        "bytes_total": part["bytes"],
        "gbps": _gbps(part["bytes"], st["best_s"]),
        "buckets": part["buckets"],
        "tensors": part["tensors"],
        "best_fill_s": min(trainers[0]["tensor"]["runs"][i]["fill_s"] for i in timed),
        "best_load_s": min(engines[0]["tensor"]["runs"][i]["load_s"] for i in timed),
        "check": _checks(engines, "tensor"),
    }


def summarize(cfg: Any, results: list[dict[str, Any]], notes: list[str]) -> dict[str, Any]:
    """The benchmark's JSON record from every process's result."""
    from dataclasses import asdict

    out: dict[str, Any] = {
        "model": cfg.model,
        "scale": cfg.scale,
        "train": asdict(cfg.train),
        "rollout": asdict(cfg.rollout),
        "device": cfg.device,
        "transport": cfg.transport.kind.value,
        "modes": list(cfg.modes),
        "repeats": cfg.repeats,
        "bucket_bytes": cfg.bucket_bytes,
        "train_gpus": list(cfg.train_gpus),
        "rollout_gpus": list(cfg.rollout_gpus),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "commit": git_commit(),
        "notes": notes,
        "set_up_s": max(r["set_up_s"] for r in results),
        "local_copy": _local_copy(results[0].get("local_copy")),
    }
    if "p2p" in cfg.modes:
        out.update(_p2p_summary(results))
        wire = out["p2p"]["wire_gbps"] or 0.0
        out["ratio_wire_to_memcpy"] = wire / (out["memcpy"]["gbps"] or float("inf"))
        # The same ratio from the medians of the alternating runs: steadier on a shared machine.
        out["ratio_wire_to_memcpy_median"] = out["memcpy"]["median_wire_s"] / out["p2p"]["median_wire_s"]
        lc = out["local_copy"]
        local = lc.get("memmove_gbps") or lc.get("peer_gpu_gbps") or lc.get("same_gpu_gbps")
        if local:
            out["ratio_wire_to_local_copy"] = wire / local
    if "broadcast" in cfg.modes:
        out["broadcast"] = _broadcast_summary(results)
    if "p2p" in out and "broadcast" in out:
        out["speedup_p2p_vs_broadcast"] = out["broadcast"]["best_s"] / out["p2p"]["best_s"]
    if "tensor" in cfg.modes:
        out["tensor"] = _tensor_summary(results)
        if "p2p" in out:
            out["speedup_p2p_vs_tensor"] = out["tensor"]["best_s"] / out["p2p"]["best_s"]
    for m in ("p2p", "tensor"):
        post = _post_load_summary(results, m) if m in cfg.modes else None
        if post is not None:
            out[m]["post_load"] = post
    out["verified"] = all(out[m]["check"]["ok"] for m in ("p2p", "broadcast", "tensor") if m in out)
    return out


def _row(
    what: str,
    per_rx: float | None,
    total: float,
    best: float,
    mean: float | None,
    first: float | None,
    gbps: float | None,
) -> str:
    def f(x: float | None, spec: str) -> str:
        return format(x, spec) if x is not None else format("-", ">" + spec.split(".")[0])

    return (
        f"{what:<34} {f(per_rx and per_rx / 1e9, '9.3f')} {total / 1e9:9.3f} {best:9.4f} {f(mean, '9.4f')} "
        f"{f(first, '9.4f')} {f(gbps, '9.2f')}"
    )


def format_table(s: dict[str, Any]) -> str:
    """The human-readable table of a :func:`summarize` record."""
    lines = [f"{'':<34} {'GB/recv':>9} {'GB total':>9} {'best s':>9} {'mean s':>9} {'first s':>9} {'GB/s':>9}"]
    lc = s["local_copy"]
    for key, label in (
        ("memmove", "copy in one process (memmove)"),
        ("same_gpu", "copy within one GPU"),
        ("peer_gpu", f"copy GPU->GPU in one process ({lc.get('peer_gpu', '')})"),
    ):
        if key + "_s" in lc:
            lines.append(_row(label, None, lc["bytes"], lc[key + "_s"], None, None, lc[key + "_gbps"]))
    if "memcpy" in s:
        m = s["memcpy"]
        lines.append(
            _row(
                f"copy between processes ({s['transport']})",
                None,
                m["bytes"],
                m["best_wire_s"],
                None,
                m["first_s"],
                m["gbps"],
            )
        )
    if "p2p" in s:
        p = s["p2p"]
        per = max(p["bytes_per_receiver"].values(), default=0)
        lines.append(_row("p2p update", per, p["bytes_total"], p["best_s"], p["mean_s"], p["first_s"], p["gbps"]))
        lines.append(
            _row("  p2p wire (slowest sender)", None, p["bytes_total"], p["best_wire_s"], None, None, p["wire_gbps"])
        )
    if "broadcast" in s:
        b = s["broadcast"]
        per = max(b["bytes_per_receiver"].values(), default=0)
        lines.append(_row("broadcast update", per, b["bytes_total"], b["best_s"], b["mean_s"], b["first_s"], b["gbps"]))
    if "tensor" in s:
        b = s["tensor"]
        lines.append(_row("colocated baseline (from_tensor)", None, b["bytes_total"], b["best_s"], b["mean_s"],
                          b["first_s"], b["gbps"]))
    for m in ("p2p", "tensor"):
        post = s.get(m, {}).get("post_load")
        if post:
            lines.append(_row(f"  post-load after {m}", None, 0, post["best_s"], post["median_s"], post["first_s"],
                              None))
    tail = []
    if "ratio_wire_to_memcpy" in s:
        tail.append(
            f"p2p wire / copy between processes: {s['ratio_wire_to_memcpy']:.2f} "
            f"(medians: {s['ratio_wire_to_memcpy_median']:.2f})"
        )
    if "ratio_wire_to_local_copy" in s:
        tail.append(f"p2p wire / copy in one process: {s['ratio_wire_to_local_copy']:.2f}")
    if "speedup_p2p_vs_broadcast" in s:
        tail.append(f"p2p vs broadcast: {s['speedup_p2p_vs_broadcast']:.2f}x")
    if "speedup_p2p_vs_tensor" in s:
        tail.append(f"p2p vs colocated baseline: {s['speedup_p2p_vs_tensor']:.2f}x")
    checks = [f"{m} {'bit-exact' if s[m]['check']['ok'] else 'MISMATCH'}" for m in ("p2p", "broadcast", "tensor")
              if m in s]
    lines.append("   ".join(tail + checks))
    lines.extend(f"note: {n}" for n in s["notes"])
    return "\n".join(lines)


