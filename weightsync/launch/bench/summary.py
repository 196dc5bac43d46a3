"""The benchmark's record: every process's result summarized into one JSON object, and its table.

:func:`summarize` reads the processes' results (:data:`~weightsync.launch.bench.worker.RankResult`):
per mode the best, mean and first timed window (the slowest process's), the wire and pack times
of the slowest trainer rank, bytes per receiver, rates (GB = 1e9 bytes), the ratios p2p is
judged by, and the bit-exact checks; with the date, host, load and commit. :func:`format_table`
prints it.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import statistics
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightsync.launch.bench.config import BenchConfig
from weightsync.launch.report import fmt_bytes, fmt_rate
from weightsync.plan.records import Mode

if TYPE_CHECKING:  # the worker imports torch; this module does not (the CLI imports it)
    from weightsync.launch.bench.worker import RankResult

log = logging.getLogger(__name__)


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
    root = Path(__file__).resolve().parents[3]
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


def _engine_idle(results: list[dict[str, Any]]) -> dict[str, Any]:
    """What an update stops the engines for: pause-free, the flip (the slowest engine rank's best
    swap and copy of a shadow into its parameters); paused, the whole update (the mode rows:
    write and post-load, no verification in the benchmark)."""
    flips = [r.get("flips") for r in results if r["role"] == "engine"]
    skipped = [f["skipped"] for f in flips if f and "skipped" in f]
    timed = [f for f in flips if f and "skipped" not in f]
    if skipped or not timed:
        return {"skipped": "; ".join(skipped) or "no engine rank measured a flip"}
    return {"swap_s": max(f["swap_s"] for f in timed), "copy_s": max(f["copy_s"] for f in timed),
            "bytes_per_rank": max(f["bytes"] for f in timed)}


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


def summarize(cfg: BenchConfig, results: list[RankResult], notes: list[str]) -> dict[str, Any]:
    """The benchmark's JSON record from every process's result."""
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
        "engine_idle": _engine_idle(results),
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
    out["verified"] = all(out[m]["check"]["ok"] for m in (*Mode.BOTH.transfers, "tensor") if m in out)
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
        f"{what:<34} {fmt_bytes(per_rx) if per_rx else '-':>9} {fmt_bytes(total):>9} {best:9.4f} {f(mean, '9.4f')} "
        f"{f(first, '9.4f')} {fmt_rate(gbps and gbps * 1e9):>11}"
    )


def format_table(s: dict[str, Any]) -> str:
    """The human-readable table of a :func:`summarize` record."""
    lines = [f"{'':<34} {'per recv':>9} {'total':>9} {'best s':>9} {'mean s':>9} {'first s':>9} {'rate':>11}"]
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
    idle = s.get("engine_idle") or {}
    if "swap_s" in idle:
        tail.append(f"engines idle per pause-free update (the flip, {idle['bytes_per_rank'] / 1e9:.3f} GB per rank): "
                    f"swap {idle['swap_s'] * 1e3:.3f} ms, copy {idle['copy_s'] * 1e3:.3f} ms; paused: the whole update "
                    f"above (no verification here)")
    elif idle:
        tail.append(f"engines idle per pause-free update: not measured ({idle['skipped']})")
    if "ratio_wire_to_local_copy" in s:
        tail.append(f"p2p wire / copy in one process: {s['ratio_wire_to_local_copy']:.2f}")
    if "speedup_p2p_vs_broadcast" in s:
        tail.append(f"p2p vs broadcast: {s['speedup_p2p_vs_broadcast']:.2f}x")
    if "speedup_p2p_vs_tensor" in s:
        tail.append(f"p2p vs colocated baseline: {s['speedup_p2p_vs_tensor']:.2f}x")
    checks = [f"{m} {'bit-exact' if s[m]['check']['ok'] else 'MISMATCH'}" for m in (*Mode.BOTH.transfers, "tensor")
              if m in s]
    lines.append("   ".join(tail + checks))
    lines.extend(f"note: {n}" for n in s["notes"])
    return "\n".join(lines)


