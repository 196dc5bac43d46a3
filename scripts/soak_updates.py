"""Soak: many consecutive verified updates into one live engine; its resources must stay flat.

One trainer rank (this process, a gloo group of one) holds Qwen3-4B tiny weights and updates one
``weightsync serve`` engine (TP 2, shm, dummy weights) ``--updates`` times in ``both`` mode (p2p
and broadcast alternating), each update verified by checksums before it is published. After
every update it samples, for the trainer and for each engine process (the server and its
ranks): resident memory, open file descriptors, threads; and the project's shm segments (count
and bytes). The pass criterion: after the first ``--warmup`` updates, every sample stays within
``--tolerance`` (5 %) of its value at update ``--warmup`` (fds and threads: also at most +2, the
HTTP connection pool's slack), and every update verified.

Prints one line per 20 updates and a summary; writes JSON (every sample) with ``--out``; exit
status 0 when the criterion holds::

    .venv/bin/python scripts/soak_updates.py --updates 200 --out logs/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

@contextmanager
def engine(log: Path, transport: str = "shm") -> Iterator[tuple[str, int]]:
    """An engine as ``run`` starts one (:class:`~weightsync.launch.procs.EngineProc`), receiving
    through ``transport``, until the block ends; yields its URL and pid once healthy."""
    from weightsync.launch.procs import EngineProc, serve_argv
    from weightsync.proc import free_port
    from weightsync.transport import TransportConfig

    port = free_port()
    argv = serve_argv(model="Qwen3-4B", scale="tiny", tp=2, ep=1, dp=1, device="cpu", port=port, checkpoint=None,
                      transport=TransportConfig(kind=transport), extra=["--die-with-parent"])
    proc = EngineProc(0, argv, f"http://127.0.0.1:{port}", log, dict(os.environ))
    try:
        proc.client.wait_healthy(timeout_s=180, proc_alive=proc.alive)
        yield proc.url, proc.proc.pid
    finally:
        proc.stop()


def trainer(seed: int = 0) -> tuple[Any, dict[str, Any], Any]:
    """This process as trainer rank 0 of 1: (its gloo group, its parameters, the model spec)."""
    import torch
    import torch.distributed as dist

    from weightsync.layout.megatron import trainer_layout
    from weightsync.models import get_model
    from weightsync.models.parallel import TrainParallel
    from weightsync.proc import free_port

    spec = get_model("Qwen3-4B", "tiny")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    gen = torch.Generator().manual_seed(seed)
    params = {t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype))
              for t in trainer_layout(spec, TrainParallel(world_size=1), 0)}
    return dist.new_group(ranks=[0], backend="gloo"), params, spec


def step(params: dict[str, Any], seed: int) -> None:
    """A training step's change of every weight (seeded noise, large enough to change every byte)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for t in params.values():
        t.add_(torch.randn(t.shape, generator=gen).to(t.dtype), alpha=1e-2)


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with suppress(OSError):
                todo += [int(x) for x in (task / "children").read_text().split()]
    return out


def sample(pid: int) -> dict[str, int]:
    """RSS (bytes), open fds and threads of one process."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss": int(status["VmRSS"].split()[0]) * 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"])}


def shm() -> dict[str, int]:
    from weightsync.transport.shm import SHM_DIR, list_segments

    names = list_segments()
    return {"segments": len(names), "bytes": sum((SHM_DIR / n).stat().st_size for n in names if (SHM_DIR / n).exists())}


def snapshot(engine_pid: int) -> dict[str, Any]:
    procs = {"trainer": sample(os.getpid())}
    for i, p in enumerate(process_tree(engine_pid)):
        procs["engine" if i == 0 else f"engine_child{i}"] = sample(p)  # its ranks and helpers
    return {"procs": procs, "shm": shm()}


def flat(samples: list[dict[str, Any]], warmup: int, tolerance: float) -> list[str]:
    """Every value after ``warmup`` against its value at ``warmup``: what grew beyond the tolerance."""
    base = samples[warmup - 1]
    bad: list[str] = []
    for i, s in enumerate(samples[warmup:], start=warmup + 1):
        for who, vals in [*list(s["procs"].items()), ("shm", s["shm"])]:
            for k, v in vals.items():
                b = ((base["procs"].get(who) or {}) if who != "shm" else base["shm"]).get(k)
                if b is None:
                    bad.append(f"update {i}: {who} appeared")
                    continue
                slack = 2 if k in ("fds", "threads", "segments") else 0
                if abs(v - b) > max(tolerance * b, slack):
                    bad.append(f"update {i}: {who} {k} {b} -> {v}")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--mode", default="both")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log", type=Path, default=Path("logs/soak_engine.log"))
    args = p.parse_args(argv)
    import torch

    from weightsync import UpdaterConfig, WeightUpdater
    from weightsync.models.parallel import TrainParallel

    torch.set_num_threads(1)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    group, params, spec = trainer()
    samples: list[dict[str, Any]] = []
    times: list[float] = []
    verified = 0
    t0 = time.perf_counter()
    with engine(args.log) as (url, pid):
        cfg = UpdaterConfig(mode=args.mode, bucket_bytes=1 << 18, verify_every=1)
        with WeightUpdater(params, spec=spec, train=TrainParallel(world_size=1), engine_urls=[url], group=group,
                           config=cfg) as updater:
            for v in range(1, args.updates + 1):
                step(params, v)
                stats = updater.update(v)
                verified += bool(stats.verified)
                times.append(stats.update_s)  # the whole update, its verification included
                samples.append({"update": v, "mode": stats.mode, **snapshot(pid)})
                if v % 20 == 0 or v == args.updates:
                    s = samples[-1]
                    print(f"update {v}: {stats.mode}, {times[-1] * 1e3:.0f} ms with verification; trainer RSS "
                          f"{s['procs']['trainer']['rss'] / 1e6:.1f} MB, engine RSS "
                          f"{sum(x['rss'] for k, x in s['procs'].items() if k != 'trainer') / 1e6:.1f} MB, shm "
                          f"{s['shm']['segments']} segments {s['shm']['bytes'] / 1e6:.2f} MB", flush=True)
    wall = time.perf_counter() - t0
    bad = flat(samples, args.warmup, args.tolerance)
    summary = {"updates": args.updates, "verified": verified, "wall_s": wall,
               "mean_update_ms": 1e3 * sum(times) / len(times), "at_warmup": samples[args.warmup - 1],
               "last": samples[-1], "max": _max(samples[args.warmup:]), "not_flat": bad[:20],
               "passed": verified == args.updates and not bad}
    print(json.dumps({k: summary[k] for k in ("updates", "verified", "wall_s", "mean_update_ms", "passed")}))
    print("not flat: " + "; ".join(bad[:10]) if bad else
          f"flat within {args.tolerance:.0%} after update {args.warmup}: RSS, fds, threads of every process, shm")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    return 0 if summary["passed"] else 1


def _max(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"procs": {}, "shm": {}}
    for s in samples:
        for who, vals in s["procs"].items():
            d = out["procs"].setdefault(who, {})
            for k, v in vals.items():
                d[k] = max(d.get(k, v), v)
        for k, v in s["shm"].items():
            out["shm"][k] = max(out["shm"].get(k, v), v)
    return out


if __name__ == "__main__":
    sys.exit(main())
