"""Load: concurrent generation clients while the weights are updated live; no answer may mix versions.

One trainer rank (this process) updates one ``weightsync serve`` engine (Qwen3-4B tiny, TP 2, shm,
dummy weights) every ``--interval`` seconds in ``both`` mode, each update verified before it is
published, while ``--clients`` threads send greedy ``/generate`` requests back to back for
``--seconds``. Every answer is recorded with its ``weight_version`` and the logprobs of its output
tokens. The pass criterion:

* no 5xx answer (a request the pause cut short is answered 200 with ``finish_reason`` ``abort``,
  counted apart; 503 would mean dirty weights were asked for while no update ran);
* no mixed-version answer: the engine is greedy and deterministic, so every complete answer
  labelled ``v`` must carry exactly the output and (within 1e-4) the logprobs of every other answer
  labelled ``v``; one computed partly with other weights would differ;
* every update verified.

Prints a summary (requests, answers per version, errors by status, updates) and writes it as
JSON with ``--out``; exit status 0 when the criterion holds::

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
            rec: tuple[Any, ...] = ("error", exc.status, str(exc)[:200], t)
        else:
            meta = a["meta_info"]
            aborted = (meta.get("finish_reason") or {}).get("type") == "abort"
            rec = ("abort" if aborted else "ok", str(meta["weight_version"]), tuple(a["output_ids"]),
                   tuple(row[0] for row in meta["output_token_logprobs"]), t)
        with lock:
            out.append(rec)
    c.close()


def check(records: list[tuple[Any, ...]]) -> dict[str, Any]:
    """The criterion over every recorded answer (module docstring)."""
    ok = [r for r in records if r[0] == "ok"]
    errors = Counter(r[1] for r in records if r[0] == "error")
    by_version: dict[str, list[tuple[Any, ...]]] = {}
    for r in ok:
        by_version.setdefault(r[1], []).append(r)
    mixed = []
    for v, rs in by_version.items():
        ids, lps = rs[0][2], rs[0][3]
        for r in rs[1:]:
            if r[2] != ids or max((abs(a - b) for a, b in zip(r[3], lps, strict=True)), default=0.0) > 1e-4:
                mixed.append(v)
                break
    return {"requests": len(records), "answers": len(ok), "aborted_by_pause": sum(r[0] == "abort" for r in records),
            "errors_by_status": {str(k): n for k, n in errors.items()},
            "answers_per_version": {v: len(rs) for v, rs in sorted(by_version.items(), key=lambda x: int(x[0]))},
            "versions_with_mixed_answers": mixed,
            "server_errors": sum(n for k, n in errors.items() if k is not None and k >= 500)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between updates")
    p.add_argument("--mode", default="both")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log", type=Path, default=Path("logs/load_engine.log"))
    args = p.parse_args(argv)
    import torch

    from weightsync import UpdaterConfig, WeightUpdater
    from weightsync.models.parallel import TrainParallel

    torch.set_num_threads(1)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    group, params, spec = trainer()
    records: list[tuple[Any, ...]] = []
    lock = threading.Lock()
    updates: list[dict[str, Any]] = []
    with engine(args.log) as (url, _), WeightUpdater(
            params, spec=spec, train=TrainParallel(world_size=1), engine_urls=[url], group=group,
            config=UpdaterConfig(mode=args.mode, bucket_bytes=1 << 18, verify_every=1)) as updater:
        updater.update(0)
        stop = threading.Event()
        threads = [threading.Thread(target=client, args=(url, stop, records, lock), daemon=True)
                   for _ in range(args.clients)]
        for t in threads:
            t.start()
        end = time.monotonic() + args.seconds
        v = 0
        while time.monotonic() < end:
            time.sleep(args.interval)
            v += 1
            step(params, v)
            s = updater.update(v)
            updates.append({"version": v, "mode": s.mode, "update_s": s.update_s, "verify_s": s.phases["verify"],
                            "verified": s.verified})
        stop.set()
        for t in threads:
            t.join(150)
    result = check(records)
    result.update({"clients": args.clients, "seconds": args.seconds, "updates": len(updates),
                   "updates_verified": sum(bool(u["verified"]) for u in updates),
                   "mean_update_ms": 1e3 * sum(u["update_s"] for u in updates) / max(len(updates), 1)})
    result["passed"] = (result["server_errors"] == 0 and not result["versions_with_mixed_answers"]
                        and result["updates_verified"] == len(updates) and result["answers"] > 0)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**result, "update_list": updates}, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
