"""Answers shaped the sglang way: ``/parallelism_config`` for one rank, the ``/weights_checker`` body.

Pure functions of the engine's layout and its ranks' results, used by :mod:`weightsync.engine.http_api`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from fastapi.responses import JSONResponse

from weightsync.layout.sglang import engine_coords
from weightsync.models.parallel import RolloutParallel


def parallelism_config(par: RolloutParallel, rank: int) -> dict[str, int]:
    """sglang-miles' ``RankParallelismConfig`` fields for engine rank ``rank``."""
    c = engine_coords(par, rank)
    return {
        "tp_size": c.tp_size,
        "tp_rank": c.tp_rank,
        "pp_size": 1,
        "pp_rank": 0,
        "ep_size": c.moe_ep_size,
        "ep_rank": c.moe_ep_rank,
        "moe_tp_size": c.moe_tp_size,
        "moe_tp_rank": c.moe_tp_rank,
        "attn_tp_size": c.attn_tp_size,
        "attn_tp_rank": c.attn_tp_rank,
        "attn_dp_size": c.attn_dp_size,
        "attn_dp_rank": c.attn_dp_rank,
        "world_size": par.tp,
        "global_rank": rank,
        "local_rank": rank,
    }


def checker_response(action: str, per_rank: list[dict[str, Any]], rank: int | None) -> JSONResponse:
    """The ``/weights_checker`` answer (sglang's shape, ``CheckWeightsReqOutput``).

    ``checksum``: ``ranks`` holds one ``{"checksums", "per_gpu_checksum", "parallelism_info":
    [...]}`` per TP rank and ``per_engine_checksum`` digests them in rank order. Every action
    answers ``ranks`` (tagged with ``rank``); ``rank`` narrows them to one and lifts its fields to
    the top level. ``compare`` answers 400 ``success: false`` naming every differing tensor.
    """
    ranks = [{"rank": r, **v} for r, v in enumerate(per_rank) if rank is None or r == rank]
    out: dict[str, Any] = {"success": True, "message": "Success.", "ranks": ranks}
    if action == "checksum":
        digest = hashlib.sha256()
        for r in ranks:
            digest.update(r["per_gpu_checksum"].encode())
        out["per_engine_checksum"] = digest.hexdigest()
    if rank is not None:
        out.update({k: v for k, v in ranks[0].items() if k != "rank"})
    if action != "compare":
        return JSONResponse(out)
    mismatches = [{"rank": r["rank"], **m} for r in ranks for m in r["mismatches"]]
    bad = [f"[rank{m['rank']}] {m['name']} max_abs_diff={m['max_abs_diff']}" for m in mismatches]
    out.update(
        success=not bad,
        equal=not bad,
        mismatches=mismatches,
        message="All weights equal." if not bad else "check tensor equality failed: " + "; ".join(bad),
    )
    return JSONResponse(out, status_code=200 if not bad else 400)
