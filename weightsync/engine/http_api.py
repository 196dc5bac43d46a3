"""The engine's HTTP API on rank 0 (FastAPI): sglang's endpoints, request bodies and answers.

Handlers are thin: parse the body (:mod:`weightsync.engine.io_struct`), hand the work to the
:class:`~weightsync.engine.scheduler.Scheduler` from a worker thread (``asyncio.to_thread``, so
the event loop never blocks on the model or on a collective), shape the answer. The state
machine lives in the scheduler.

Status codes and error bodies follow sglang (``entrypoints/http_server.py``):

* a body that does not validate (malformed JSON, wrong type, bad ``Literal``, missing field, a
  field sglang does not have) -> 400 ``{"object": "error", "message", "type": "Bad Request",
  "param": null, "code": 400}``;
* ``/generate`` refusing a valid body (bad token ids, too long ...) -> 400 ``{"error": {"message"}}``;
* the weight and control routes -> ``{"success": false, "message"}``: 400 for a refused request,
  409 when it conflicts with the engine's state (an update while generating, continue while the
  weights are dirty: sglang would wait instead), 500 for an engine fault on some rank;
* ``/remote_instance_transfer_engine_info`` and ``/parallelism_config`` with a missing or unknown
  rank -> 400 ``{"error": {"message"}}``; ``/flush_cache`` answers text.

Typical usage::

    app = build_app(ServerContext(scheduler=sched, tokenizer=tok, server_info={...}, par=par))
    uvicorn.run(app, host="127.0.0.1", port=30000)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from weightsync.engine.control import RankError
from weightsync.engine.io_struct import (
    AbortReq,
    BeginWeightUpdateReqInput,
    CheckWeightsReqInput,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    FlushCacheReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    RequestBody,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
    to_gen_requests,
    to_response,
)
from weightsync.engine.scheduler import Conflict, Scheduler
from weightsync.engine.tokenizer import Tokenizer
from weightsync.layout.sglang import engine_coords
from weightsync.models.parallel import RolloutParallel

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 20.0
"""sglang's ``SGLANG_HEALTH_CHECK_TIMEOUT`` default: no token within this long -> 503."""

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
    "/remote_instance_transfer_engine_info",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/abort_request",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weight_version",
    "/get_weight_version",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/destroy_weights_update_group",
    "/update_weights_from_disk",
    "/weights_checker",
)
"""Every route the app serves (pinned by a surface test)."""

B = TypeVar("B", bound=RequestBody)


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerContext:
    scheduler: Scheduler
    tokenizer: Tokenizer
    par: RolloutParallel
    server_info: dict[str, Any]
    """Static facts for ``/server_info``: sglang's ``ServerArgs`` fields with this engine's values."""
    publish_descriptor: bool = True
    """Add weightsync's transport descriptor to the transfer-engine info (an extension); False
    publishes exactly sglang's ``[session_id, weights_info]``."""


class BadBody(ValueError):
    """A request body that does not validate (HTTP 400, sglang's ``ErrorResponse``)."""


class RouteError(Exception):
    """A refusal answered with a route-specific body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.status = status
        self.body = body


def _error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"object": "error", "message": message, "type": HTTPStatus(status).phrase, "param": None, "code": status},
        status_code=status,
    )


_TYPE_TAG = re.compile(r"^([A-Z]\w*|str|int|float|bool|none|(list|dict|tuple|literal)\[.*\]|function-\w+.*)$")
"""Union-branch and validator tags pydantic puts into an error's location (not field names)."""


def _describe(exc: ValidationError, model: type[RequestBody]) -> str:
    """One line per problem; unknown fields say so plainly (sglang would drop them silently)."""
    seen: list[str] = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if not _TYPE_TAG.match(str(x)))
        if e.get("type") == "extra_forbidden":
            msg = f"{loc}: unknown field (not a field of sglang's {model.__name__}; check its spelling)"
        else:
            msg = f"{loc}: {e.get('msg')}" if loc else str(e.get("msg"))
        if msg not in seen:
            seen.append(msg)
    return "invalid request: " + "; ".join(seen)


async def parse_body(request: Request, model: type[B]) -> B:
    """The request's JSON body as ``model``; an absent body is ``{}`` (every field's default).

    Raises:
        BadBody: malformed JSON, or a body that does not validate (the message names the fields).
    """
    raw = await request.body()
    try:
        return model.model_validate_json(raw if raw.strip() else b"{}")
    except ValidationError as exc:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            raise BadBody(f"invalid request: malformed JSON body ({exc.errors()[0].get('msg')})") from None
        raise BadBody(_describe(exc, model)) from None


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


def _rank_param(request: Request, par: RolloutParallel) -> int:
    raw = request.query_params.get("rank")
    try:
        rank = int(raw) if raw is not None else -1
    except ValueError:
        rank = -1
    if rank < 0:
        raise RouteError(400, {"error": {"message": "Missing or invalid rank parameter"}})
    if rank >= par.tp:
        raise RouteError(400, {"error": {"message": f"Failed to get transfer engine info for rank {rank}"}})
    return rank


def build_app(ctx: ServerContext) -> FastAPI:
    """The FastAPI app serving one engine (see the module docstring)."""
    app = FastAPI(title="weightsync rollout engine")
    sched, tok = ctx.scheduler, ctx.tokenizer

    def control(status: int, message: str) -> JSONResponse:
        return JSONResponse({"success": False, "message": message}, status_code=status)

    @app.exception_handler(BadBody)
    async def _bad_body(_: Request, exc: BadBody) -> JSONResponse:
        return _error_response(400, str(exc))

    @app.exception_handler(RouteError)
    async def _route_error(_: Request, exc: RouteError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, exc: ValueError) -> JSONResponse:
        if request.url.path == "/generate":
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        return control(400, str(exc))

    @app.exception_handler(Conflict)
    async def _conflict(_: Request, exc: Conflict) -> JSONResponse:
        return control(409, str(exc))

    @app.exception_handler(RankError)
    async def _rank_error(_: Request, exc: RankError) -> JSONResponse:
        return control(400 if exc.user_error else 500, f"{exc.op}: {exc}")

    async def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    # -- generation --------------------------------------------------------------------------

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        body = await parse_body(request, GenerateReqInput)
        t0 = time.perf_counter()
        reqs, is_batch, sps = await run(to_gen_requests, body, sched.spec, tok)
        futures = sched.submit(reqs)
        done = [await asyncio.wrap_future(f) for f in futures]
        latency = time.perf_counter() - t0
        out = [to_response(r, res, v, tok, latency, body, sp) for r, (res, v), sp in zip(reqs, done, sps)]
        if body.stream:
            chunks = [f"data: {json.dumps(o)}\n\n" for o in out] + ["data: [DONE]\n\n"]
            return StreamingResponse(iter(chunks), media_type="text/event-stream")
        return out if is_batch else out[0]

    @app.api_route("/health", methods=["GET"])
    @app.api_route("/health_generate", methods=["GET"])
    async def health() -> Response:
        ok, why = await run(sched.health_check, HEALTH_CHECK_TIMEOUT_S)
        if not ok:
            logger.warning("health check failed: %s", why)
        return Response(status_code=200 if ok else 503)

    @app.post("/pause_generation")
    async def pause(request: Request) -> dict[str, Any]:
        body = await parse_body(request, PauseGenerationReqInput)
        return await run(sched.pause, body.mode)

    @app.post("/continue_generation")
    async def resume(request: Request) -> dict[str, Any]:
        await parse_body(request, ContinueGenerationReqInput)
        return await run(sched.resume)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        if request.method == "POST":
            await parse_body(request, FlushCacheReqInput)
        if sched.flush_cache():
            return PlainTextResponse(
                "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n"
            )
        return PlainTextResponse("Flush cache failed: a batch is running.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await parse_body(request, AbortReq)
        await run(sched.abort_request, body.rid, body.abort_all, body.abort_message)
        return {"status": "ok"}

    # -- information -------------------------------------------------------------------------

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {**ctx.server_info, "internal_states": [sched.status()]}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        info = ctx.server_info
        return {
            "model_path": info.get("model_path"),
            "tokenizer_path": info.get("tokenizer_path"),
            "served_model_name": info.get("served_model_name"),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": sched.weight_version,
            "load_format": info.get("load_format"),
            "reasoning_parser": None,
            "tool_call_parser": None,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": info.get("weightsync", {}).get("model_type"),
            "architectures": info.get("weightsync", {}).get("architectures"),
        }

    @app.get("/get_weight_version")
    async def get_version() -> dict[str, Any]:
        return {"weight_version": sched.weight_version}

    @app.get("/parallelism_config")
    async def parallelism(request: Request) -> dict[str, int]:
        return parallelism_config(ctx.par, _rank_param(request, ctx.par))

    @app.get("/remote_instance_transfer_engine_info")
    @app.get("/get_remote_instance_transfer_engine_info")
    async def transfer_info(request: Request) -> dict[str, Any]:
        rank = _rank_param(request, ctx.par)
        session_id, weights, descriptor = sched.transfer_infos[rank]
        out: dict[str, Any] = {"rank": rank, "remote_instance_transfer_engine_info": [session_id, weights]}
        if ctx.publish_descriptor:
            out["transport_descriptor"] = descriptor
        return out

    # -- weight updates ----------------------------------------------------------------------

    @app.post("/begin_weight_update")
    async def begin_update(request: Request) -> dict[str, Any]:
        await parse_body(request, BeginWeightUpdateReqInput)
        return await run(sched.begin_update)

    @app.post("/end_weight_update")
    async def end_update(request: Request) -> dict[str, Any]:
        await parse_body(request, EndWeightUpdateReqInput)
        return await run(sched.end_update)

    @app.post("/update_weight_version")
    async def update_version(request: Request) -> dict[str, Any]:
        body = await parse_body(request, UpdateWeightVersionReqInput)
        await run(sched.set_weight_version, body.new_version, body.abort_all_requests)
        return {
            "success": True,
            "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version,
        }

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> dict[str, Any]:
        body = await parse_body(request, InitWeightsUpdateGroupReqInput)
        args = body.model_dump(exclude={"rid", "http_worker_ipc"})
        return await run(lambda: sched.init_group(**args))

    @app.post("/update_weights_from_distributed")
    async def update_distributed(request: Request) -> dict[str, Any]:
        body = await parse_body(request, UpdateWeightsFromDistributedReqInput)
        body.refuse_unsupported()
        return await run(
            lambda: sched.update_from_distributed(
                names=body.names,
                dtypes=body.dtypes,
                shapes=body.shapes,
                group_name=body.group_name,
                weight_version=body.weight_version,
            )
        )

    @app.post("/update_weights_from_tensor")
    async def update_tensor(request: Request) -> dict[str, Any]:
        body = await parse_body(request, UpdateWeightsFromTensorReqInput)
        return await run(
            sched.update_from_tensor, body.serialized_named_tensors, body.load_format, body.weight_version
        )

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DestroyWeightsUpdateGroupReqInput)
        return await run(sched.destroy_group, body.group_name)

    @app.post("/update_weights_from_disk")
    async def update_disk(request: Request) -> dict[str, Any]:
        body = await parse_body(request, UpdateWeightFromDiskReqInput)
        return await run(sched.update_from_disk, body.model_path, body.weight_version)

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(request: Request) -> JSONResponse:
        body = await parse_body(request, CheckWeightsReqInput)
        if body.rank is not None and not 0 <= body.rank < ctx.par.tp:
            raise ValueError(f"rank {body.rank} is outside the engine's ranks [0, {ctx.par.tp})")
        skip = tuple(body.skip_tensor_list or ())
        per_rank = await run(sched.check_weights, body.action, body.seed, body.allow_quant_error, skip)
        return checker_response(body.action, per_rank, body.rank)

    return app
