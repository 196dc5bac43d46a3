"""The engine's HTTP API on rank 0 (FastAPI): sglang's endpoints, request bodies and answers.

Handlers are thin: parse the body (:mod:`weightsync.engine.io_struct`, ``/generate``'s
:mod:`weightsync.engine.io_generate`), hand the work from a
worker thread (``asyncio.to_thread``, so the event loop never blocks on the model or on a
collective) to the :class:`~weightsync.engine.scheduler.Scheduler` (generation) or the
:class:`~weightsync.engine.session.UpdateSessions` (pause, continue and every weight call), shape
the answer. The state machine is :data:`weightsync.engine.states.TRANSITIONS`.

Status codes and error bodies follow sglang (``entrypoints/http_server.py``):

* a body that does not validate (malformed JSON, wrong type, bad ``Literal``, missing field, a
  field sglang does not have) -> 400 ``{"object": "error", "message", "type": "Bad Request",
  "param": null, "code": 400}``;
* ``/generate`` refusing a valid body (bad token ids, too long ...) -> 400 ``{"error": {"message"}}``;
* the weight and control routes -> ``{"success": false, "message"}``: 400 for a refused request,
  409 when it conflicts with the engine's state (an update while generating, continue while the
  weights are dirty: sglang would wait instead), 500 for an engine fault on some rank;
* ``/remote_instance_transfer_engine_info`` and ``/parallelism_config`` with a missing or unknown
  rank -> 400 ``{"error": {"message"}}``; ``/flush_cache`` answers text;
* a weight write outside ``begin_weight_update ... end_weight_update`` -> 400 (sglang 0.5.23's
  rule); generation while the weights are dirty outside an update, on a faulted or stopping
  engine -> 503; a full queue -> 429; a body over ``max_request_bytes`` (a ``/generate`` body longer
  than its queue's prompts at the context length could be), or more generations than the queue
  takes -> 413, before the body is read or anything is built for it; no room in the budget of
  bodies parsed at once within its wait -> 503; a bounded wait that expired -> 504; a ``/generate``
  not answered within ``request_timeout_s`` -> 503 (the request is aborted). No answer carries a
  traceback (they are logged).

Access: with a token (:attr:`ServerContext.token`) every route but ``/health`` needs
``Authorization: Bearer <token>`` (401 without, 403 with another; compared in constant time).
``/docs`` and ``/openapi.json`` exist only with ``api_docs``.

Typical usage::

    app = build_app(ServerContext(sessions=sessions, tokenizer=tok, server_info={...}, par=par))
    uvicorn.run(app, host="127.0.0.1", port=30000)
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from weightsync.engine.control import RankError
from weightsync.engine.donor import Donor
from weightsync.engine.http_answers import checker_response, parallelism_config
from weightsync.engine.http_body import DEFAULT_MAX_REQUEST_BYTES, B, BadBody, BodyBudget, Busy, parse_body
from weightsync.engine.io_base import TooLarge
from weightsync.engine.io_generate import GenerateReqInput, to_gen_requests, to_response
from weightsync.engine.io_struct import (
    AbortReq,
    AbortWeightUpdateReqInput,
    BeginWeightUpdateReqInput,
    CheckWeightsReqInput,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    FlushCacheReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from weightsync.engine.join import Joiner
from weightsync.engine.live_check import LiveCheck
from weightsync.engine.peer_io import DonateWeightsReqInput, JoinFromPeerReqInput, MarkStaleReqInput
from weightsync.engine.scheduler import EngineTimeout, QueueFull, Unavailable
from weightsync.engine.session import UpdateSessions
from weightsync.engine.session_resources import GroupError
from weightsync.engine.states import Conflict
from weightsync.engine.tokenizer import Tokenizer
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
    "/abort_weight_update",
    "/update_weight_version",
    "/get_weight_version",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/destroy_weights_update_group",
    "/update_weights_from_disk",
    "/weights_checker",
    "/live_weights_check",
    "/mark_stale",
    "/join_from_peer",
    "/donate_weights",
    "/release_memory_occupation",
    "/resume_memory_occupation",
)
"""Every route the app serves (pinned by a surface test)."""
ERROR_BODY_ROUTES = ("/generate", "/release_memory_occupation", "/resume_memory_occupation")
"""Routes whose refusals are ``{"error": {"message"}}`` (the others: ``{"success": false, "message"}``)."""
OPEN_ROUTES = ("/health",)
"""Routes answered without the token (liveness probes)."""
SESSION_HEADER = "x-weightsync-session"
"""A call that carries it must belong to the engine's current update session."""
DEFAULT_REQUEST_TIMEOUT_S = 600.0
GENERATE_BYTES_PER_TOKEN = 32
"""More JSON bytes than a valid ``/generate`` body spends per prompt token (an id and its comma; a
text token's characters, escaped)."""



@dataclass(frozen=True, kw_only=True, slots=True)
class ServerContext:
    sessions: UpdateSessions
    """The engine's update sessions (its state; ``sessions.scheduler`` generates)."""
    tokenizer: Tokenizer
    par: RolloutParallel
    server_info: dict[str, Any]
    """Static facts for ``/server_info``: sglang's ``ServerArgs`` fields with this engine's values."""
    publish_descriptor: bool = True
    """Add weightsync's transport descriptor to the transfer-engine info (an extension); False
    publishes exactly sglang's ``[session_id, weights_info]``."""
    token: str | None = dataclasses.field(default=None, repr=False)
    """Required (``Authorization: Bearer``) on every route but ``/health``; None: no check."""
    api_docs: bool = False
    """Serve ``/docs`` and ``/openapi.json``."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Bodies larger than this are refused (413)."""
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    """A ``/generate`` not answered within this long is aborted (503)."""
    live_check: LiveCheck | None = None
    """The check of the served weights against their publication (``/live_weights_check``); None: off."""
    parse_budget_bytes: int | None = None
    """Bytes of bodies read and parsed at once (:class:`~weightsync.engine.http_body.BodyBudget`);
    None: ``max_request_bytes``."""
    joiner: Joiner | None = None
    """Copies the fleet's version from a peer (``/join_from_peer``); None: the route refuses."""
    donor: Donor | None = None
    """Copies this engine's served weights into a joiner (``/donate_weights``); None: the route refuses."""



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


ERROR_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (ValueError, 400),
    (TooLarge, 413),
    (Conflict, Conflict.http_status),
    (QueueFull, QueueFull.http_status),
    (Unavailable, Unavailable.http_status),
    (EngineTimeout, EngineTimeout.http_status),
    (Busy, Busy.http_status),
)
"""Refusals by exception type (the most specific class wins) and their HTTP status."""


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


class _Guard:
    """A plain ASGI middleware that answers ``check``'s refusal instead of running the route.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` runs
    every request through a task group and memory streams, a fixed cost on each control call of
    an update (measured on the 2-core machine: 0.84 ms per request without it, 1.37 ms with it).
    """

    def __init__(self, app: Any, check: Callable[[Request], Response | None]) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = self.check(Request(scope))
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(ctx: ServerContext) -> FastAPI:
    """The FastAPI app serving one engine (see the module docstring)."""
    docs = {} if ctx.api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="weightsync rollout engine", **docs)
    sessions, tok = ctx.sessions, ctx.tokenizer
    sched = sessions.scheduler
    limit = ctx.max_request_bytes
    # no valid /generate is longer than its tokens can be (the queue's prompts at the context length)
    generate_limit = min(limit, sched.max_queued_requests * sched.spec.max_position_embeddings
                         * GENERATE_BYTES_PER_TOKEN + (1 << 20))
    budget = BodyBudget(ctx.parse_budget_bytes or limit)

    def control(status: int, message: str) -> JSONResponse:
        return JSONResponse({"success": False, "message": message}, status_code=status)

    def refusal(request: Request, status: int, message: str) -> JSONResponse:
        """The error body of ``request``'s route: ``/generate``'s and the memory routes' (sglang's
        ``_create_error_response``), or the control routes'."""
        if request.url.path in ERROR_BODY_ROUTES:
            return JSONResponse({"error": {"message": message}}, status_code=status)
        return control(status, message)

    def guard(request: Request) -> Response | None:
        """The refusal of a request before its route runs (token, declared size), or None."""
        if ctx.token is not None and request.url.path not in OPEN_ROUTES:
            given = _bearer(request)
            if given is None:
                return _error_response(401, "this engine needs its token: send 'Authorization: Bearer <token>'")
            if not hmac.compare_digest(given.encode(), ctx.token.encode()):
                return _error_response(403, "wrong token")
        declared = request.headers.get("content-length", "")
        most = generate_limit if request.url.path == "/generate" else limit
        if declared.isdigit() and int(declared) > most:
            return refusal(request, 413, f"request body of {declared} bytes is over the engine's limit of {most}"
                           + (" for /generate (its queue's prompts at the context length)" if most < limit else ""))
        return None

    app.add_middleware(_Guard, check=guard)

    @app.exception_handler(BadBody)
    async def _bad_body(_: Request, exc: BadBody) -> JSONResponse:
        return _error_response(400, str(exc))

    @app.exception_handler(RouteError)
    async def _route_error(_: Request, exc: RouteError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    def answer_with(status: int) -> Callable[[Request, Exception], Any]:
        async def handle(request: Request, exc: Exception) -> JSONResponse:
            return refusal(request, status, str(exc))

        return handle

    for exc_type, status in ERROR_STATUS:
        app.add_exception_handler(exc_type, answer_with(status))

    @app.exception_handler(GroupError)
    async def _group_error(_: Request, exc: GroupError) -> JSONResponse:
        return control(400, f"Failed to initialize custom process group: {exc}")

    @app.exception_handler(RankError)
    async def _rank_error(request: Request, exc: RankError) -> JSONResponse:
        return refusal(request, 400 if exc.user_error else 500, f"{exc.op}: {exc}")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return refusal(request, 500, f"internal error: {type(exc).__name__}: {exc}")

    async def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def body_of(request: Request, model: type[B]) -> B:
        return await parse_body(request, model, generate_limit if model is GenerateReqInput else limit, budget)

    def session_of(request: Request) -> str | None:
        return request.headers.get(SESSION_HEADER) or None

    # -- generation --------------------------------------------------------------------------

    # one route per method: FastAPI gives every method of one multi-method route the same operation id
    @app.post("/generate")
    @app.put("/generate")
    async def generate(request: Request) -> Any:
        body = await body_of(request, GenerateReqInput)
        t0 = time.perf_counter()
        reqs, is_batch, sps = await run(to_gen_requests, body, sched.spec, tok, sched.max_queued_requests)
        futures = sched.submit(reqs)
        try:
            done = await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)),
                                          timeout=ctx.request_timeout_s)
        except TimeoutError:
            for r, f in zip(reqs, futures):
                if f.cancelled() or not f.done():  # a queued one was cancelled by the timeout: drop it too
                    await run(sched.abort_request, r.rid, False, "deadline")
            state = sessions.status()["state"]
            raise Unavailable(f"request not answered within {ctx.request_timeout_s:.0f} s (the engine is {state}); "
                              f"it was aborted") from None
        failed = [res.finish_reason["message"] for res, _ in done
                  if res.finish_reason and res.finish_reason.get("status_code")]
        if failed:
            return JSONResponse({"error": {"message": "; ".join(dict.fromkeys(failed))}}, status_code=500)
        latency = time.perf_counter() - t0
        out = [to_response(r, res, v, tok, latency, body, sp) for r, (res, v), sp in zip(reqs, done, sps)]
        if body.stream:
            chunks = [f"data: {json.dumps(o)}\n\n" for o in out] + ["data: [DONE]\n\n"]
            return StreamingResponse(iter(chunks), media_type="text/event-stream")
        return out if is_batch else out[0]

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, state = sessions.liveness()
        return JSONResponse(state, status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        ok, why = await run(sched.health_check, HEALTH_CHECK_TIMEOUT_S)
        if not ok:
            logger.warning("health check failed: %s", why)
        return Response(status_code=200 if ok else 503)

    @app.post("/pause_generation")
    async def pause(request: Request) -> dict[str, Any]:
        body = await body_of(request, PauseGenerationReqInput)
        return await run(sessions.pause, body.mode)

    @app.post("/continue_generation")
    async def resume(request: Request) -> dict[str, Any]:
        await body_of(request, ContinueGenerationReqInput)
        return await run(sessions.resume)

    @app.get("/flush_cache")
    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        if request.method == "POST":
            await body_of(request, FlushCacheReqInput)
        if sched.flush_cache():
            return PlainTextResponse(
                "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n"
            )
        return PlainTextResponse("Flush cache failed: a batch is running.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await body_of(request, AbortReq)
        await run(sched.abort_request, body.rid, body.abort_all, body.abort_message)
        return {"status": "ok"}

    # -- information -------------------------------------------------------------------------

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        # last_join: the outcome of this engine's last join from a peer (its peer, version, timings)
        last_join = ctx.joiner.last if ctx.joiner is not None else None
        return {**ctx.server_info, "internal_states": [{**sessions.status(), "last_join": last_join}]}

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
            "weight_version": sessions.weight_version,
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
        return {"weight_version": sessions.weight_version}

    @app.get("/parallelism_config")
    async def parallelism(request: Request) -> dict[str, int]:
        return parallelism_config(ctx.par, _rank_param(request, ctx.par))

    @app.get("/remote_instance_transfer_engine_info")
    @app.get("/get_remote_instance_transfer_engine_info")
    async def transfer_info(request: Request) -> dict[str, Any]:
        rank = _rank_param(request, ctx.par)
        info = sessions.transfer_infos[rank]
        out: dict[str, Any] = {"rank": rank, "remote_instance_transfer_engine_info": [info.session_id, info.weights]}
        if ctx.publish_descriptor:
            out["transport_descriptor"] = info.descriptor
            out["weight_copies"] = info.copies
        return out

    # -- weight updates ----------------------------------------------------------------------

    @app.post("/begin_weight_update")
    async def begin_update(request: Request) -> dict[str, Any]:
        body = await body_of(request, BeginWeightUpdateReqInput)
        return await run(sessions.begin, body.pause_free, body.flip, body.pause_generation)

    @app.post("/end_weight_update")
    async def end_update(request: Request) -> dict[str, Any]:
        body = await body_of(request, EndWeightUpdateReqInput)
        return await run(sessions.end, session_of(request), body.fingerprint_seed)

    @app.post("/abort_weight_update")
    async def abort_update(request: Request) -> dict[str, Any]:
        await body_of(request, AbortWeightUpdateReqInput)
        return await run(sessions.abort, session_of(request))

    @app.post("/update_weight_version")
    async def update_version(request: Request) -> dict[str, Any]:
        body = await body_of(request, UpdateWeightVersionReqInput)
        out = await run(sessions.set_weight_version, body.new_version, body.abort_all_requests, session_of(request),
                        body.continue_generation)
        return {
            "success": True,
            "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version,
            **out,
        }

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> dict[str, Any]:
        body = await body_of(request, InitWeightsUpdateGroupReqInput)
        args = body.model_dump(exclude={"rid", "http_worker_ipc"})
        return await run(lambda: sessions.init_group(**args))

    @app.post("/update_weights_from_distributed")
    async def update_distributed(request: Request) -> dict[str, Any]:
        body = await body_of(request, UpdateWeightsFromDistributedReqInput)
        body.refuse_unsupported()
        return await run(
            lambda: sessions.update_from_distributed(
                names=body.names,
                dtypes=body.dtypes,
                shapes=body.shapes,
                group_name=body.group_name,
                weight_version=body.weight_version,
                session_id=session_of(request),
            )
        )

    @app.post("/update_weights_from_tensor")
    async def update_tensor(request: Request) -> dict[str, Any]:
        body = await body_of(request, UpdateWeightsFromTensorReqInput)
        return await run(
            sessions.update_from_tensor, body.serialized_named_tensors, body.load_format, body.weight_version,
            session_of(request),
        )

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> dict[str, Any]:
        body = await body_of(request, DestroyWeightsUpdateGroupReqInput)
        return await run(sessions.destroy_group, body.group_name)

    @app.post("/update_weights_from_disk")
    async def update_disk(request: Request) -> dict[str, Any]:
        body = await body_of(request, UpdateWeightFromDiskReqInput)
        return await run(sessions.update_from_disk, body.model_path, body.weight_version, session_of(request))

    @app.get("/release_memory_occupation")
    @app.post("/release_memory_occupation")
    async def release_memory(request: Request) -> None:
        body = await body_of(request, ReleaseMemoryOccupationReqInput)
        await run(sessions.release_memory, body.tags)  # sglang answers 200 with a null body

    @app.get("/resume_memory_occupation")
    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request) -> None:
        body = await body_of(request, ResumeMemoryOccupationReqInput)
        await run(sessions.resume_memory, body.tags)

    @app.get("/weights_checker")
    @app.post("/weights_checker")
    async def weights_checker(request: Request) -> JSONResponse:
        body = await body_of(request, CheckWeightsReqInput)
        if body.rank is not None and not 0 <= body.rank < ctx.par.tp:
            raise ValueError(f"rank {body.rank} is outside the engine's ranks [0, {ctx.par.tp})")
        skip = tuple(body.skip_tensor_list or ())
        per_rank = await run(sessions.check_weights, body.action, body.seed, body.allow_quant_error, skip)
        return checker_response(body.action, per_rank, body.rank)

    @app.get("/live_weights_check")
    @app.post("/live_weights_check")
    async def live_weights_check() -> dict[str, Any]:
        if ctx.live_check is None:
            raise ValueError("the live weights check is off (weightsync serve --live-check-interval-s SECONDS)")
        return {"success": True, **await run(ctx.live_check.check)}
    # -- the fleet (extensions) ----------------------------------------------------------------

    @app.post("/mark_stale")
    async def mark_stale(request: Request) -> dict[str, Any]:
        body = await body_of(request, MarkStaleReqInput)
        return {"success": True, **await run(sessions.mark_stale, body.published_version)}

    @app.post("/join_from_peer")
    async def join_from_peer(request: Request) -> JSONResponse:
        body = await body_of(request, JoinFromPeerReqInput)
        if ctx.joiner is None:
            raise ValueError("this engine cannot join from a peer (no joiner configured)")
        ctx.joiner.check()
        await run(sessions.start_join, f"joining: asking {body.peers[0]} for its version")
        ctx.joiner.start(body.peers)
        if not body.wait:
            return JSONResponse({"success": True, "state": "joining", "message": f"joining from {body.peers}"})
        out = await run(ctx.joiner.wait)
        if out is None or not out["success"]:
            return control(503, f"join failed: {sessions.status()['reason']}")
        return JSONResponse({**out, "state": sessions.status()["state"]})

    @app.post("/donate_weights")
    async def donate_weights(request: Request) -> dict[str, Any]:
        body = await body_of(request, DonateWeightsReqInput)
        if ctx.donor is None:
            raise ValueError("this engine cannot give its weights to a peer (no donor configured)")
        return await run(ctx.donor.donate, body)

    return app
