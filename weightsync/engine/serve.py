"""The built-in engine's server (``weightsync serve``): one process per rank, HTTP on rank 0.

Rank 0 is this process: it spawns ranks ``1 .. tp-1`` (``multiprocessing`` spawn), joins the
engine's process group with them (gloo on CPU, NCCL on CUDA; a rendezvous on 127.0.0.1, one
host), every rank allocates and loads its own parameters, and rank 0 serves HTTP and drives
the others (:mod:`weightsync.engine.control`).

Processes: Ctrl-C (or SIGTERM) stops the server, releases the workers and tears the process group
down (exit status 0); ranks > 0 leave when rank 0 is killed outright (a thread notices it within
half a second, SIGTERM by ``PR_SET_PDEATHSIG`` too), removing their own and rank 0's shm
segments first; rank 0 ends the engine (exit status 1) if a rank process dies, or stays stopped
(SIGSTOP) longer than a collective may wait, since it cannot leave a collective with such a
peer, removing what its own and the ranks' registrations leave behind first (shm segments;
``Transport.remove_leftovers``). With
``die_with_parent`` the engine gets SIGTERM when the process that started it dies (a launcher
killed with SIGKILL included) and stops as on Ctrl-C. At start-up, leftovers of this project's
transports and configuration directories whose owner process is gone are removed.

Typical usage::

    weightsync serve Qwen3-30B-A3B --scale tiny --tp 2 --ep 2 --port 30000
    curl -s localhost:30000/generate -H 'Content-Type: application/json' \\
        -d '{"text": "hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from weightsync.engine.config import ServeConfig
from weightsync.layout.sglang_options import layout_options
from weightsync.models.resolve import describe_model
from weightsync.proc import (
    die_with_parent,
    end_child,
    free_port,
    owned_temp_dir,
    process_state,
    remove_stale_temp_dirs,
)
from weightsync.sync.update_options import CONTROL_EXTENSIONS
from weightsync.transport.config import NONE
from weightsync.transport.net import is_loopback
from weightsync.transport.registry import remove_leftovers

logger = logging.getLogger(__name__)

CONFIG_DIR_PREFIX = "weightsync-config"
"""The temporary directory holding a dummy-weights engine's ``config.json`` (sglang's model_path)."""
GRACEFUL_SHUTDOWN_S = 5
"""On stop, requests still waiting after this long (e.g. queued behind a pause) are cancelled."""


def run_server(cfg: ServeConfig, log_level: str = "info") -> int:
    """Start every rank, serve HTTP on this process until stopped, then tear down.

    Returns:
        0 on a clean stop.

    Raises:
        ValueError: bad configuration or a checkpoint that does not match the model (before any
            process is started).
    """
    import multiprocessing as mp

    from weightsync.engine.bootstrap import build_rank, check_config, finish_rank
    from weightsync.engine.loader import validate_checkpoint
    from weightsync.models.checkpoint import HFCheckpoint

    spec, par = check_config(cfg)
    if cfg.checkpoint is not None:
        with HFCheckpoint(cfg.checkpoint) as ckpt:
            validate_checkpoint(spec, ckpt)
    if cfg.die_with_parent:
        die_with_parent(signal.SIGTERM)
    stale = remove_leftovers() + remove_stale_temp_dirs(CONFIG_DIR_PREFIX)
    if stale:
        logger.info("removed %d leftover(s) of processes that are gone: %s", len(stale), ", ".join(stale))
    port = cfg.dist_port if cfg.dist_port is not None else free_port()
    procs = []
    ctx = mp.get_context("spawn")
    cancel = ctx.RawValue("q", 0)  # rank 0 ends every rank's broadcast receive (BroadcastReceiver.cancel)
    if par.tp > 1:
        procs = [
            ctx.Process(target=_worker_main, args=(cfg, spec, par, r, port, cancel), name=f"engine-rank{r}",
                        daemon=True)
            for r in range(1, par.tp)
        ]
        for p in procs:
            p.start()
    watching = threading.Event()
    if procs:
        watching.set()
        threading.Thread(target=_watch_workers, args=(procs, watching, cfg.collective_timeout_s), name="rank-watchdog",
                         daemon=True).start()
    clean = True
    try:
        engine = build_rank(cfg, spec, par, 0, port, cancel=cancel)
        try:
            clean = _serve(cfg, engine, par, log_level, watching)
        finally:
            if clean:
                finish_rank(engine)
    finally:
        watching.clear()
        _end_workers(procs, grace_s=30 if clean else 2)
    if not clean:
        logging.shutdown()
        os._exit(1)  # the driver thread is stuck in a collective: no orderly teardown is possible
    return 0


def _end_workers(procs: list[Any], grace_s: float) -> None:
    """Wait for the rank processes (``grace_s`` in all), end the ones left (SIGTERM, then SIGKILL),
    and remove the transport leftovers they could not (a rank killed mid-collective leaves its shm
    segments)."""
    end = time.monotonic() + grace_s
    for p in procs:
        end_child(p, max(end - time.monotonic(), 0.1))
    left = remove_leftovers({p.pid for p in procs if p.pid is not None and not p.is_alive()})
    if left:
        logger.info("removed %d transport leftover(s) of the engine's ranks: %s", len(left), ", ".join(left))


def _watch_workers(procs: list[Any], watching: threading.Event, stopped_grace_s: float) -> None:
    """Rank 0 cannot leave a collective whose peer died: end the whole engine instead, after
    removing the transport leftovers of every rank (its own included; shm mappings stay valid).
    A rank process stopped (SIGSTOP; not a debugger's stop) for longer than a collective may wait,
    ``stopped_grace_s``, ends it the same way: every collective with it would time out.

    Runs until ``watching`` is cleared (just before a normal shutdown releases the workers).
    """
    stopped_since: dict[int, float] = {}
    while watching.is_set():
        for p in procs:
            why = ""
            if p.exitcode is not None:
                why = f"exited (code {p.exitcode})"
            elif process_state(p.pid) == "T":
                since = stopped_since.setdefault(p.pid, time.monotonic())
                if time.monotonic() - since > stopped_grace_s:
                    why = f"is stopped (SIGSTOP) for more than {stopped_grace_s:.0f} s"
            else:
                stopped_since.pop(p.pid, None)
            if why and watching.is_set():
                logger.error("engine rank process %s %s; stopping the engine", p.name, why)
                for other in procs:
                    if other.exitcode is None:
                        other.kill()
                        other.join(timeout=5)
                remove_leftovers({os.getpid(), *(q.pid for q in procs if q.pid is not None)})
                logging.shutdown()
                os._exit(1)
        time.sleep(0.2)


def _leave(parent: int) -> None:
    """A rank > 0 whose rank 0 is gone (or that was told to stop): remove its own transport
    leftovers and, when rank 0 is gone, rank 0's (a killed rank 0 removes nothing), then exit."""
    gone = {parent} if os.getppid() != parent else set()
    remove_leftovers({os.getpid(), *gone})
    os._exit(1)


def _watch_parent(parent: int) -> None:
    """Ranks > 0: notice within half a second that rank 0 died (its process gone: reparented), even
    while the main thread waits in a collective, and leave (:func:`_leave`)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    logger.error("engine rank 0 (pid %d) is gone; removing its and this rank's leftovers", parent)
    _leave(parent)


def _worker_main(cfg: ServeConfig, spec: Any, par: Any, rank: int, port: int, cancel: Any) -> None:
    """Entry point of ranks > 0 (a spawned process), with rank 0's checked model and layout."""
    from weightsync.engine.bootstrap import build_rank, finish_rank
    from weightsync.engine.control import worker_loop

    parent = os.getppid()
    # rank 0's death (a SIGKILL included) is noticed by a thread and by SIGTERM (PR_SET_PDEATHSIG),
    # and both clean up; a SIGKILL would leave this rank's shm segments and rank 0's behind. While
    # rank 0 lives, it stops this rank in order (a SIGTERM to the whole group, Ctrl-C's way, waits).
    signal.signal(signal.SIGTERM, lambda *_: _leave(parent) if os.getppid() != parent else None)
    die_with_parent(signal.SIGTERM)
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    engine = build_rank(cfg, spec, par, rank, port, cancel=cancel)
    try:
        worker_loop(engine)
    finally:
        finish_rank(engine)


def _serve(cfg: ServeConfig, engine: Any, par: Any, log_level: str, watching: threading.Event) -> bool:
    """Serve until stopped; False when the driver could not be stopped (stuck)."""
    import uvicorn

    from weightsync.engine.bootstrap import transport_config
    from weightsync.engine.control import Driver, Op
    from weightsync.engine.donor import Donor
    from weightsync.engine.http_api import ServerContext, build_app
    from weightsync.engine.http_guard import ACCEPT_BACKLOG, ConnectionGuard, StoppingServer, connection_cap
    from weightsync.engine.join import Joiner
    from weightsync.engine.live_check import LiveCheck
    from weightsync.engine.scheduler import Scheduler
    from weightsync.engine.session import UpdateSessions
    from weightsync.engine.tokenizer import load_tokenizer
    from weightsync.models.checkpoint import hf_config_dict

    driver = Driver(engine)
    sched = Scheduler(
        driver,
        max_batch_size=cfg.max_batch_size,
        max_queued_requests=cfg.max_queued_requests,
        stop_timeout_s=cfg.collective_timeout_s + 60.0,
        job_timeout_s=max(3 * cfg.collective_timeout_s, cfg.group_timeout_s) + 60.0,
    )
    infos = driver.run(Op.TRANSFER_INFO)
    joining = f"joining: asking {cfg.join_from[0]} for its version" if cfg.join_from else None
    sessions = UpdateSessions(sched, transfer_infos=infos, weight_version=cfg.weight_version,
                              group_timeout_s=cfg.group_timeout_s, in_flight_at_flip=cfg.in_flight_at_flip,
                              joining=joining)
    joiner = Joiner(sessions, token=cfg.token, deadline_s=cfg.join_deadline_s)
    tokenizer = load_tokenizer(engine.spec.vocab_size, cfg.checkpoint)
    engine.eos_token_ids = tokenizer.eos_token_ids
    engine.decode = tokenizer.decode
    config_dir = None
    if cfg.checkpoint is None:
        # sglang's model_path always names a directory with the model's config.json (dummy
        # weights too): readers such as miles' ServerArgs(**server_info) resolve it
        config_dir = str(owned_temp_dir(CONFIG_DIR_PREFIX))  # a killed engine's is removed by the next one
        (Path(config_dir) / "config.json").write_text(json.dumps(hf_config_dict(engine.spec), indent=1))
    info = server_info(cfg, engine.spec, par, model_path=cfg.checkpoint or config_dir, tokenizer=tokenizer.name)
    info["weightsync"]["shadow"] = {"pause_free": sessions.shadow, "ranks": [i.shadow for i in infos],
                                    "in_flight_at_flip": cfg.in_flight_at_flip}
    guard = ConnectionGuard(max_connections=connection_cap(cfg.max_connections), header_timeout_s=cfg.header_timeout_s,
                            body_timeout_s=cfg.body_timeout_s)
    if guard.max_connections < cfg.max_connections:
        logger.info("at most %d HTTP connections (the descriptor limit leaves no room for %d)", guard.max_connections,
                    cfg.max_connections)
    live = LiveCheck(sessions, interval_s=cfg.live_check_s) if cfg.live_check_s > 0 else None
    sched.start()
    if live is not None:
        live.start()
    if cfg.join_from:
        joiner.start(cfg.join_from)
    try:
        server = StoppingServer(sched,
            uvicorn.Config(
                build_app(
                    ServerContext(
                        sessions=sessions,
                        tokenizer=tokenizer,
                        par=par,
                        server_info=info,
                        publish_descriptor=cfg.transfer_info_format == "weightsync",
                        token=cfg.token,
                        api_docs=cfg.api_docs,
                        max_request_bytes=cfg.max_request_bytes,
                        request_timeout_s=cfg.request_timeout_s,
                        live_check=live,
                        joiner=joiner,
                        donor=Donor(sessions, transport_config(cfg)),
                    )
                ),
                host=cfg.host,
                port=cfg.port,
                log_level=log_level,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                http=guard.protocol(),
                backlog=ACCEPT_BACKLOG,
            )
        )
        logger.info(
            "serving %s%s (tp %d dp %d ep %d%s%s, %s) on http://%s:%d",
            describe_model(engine.spec, cfg.checkpoint),
            ", dummy weights" if cfg.load_format == "dummy" else "",
            par.tp,
            par.dp,
            par.ep,
            ", moe-dense-tp 1" if par.moe_dense_tp == 1 else "",
            ", dp-lm-head" if par.dp_lm_head else "",
            cfg.device,
            cfg.host,
            cfg.port,
        )
        _say_exposure(cfg)
        server.run()
    finally:
        watching.clear()  # the workers leave now, on purpose
        if live is not None:
            live.stop()
        clean = sched.stop()
        if config_dir is not None:
            shutil.rmtree(config_dir, ignore_errors=True)
    return clean


def _say_exposure(cfg: ServeConfig) -> None:
    """What the engine's p2p transport exposes, said at start: a transport whose peers connect to
    its ports takes writes into the served weights from any peer that reaches them, token or not."""
    if cfg.transport is None or not cfg.transport.backend.opens_ports:
        return
    kind = cfg.transport.kind.value
    if is_loopback(cfg.host):
        logger.info("the %s transport's ports take connections on the loopback interface only", kind)
        return
    logger.warning("the %s transport's ports on %s take reads and writes of the served weights from any peer that "
                   "reaches them: it has no authentication (the token guards HTTP only); keep that network private "
                   "and firewalled to the trainer hosts (docs/security.md). %s", kind, cfg.host,
                   f"The served weights are checked every {cfg.live_check_s:g} s: a write outside an update session "
                   "makes them dirty." if cfg.live_check_s > 0 else "The live weights check is off.")


def server_info(
    cfg: ServeConfig, spec: Any, par: Any, *, model_path: str | None, tokenizer: str
) -> dict[str, Any]:
    """``/server_info``: sglang's ``ServerArgs`` fields (``server_args.py``) with this engine's
    values, sglang's scheduler info, and this project's facts under ``weightsync``.

    Readers rebuild ``ServerArgs(**info)`` from the keys they know (miles) or compare fields one
    by one (miles' external-engine check, this project's run): every value here is true.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("weightsync")
    except PackageNotFoundError:  # run from a source tree that is not installed
        release = "unknown"
    context = spec.max_position_embeddings
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "served_model_name": cfg.model,
        "load_format": cfg.load_format,
        "dtype": spec.dtype,
        "quantization": "fp8" if spec.fp8_block is not None else None,
        "trust_remote_code": False,
        "context_length": context,
        "device": cfg.device,
        "host": cfg.host,
        "port": cfg.port,
        "nnodes": 1,
        "node_rank": 0,
        "dist_init_addr": None,
        "nccl_port": None,
        "base_gpu_id": 0,
        "gpu_id_step": 1,
        "tp_size": par.tp,
        "dp_size": par.dp,
        "pp_size": 1,
        "ep_size": par.ep,
        "enable_dp_attention": par.dp > 1,
        "enable_dp_lm_head": par.dp_lm_head,
        "moe_dense_tp_size": par.moe_dense_tp,
        "disable_shared_experts_fusion": par.shared_experts_fusion is False,
        "enforce_shared_experts_fusion": par.shared_experts_fusion is True,
        "ep_num_redundant_experts": 0,
        "random_seed": cfg.seed,
        "weight_version": cfg.weight_version,
        "max_running_requests": cfg.max_batch_size,
        "skip_server_warmup": True,
        "enable_memory_saver": False,
        "rl_quant_profile": None,
        "disaggregation_mode": "null",
        "enable_return_routed_experts": False,
        "enable_return_indexer_topk": False,
        "engine_info_bootstrap_port": None,
        "remote_instance_weight_loader_start_seed_via_transfer_engine": (
            cfg.transport is not None and cfg.transport.backend.sglang_native),
        "status": "ready",
        "max_total_num_tokens": cfg.max_batch_size * context,
        "max_req_input_len": context - 1,
        "startup_time": time.time(),
        "version": release,
        "weightsync": {
            "model": cfg.model,
            "scale": cfg.scale,
            "transport": cfg.transport.kind.value if cfg.transport is not None else NONE,
            "transfer_info_format": cfg.transfer_info_format,
            "tokenizer": tokenizer,
            "vocab_size": spec.vocab_size,
            "compute_dtype": cfg.compute_dtype,
            "model_type": spec.hf_model_type,
            "architectures": [spec.hf_architecture],
            "layout_options": dataclasses.asdict(layout_options(spec, par)),
            "pid": os.getpid(),
            "control_extensions": list(CONTROL_EXTENSIONS),
        },
    }
