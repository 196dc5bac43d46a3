"""The engine's HTTP API on rank 0 (FastAPI): sglang's endpoint names and shapes, thin handlers.

Every handler validates its body (pydantic), then hands the work to the
:class:`~weightsync.engine.scheduler.Scheduler` from a worker thread (``asyncio.to_thread``), so
the event loop never blocks on the model or on a collective. Errors map to status codes:
malformed JSON / wrong types / out-of-range values / bad requests -> 400, a call that conflicts
with the engine's state (an update while generating, continue while dirty) -> 409, an engine
fault on some rank -> 500. Error bodies are sglang's ``{"object": "error", "message", "type",
"code"}``.

Typical usage::

    app = build_app(ServerContext(scheduler=sched, tokenizer=tok, server_info={...}, par=par))
    uvicorn.run(app, host="127.0.0.1", port=30000)
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from weightsync.engine.control import RankError
from weightsync.engine.io_struct import (
    CheckWeightsReqInput,
    DestroyWeightsUpdateGroupReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightVersionReqInput,
    to_gen_requests,
    to_response,
)
from weightsync.engine.scheduler import Conflict, Scheduler
from weightsync.engine.tokenizer import Tokenizer
from weightsync.layout.sglang import engine_coords
from weightsync.models.parallel import RolloutParallel

logger = logging.getLogger(__name__)

ROUTES = (
    "/generate",
    "/health",
    "/health_generate",
    "/server_info",
    "/get_server_info",
    "/model_info",
    "/get_model_info",
    "/parallelism_config",
    "/get_remote_instance_transfer_engine_info",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weight_version",
    "/get_weight_version",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/update_weights_from_disk",
    "/weights_checker",
)
"""Every route the app serves (pinned by a surface test)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerContext:
    scheduler: Scheduler
    tokenizer: Tokenizer
    par: RolloutParallel
    server_info: dict[str, Any]
    """Static facts for ``/server_info`` (model, sizes, device, ...)."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"object": "error", "message": message, "type": HTTPStatus(status).phrase, "code": status}, status_code=status
    )


def _check_rank(par: RolloutParallel, rank: int) -> None:
    if not 0 <= rank < par.tp:
        raise ValueError(f"rank {rank} is outside the engine's ranks [0, {par.tp})")


def parallelism_config(par: RolloutParallel, rank: int) -> dict[str, int]:
    """sglang's ``RankParallelismConfig`` fields for engine rank ``rank``."""
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
    """The ``/weights_checker`` answer: every rank's result under ``ranks`` (only ``rank``'s when
    given, its fields also at the top level); compare adds ``equal`` and every mismatch (rank-tagged)
    and answers 400 when anything differs."""
    ranks = [{"rank": r, **v} for r, v in enumerate(per_rank) if rank is None or r == rank]
    out: dict[str, Any] = {"success": True, "message": f"{action} done on {len(ranks)} ranks", "ranks": ranks}
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
        message="All weights equal." if not bad else f"{len(bad)} tensors differ: " + "; ".join(bad),
    )
    return JSONResponse(out, status_code=200 if not bad else 400)


def build_app(ctx: ServerContext) -> FastAPI:
    """The FastAPI app serving one engine (see the module docstring)."""
    app = FastAPI(title="weightsync rollout engine")
    sched, tok = ctx.scheduler, ctx.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return _error(400, "invalid request: " + "; ".join(parts))

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(Conflict)
    async def _conflict(_: Request, exc: Conflict) -> JSONResponse:
        return _error(409, str(exc))

    @app.exception_handler(RankError)
    async def _rank_error(_: Request, exc: RankError) -> JSONResponse:
        return _error(400 if exc.user_error else 500, f"{exc.op}: {exc}")

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {**ctx.server_info, **sched.status()}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": ctx.server_info.get("model_path"),
            "tokenizer_path": ctx.server_info.get("model_path"),
            "is_generation": True,
            "weight_version": sched.weight_version,
        }

    @app.get("/parallelism_config")
    async def parallelism(rank: int = 0) -> dict[str, int]:
        _check_rank(ctx.par, rank)
        return parallelism_config(ctx.par, rank)

    @app.get("/get_remote_instance_transfer_engine_info")
    async def transfer_info(rank: int = 0) -> dict[str, Any]:
        _check_rank(ctx.par, rank)
        session_id, weights, descriptor = sched.transfer_infos[rank]
        return {
            "rank": rank,
            "remote_instance_transfer_engine_info": [session_id, weights],
            "transport_descriptor": descriptor,
        }

    @app.post("/generate")
    async def generate(body: GenerateReqInput) -> Any:
        t0 = time.perf_counter()
        reqs, is_batch = await asyncio.to_thread(to_gen_requests, body, sched.spec, tok)
        futures = sched.submit(reqs)
        done = [await asyncio.wrap_future(f) for f in futures]
        latency = time.perf_counter() - t0
        out = [
            to_response(r, res, version, tok, latency, body.return_text_in_logprobs)
            for r, (res, version) in zip(reqs, done)
        ]
        return out if is_batch else out[0]

    @app.post("/pause_generation")
    async def pause(body: PauseGenerationReqInput | None = None) -> dict[str, Any]:
        return await asyncio.to_thread(sched.pause, (body or PauseGenerationReqInput()).mode)

    @app.post("/continue_generation")
    async def resume() -> dict[str, Any]:
        return await asyncio.to_thread(sched.resume)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = sched.flush_cache()
        text = "Cache flushed.\n" if ok else "Cache not flushed: a batch is running.\n"
        return Response(content=text, status_code=200 if ok else 400)

    @app.post("/begin_weight_update")
    async def begin_update() -> dict[str, Any]:
        return await asyncio.to_thread(sched.begin_update)

    @app.post("/end_weight_update")
    async def end_update() -> dict[str, Any]:
        return await asyncio.to_thread(sched.end_update)

    @app.post("/update_weight_version")
    async def update_version(body: UpdateWeightVersionReqInput) -> dict[str, Any]:
        await asyncio.to_thread(sched.set_weight_version, body.new_version, body.abort_all_requests)
        return {
            "success": True,
            "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version,
        }

    @app.get("/get_weight_version")
    async def get_version() -> dict[str, Any]:
        return {"weight_version": sched.weight_version}

    @app.post("/init_weights_update_group")
    async def init_group(body: InitWeightsUpdateGroupReqInput) -> dict[str, Any]:
        return await asyncio.to_thread(lambda: sched.init_group(**body.model_dump()))

    @app.post("/update_weights_from_distributed")
    async def update_distributed(body: UpdateWeightsFromDistributedReqInput) -> dict[str, Any]:
        return await asyncio.to_thread(
            lambda: sched.update_from_distributed(
                names=body.names,
                dtypes=body.dtypes,
                shapes=body.shapes,
                group_name=body.group_name,
                weight_version=body.weight_version,
            )
        )

    @app.post("/destroy_weights_update_group")
    async def destroy_group(body: DestroyWeightsUpdateGroupReqInput) -> dict[str, Any]:
        return await asyncio.to_thread(sched.destroy_group, body.group_name)

    @app.post("/update_weights_from_disk")
    async def update_disk(body: UpdateWeightFromDiskReqInput) -> dict[str, Any]:
        return await asyncio.to_thread(sched.update_from_disk, body.model_path, body.weight_version)

    @app.post("/weights_checker")
    async def weights_checker(body: CheckWeightsReqInput) -> JSONResponse:
        if body.rank is not None:
            _check_rank(ctx.par, body.rank)
        per_rank = await asyncio.to_thread(sched.check_weights, body.action, body.seed)
        return checker_response(body.action, per_rank, body.rank)

    return app
