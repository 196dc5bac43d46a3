"""Load: concurrent generation clients while the weights are updated back to back.

One trainer rank (this process) updates one ``weightsync serve`` engine (Qwen3-4B tiny, TP 2, dummy
weights; ``--transport shm``: the inbox is the shadow, flips are copies; ``mooncake``: both copies
published, ``--flip swap`` or ``copy``) in ``both`` mode (p2p and broadcast alternating), each
update verified before it is published, pause-free unless ``--pause-free off``. ``--clients``
threads send greedy ``/generate`` requests back to back: first for ``--seconds`` without updates
(the baseline), then for ``--seconds`` with updates back to back (``--interval`` seconds between
them, default none). Every answer is recorded with its weight version, its version spans and the
logprobs of its output tokens. Reported:

* throughput (answers and tokens per second) with updates against the baseline, and the ratio;
* answers cut short (``finish_reason`` ``abort``) and requests refused (non-200, by status);
* every token's version: an answer without ``weight_version_spans`` came from one version, one with
  them says from which output token on each version generated; spans must start at token 0 and
  follow the order the versions were published in;
* no mixed-version answer: the engine is greedy and deterministic, so every complete answer of
  version ``v`` that spans no flip must carry exactly the output and (within 1e-4) the logprobs of
  every other such answer of ``v``;
* the engines' idle time per update (``UpdateStats.engine_idle_s``) beside the whole update.

The pass criterion: every update verified, no non-200, no mixed answer, every answer's versions
well-formed, (pause-free) no answer cut short, and the engine healthy at the end (``/health`` 200,
serving, weights clean). Prints the summary and writes it as JSON with
``--out``; exit status 0 when the criterion holds::

    .venv/bin/python scripts/load_during_updates.py --clients 50 --seconds 30 --out logs/load.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_updates import engine, step, trainer

BODY = {"input_ids": [3, 1, 4, 1, 5, 9, 2, 6], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
        "return_logprob": True}


def client(url: str, stop: threading.Event, out: list[Any], lock: threading.Lock) -> None:
    from weightsync.sync.engine_client import EngineClient, EngineError

    c = EngineClient(url, timeout_s=120.0)
    while not stop.is_set():
        t = time.monotonic()
        try:
            a = c.generate(BODY)
        except EngineError as exc:
            rec: dict[str, Any] = {"kind": "error", "status": exc.status, "message": str(exc)[:200], "t": t}
        else:
            meta = a["meta_info"]
            rec = {"kind": "abort" if (meta.get("finish_reason") or {}).get("type") == "abort" else "ok",
                   "version": str(meta["weight_version"]), "spans": meta.get("weight_version_spans"),
                   "ids": a["output_ids"], "logprobs": [row[0] for row in meta["output_token_logprobs"]], "t": t}
        with lock:
            out.append(rec)
    c.close()


def clients_for(url: str, n: int, seconds: float, during: Any = None) -> tuple[list[dict[str, Any]], float]:
    """``n`` clients for ``seconds`` (``during()`` runs meanwhile, until they stop); their records
    and the wall time they ran."""
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()
    threads = [threading.Thread(target=client, args=(url, stop, records, lock), daemon=True) for _ in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    if during is not None:
        during(t0 + seconds)
    time.sleep(max(0.0, t0 + seconds - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(150)
    return records, time.monotonic() - t0


def check(records: list[dict[str, Any]], published: list[str]) -> dict[str, Any]:
    """The criterion's counts over every recorded answer (module docstring)."""
    ok = [r for r in records if r["kind"] == "ok"]
    errors = Counter(r["status"] for r in records if r["kind"] == "error")
    first: dict[str, dict[str, Any]] = {}
    mixed, bad_spans = set(), 0
    for r in ok:
        if r["spans"]:
            order = [published.index(v) if v in published else -1 for _, v in r["spans"]]
            if r["spans"][0][0] != 0 or order != sorted(set(order)) or -1 in order:
                bad_spans += 1
            continue
        ref = first.setdefault(r["version"], r)
        if r["ids"] != ref["ids"] or max((abs(a - b) for a, b in zip(r["logprobs"], ref["logprobs"], strict=True)),
                                         default=0.0) > 1e-4:
            mixed.add(r["version"])
    return {"requests": len(records), "answers": len(ok), "aborted": sum(r["kind"] == "abort" for r in records),
            "tokens": sum(len(r["ids"]) for r in ok), "spanning_a_flip": sum(bool(r["spans"]) for r in ok),
            "bad_spans": bad_spans, "errors_by_status": {str(k): n for k, n in errors.items()},
            "non_200": sum(errors.values()), "versions_with_mixed_answers": sorted(mixed)}


def health_after(url: str) -> dict[str, Any]:
    """The engine once the load is over: ``/health`` 200, serving, clean weights (``healthy``)."""
    from weightsync.sync.engine_client import EngineClient

    c = EngineClient(url, timeout_s=60.0)
    try:
        status, body = c.health(timeout_s=30)
    finally:
        c.close()
    healthy = status == 200 and body.get("state") == "serving" and body.get("weights_dirty") is False
    return {"status": status, "state": body.get("state"), "weights_dirty": body.get("weights_dirty"),
            "healthy": healthy}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--seconds", type=float, default=30.0, help="of the baseline, and of the updates")
    p.add_argument("--interval", type=float, default=0.0, help="seconds between updates (default: back to back)")
    p.add_argument("--mode", default="both")
    p.add_argument("--transport", default="shm", choices=("shm", "mooncake"))
    p.add_argument("--pause-free", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--flip", default="swap", choices=("swap", "copy"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log", type=Path, default=Path("logs/load_engine.log"))
    args = p.parse_args(argv)
    import torch

    from weightsync import UpdaterConfig, WeightUpdater
    from weightsync.models.parallel import TrainParallel

    torch.set_num_threads(1)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    group, params, spec = trainer()
    updates: list[dict[str, Any]] = []
    published = ["default", "0"]
    config = UpdaterConfig(mode=args.mode, bucket_bytes=1 << 18, verify_every=1, pause_free=args.pause_free,
                           flip=args.flip)
    with engine(args.log, args.transport) as (url, _), WeightUpdater(
            params, spec=spec, train=TrainParallel(world_size=1), engine_urls=[url], group=group,
            config=config) as updater:
        updater.update(0)

        def update_until(end: float) -> None:
            v = 0
            while time.monotonic() < end:
                time.sleep(args.interval)
                v += 1
                step(params, v)
                s = updater.update(v)
                published.append(str(v))
                updates.append({"version": v, "mode": s.mode, "pause_free": s.pause_free, "flip": s.flip,
                                "engine_idle_s": s.engine_idle_s, "update_s": s.update_s, "verify_s": s.verify_s,
                                "verified": s.verified})

        base, base_s = clients_for(url, args.clients, args.seconds)
        loaded, loaded_s = clients_for(url, args.clients, args.seconds, during=update_until)
        health = health_after(url)
    baseline, result = check(base, published), check(loaded, published)
    n = max(len(updates), 1)
    result.update({
        "clients": args.clients, "seconds": args.seconds, "transport": args.transport, "updates": len(updates),
        "updates_verified": sum(bool(u["verified"]) for u in updates),
        "pause_free_updates": sum(bool(u["pause_free"]) for u in updates),
        "answers_per_s": result["answers"] / loaded_s, "baseline_answers_per_s": baseline["answers"] / base_s,
        "tokens_per_s": result["tokens"] / loaded_s, "baseline_tokens_per_s": baseline["tokens"] / base_s,
        "mean_engine_idle_ms": 1e3 * sum(u["engine_idle_s"] for u in updates) / n,
        "max_engine_idle_ms": 1e3 * max((u["engine_idle_s"] for u in updates), default=0.0),
        "mean_update_ms": 1e3 * sum(u["update_s"] for u in updates) / n, "engine_after": health,
    })
    result["throughput_ratio"] = result["tokens_per_s"] / max(result["baseline_tokens_per_s"], 1e-9)
    result["passed"] = (result["non_200"] == 0 and not result["versions_with_mixed_answers"]
                        and result["bad_spans"] == 0 and result["updates_verified"] == len(updates)
                        and result["answers"] > 0 and (args.pause_free == "off" or result["aborted"] == 0)
                        and health["healthy"])
    print(json.dumps({**result, "baseline": baseline}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**result, "baseline": baseline, "update_list": updates}, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
