"""``weightsync serve``: start the built-in rollout engine, one process per rank, HTTP on rank 0.

Rank 0 is this process: it spawns ranks ``1 .. tp-1`` (``multiprocessing`` spawn), joins the
engine's process group with them (gloo on CPU, NCCL on CUDA; ``tcp://127.0.0.1`` rendezvous,
one host), every rank allocates and loads its own parameters, and rank 0 serves HTTP and drives
the others (:mod:`weightsync.rollout.control`). Ctrl-C (or SIGTERM) stops the server, releases
the workers and tears the process group down (exit status 0); ranks > 0 die with rank 0 if it is
killed outright (Linux ``PR_SET_PDEATHSIG``), and rank 0 ends the engine (exit status 1) if a rank
process dies, since it cannot leave a collective with a dead peer.

Typical usage::

    weightsync serve Qwen3-30B-A3B --scale tiny --tp 2 --ep 2 --port 30000
    curl -s localhost:30000/generate -H 'Content-Type: application/json' \\
        -d '{"text": "hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
"""On stop, requests still waiting after this long (e.g. queued behind a pause) are cancelled."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    """Everything one engine needs; the CLI only fills it."""

    model: str
    """Registry name (``weightsync list``)."""
    scale: str = "full"
    """``full``, ``layers=N`` or ``tiny``."""
    tp: int = 1
    dp: int = 1
    """DP-attention size (1 = off)."""
    ep: int = 1
    moe_dense_tp_size: int | None = None
    """sglang ``--moe-dense-tp-size`` (only 1: dense MLP layers replicated; None: split over TP)."""
    enable_dp_lm_head: bool = False
    """sglang ``--enable-dp-lm-head``: lm_head vocab split over attention-TP instead of full TP."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (rank r uses ``cuda:r``)."""
    host: str = "127.0.0.1"
    port: int = 30000
    checkpoint: str | None = None
    """HF checkpoint directory; None with ``load_format="dummy"``."""
    load_format: str = "auto"
    """``auto`` (the checkpoint) or ``dummy`` (the seeded synthetic weights of the model)."""
    seed: int = 0
    """Seed of the dummy weights."""
    transport: str = "none"
    """p2p transport the parameters are registered with (``none``, ``shm``, ``cuda_ipc``,
    ``mooncake``); ``none`` leaves the broadcast path only."""
    mooncake_protocol: str = "tcp"
    """Mooncake protocol when ``transport="mooncake"`` (``tcp``, ``rdma``)."""
    mooncake_device: str = ""
    """RDMA device(s) for mooncake ``rdma`` (e.g. ``mlx5_0``)."""
    max_batch_size: int = 32
    weight_version: str = "default"
    dist_port: int | None = None
    """Rendezvous port of the engine's process group (None: a free one)."""
    compute_dtype: str | None = None
    """Activation dtype (None: float32 on CPU, the model's dtype on CUDA)."""
    cpu_threads: int = 1
    """torch intra-op threads per rank on CPU (tiny models are fastest on one; more oversubscribes
    a small machine running several ranks)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.load_format == "dummy" and self.checkpoint is not None:
            raise ValueError("give either --checkpoint or --load-format dummy, not both")
        if self.load_format == "auto" and self.checkpoint is None:
            raise ValueError("no --checkpoint: pass one, or --load-format dummy for synthetic weights")
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="registry model name (see `weightsync list`)")
    parser.add_argument("--scale", default="full", help="full | layers=N | tiny (default: full)")
    parser.add_argument("--tp", type=int, default=1, help="ranks (processes) of the engine")
    parser.add_argument("--dp", type=int, default=1, help="DP-attention size (1 = off)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument(
        "--moe-dense-tp-size",
        type=int,
        default=None,
        help="1: replicate dense MLP layers (MLA and GLM-4.5 models); default: split over TP",
    )
    parser.add_argument(
        "--enable-dp-lm-head",
        action="store_true",
        help="split the lm_head vocab over attention-TP instead of full TP (with --dp > 1)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=30000)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="HF checkpoint directory (safetensors + config.json)")
    src.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default=None,
        help="dummy: seeded synthetic weights instead of a checkpoint",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the dummy weights")
    parser.add_argument(
        "--transport",
        default="none",
        choices=("none", "shm", "cuda_ipc", "mooncake"),
        help="p2p transport the parameters are registered with (default: none = broadcast only)",
    )
    parser.add_argument("--mooncake-protocol", default="tcp", help="with --transport mooncake: tcp | rdma")
    parser.add_argument("--mooncake-device", default="", help="with --transport mooncake rdma: e.g. mlx5_0")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--dist-port", type=int, default=None, help="process-group rendezvous port (default: free)")
    parser.add_argument("--compute-dtype", default=None, help="activation dtype (default: float32 on cpu)")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads per rank on cpu (default: 1)")
    parser.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    load_format = args.load_format or ("auto" if args.checkpoint else "dummy")
    return ServeConfig(
        model=args.model,
        scale=args.scale,
        tp=args.tp,
        dp=args.dp,
        ep=args.ep,
        moe_dense_tp_size=args.moe_dense_tp_size,
        enable_dp_lm_head=args.enable_dp_lm_head,
        device=args.device,
        host=args.host,
        port=args.port,
        checkpoint=args.checkpoint,
        load_format=load_format,
        seed=args.seed,
        transport=args.transport,
        mooncake_protocol=args.mooncake_protocol,
        mooncake_device=args.mooncake_device,
        max_batch_size=args.max_batch_size,
        weight_version=args.weight_version,
        dist_port=args.dist_port,
        compute_dtype=args.compute_dtype,
        cpu_threads=args.cpu_threads,
    )


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn re-raises the stop signal once it has shut down: turn SIGTERM into SystemExit (as
    # Ctrl-C is a KeyboardInterrupt) so that the teardown below runs instead of a hard kill.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return run_server(config_from_args(args), log_level=args.log_level)
    except KeyboardInterrupt:
        return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent (rank 0) dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this rank may outlive rank 0", ctypes.get_errno())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_server(cfg: ServeConfig, log_level: str = "info") -> int:
    """Start every rank, serve HTTP on this process until stopped, then tear down.

    Returns:
        0 on a clean stop.

    Raises:
        ValueError: bad configuration or a checkpoint that does not match the model (before any
            process is started).
    """
    import multiprocessing as mp

    from weightsync.models.checkpoint import HFCheckpoint
    from weightsync.rollout.bootstrap import build_rank, check_config, finish_rank
    from weightsync.rollout.loader import validate_checkpoint

    spec, par = check_config(cfg)
    if cfg.checkpoint is not None:
        with HFCheckpoint(cfg.checkpoint) as ckpt:
            validate_checkpoint(spec, ckpt)
    port = cfg.dist_port if cfg.dist_port is not None else _free_port()
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
    from weightsync.rollout.bootstrap import build_rank, check_config, finish_rank
    from weightsync.rollout.control import worker_loop

    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    spec, par = check_config(cfg)
    engine = build_rank(cfg, spec, par, rank, port)
    try:
        worker_loop(engine)
    finally:
        finish_rank(engine)


def _serve(cfg: ServeConfig, engine: Any, par: Any, log_level: str, watching: threading.Event) -> None:
    import uvicorn

    from weightsync.rollout.control import Driver, Op
    from weightsync.rollout.http_api import ServerContext, build_app
    from weightsync.rollout.scheduler import Scheduler
    from weightsync.rollout.tokenizer import load_tokenizer

    driver = Driver(engine)
    sched = Scheduler(
        driver,
        transfer_infos=driver.run(Op.TRANSFER_INFO),
        max_batch_size=cfg.max_batch_size,
        weight_version=cfg.weight_version,
    )
    tokenizer = load_tokenizer(engine.spec.vocab_size, cfg.checkpoint)
    engine.eos_token_ids = tokenizer.eos_token_ids
    info = {
        **asdict(cfg),
        "model_path": cfg.checkpoint or f"dummy:{cfg.model}",
        "tokenizer": tokenizer.name,
        "vocab_size": engine.spec.vocab_size,
        "context_length": engine.spec.max_position_embeddings,
        "tp_size": par.tp,
        "dp_size": par.dp,
        "ep_size": par.ep,
        "moe_dense_tp_size": par.moe_dense_tp,
        "enable_dp_lm_head": par.dp_lm_head,
        "pid": os.getpid(),
    }
    sched.start()
    try:
        server = uvicorn.Server(
            uvicorn.Config(
                build_app(ServerContext(scheduler=sched, tokenizer=tokenizer, par=par, server_info=info)),
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
