"""The built-in engine's server (``weightsync serve``): one process per rank, HTTP on rank 0.

Rank 0 is this process: it spawns ranks ``1 .. tp-1`` (``multiprocessing`` spawn), joins the
engine's process group with them (gloo on CPU, NCCL on CUDA; ``tcp://127.0.0.1`` rendezvous,
one host), every rank allocates and loads its own parameters, and rank 0 serves HTTP and drives
the others (:mod:`weightsync.engine.control`). Ctrl-C (or SIGTERM) stops the server, releases
the workers and tears the process group down (exit status 0); ranks > 0 die with rank 0 if it is
killed outright (Linux ``PR_SET_PDEATHSIG``), and rank 0 ends the engine (exit status 1) if a rank
process dies, since it cannot leave a collective with a dead peer.

Typical usage::

    weightsync serve Qwen3-30B-A3B --scale tiny --tp 2 --ep 2 --port 30000
    curl -s localhost:30000/generate -H 'Content-Type: application/json' \\
        -d '{"text": "hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from weightsync.engine.config import ServeConfig
from weightsync.proc import die_with_parent, free_port

logger = logging.getLogger(__name__)

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
    port = cfg.dist_port if cfg.dist_port is not None else free_port()
    procs = []
    if par.tp > 1:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_worker_main, args=(cfg, r, port), name=f"engine-rank{r}", daemon=True)
            for r in range(1, par.tp)
        ]
        for p in procs:
            p.start()
    watching = threading.Event()
    if procs:
        watching.set()
        threading.Thread(target=_watch_workers, args=(procs, watching), name="rank-watchdog", daemon=True).start()
    engine = build_rank(cfg, spec, par, 0, port)
    try:
        _serve(cfg, engine, par, log_level, watching)
    finally:
        finish_rank(engine)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                logger.warning("engine rank process %s did not exit; terminating it", p.name)
                p.terminate()
    return 0


def _watch_workers(procs: list[Any], watching: threading.Event) -> None:
    """Rank 0 cannot leave a collective whose peer died: end the whole engine instead.

    Runs until ``watching`` is cleared (just before a normal shutdown releases the workers).
    """
    while watching.is_set():
        for p in procs:
            if p.exitcode is not None and watching.is_set():
                logger.error("engine rank process %s exited (code %s); stopping the engine", p.name, p.exitcode)
                logging.shutdown()
                os._exit(1)
        time.sleep(0.5)


def _worker_main(cfg: ServeConfig, rank: int, port: int) -> None:
    """Entry point of ranks > 0 (a spawned process)."""
    from weightsync.engine.bootstrap import build_rank, check_config, finish_rank
    from weightsync.engine.control import worker_loop

    die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    spec, par = check_config(cfg)
    engine = build_rank(cfg, spec, par, rank, port)
    try:
        worker_loop(engine)
    finally:
        finish_rank(engine)


def _serve(cfg: ServeConfig, engine: Any, par: Any, log_level: str, watching: threading.Event) -> None:
    import uvicorn

    from weightsync.engine.control import Driver, Op
    from weightsync.engine.http_api import ServerContext, build_app
    from weightsync.engine.scheduler import Scheduler
    from weightsync.engine.tokenizer import load_tokenizer
    from weightsync.models.checkpoint import hf_config_dict

    driver = Driver(engine)
    sched = Scheduler(
        driver,
        transfer_infos=driver.run(Op.TRANSFER_INFO),
        max_batch_size=cfg.max_batch_size,
        weight_version=cfg.weight_version,
    )
    tokenizer = load_tokenizer(engine.spec.vocab_size, cfg.checkpoint)
    engine.eos_token_ids = tokenizer.eos_token_ids
    engine.decode = tokenizer.decode
    config_dir = None
    if cfg.checkpoint is None:
        # sglang's model_path always names a directory with the model's config.json (dummy
        # weights too): readers such as miles' ServerArgs(**server_info) resolve it
        config_dir = tempfile.mkdtemp(prefix=f"weightsync-{cfg.model}-config-")
        (Path(config_dir) / "config.json").write_text(json.dumps(hf_config_dict(engine.spec), indent=1))
    info = server_info(cfg, engine.spec, par, model_path=cfg.checkpoint or config_dir, tokenizer=tokenizer.name)
    sched.start()
    try:
        server = uvicorn.Server(
            uvicorn.Config(
                build_app(
                    ServerContext(
                        scheduler=sched,
                        tokenizer=tokenizer,
                        par=par,
                        server_info=info,
                        publish_descriptor=cfg.transfer_info_format == "weightsync",
                    )
                ),
                host=cfg.host,
                port=cfg.port,
                log_level=log_level,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            )
        )
        logger.info(
            "serving %s (scale %s, tp %d dp %d ep %d%s%s, %s) on http://%s:%d",
            cfg.model,
            cfg.scale,
            par.tp,
            par.dp,
            par.ep,
            ", moe-dense-tp 1" if par.moe_dense_tp == 1 else "",
            ", dp-lm-head" if par.dp_lm_head else "",
            cfg.device,
            cfg.host,
            cfg.port,
        )
        server.run()
    finally:
        watching.clear()  # the workers leave now, on purpose
        sched.stop()
        if config_dir is not None:
            shutil.rmtree(config_dir, ignore_errors=True)


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
        "remote_instance_weight_loader_start_seed_via_transfer_engine": cfg.transport == "mooncake",
        "status": "ready",
        "max_total_num_tokens": cfg.max_batch_size * context,
        "max_req_input_len": context - 1,
        "startup_time": time.time(),
        "version": release,
        "weightsync": {
            "model": cfg.model,
            "scale": cfg.scale,
            "transport": cfg.transport,
            "transfer_info_format": cfg.transfer_info_format,
            "tokenizer": tokenizer,
            "vocab_size": spec.vocab_size,
            "compute_dtype": cfg.compute_dtype,
            "model_type": spec.hf_model_type,
            "architectures": [spec.hf_architecture],
            "pid": os.getpid(),
        },
    }
