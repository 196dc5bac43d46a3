"""``weightsync run MODEL``: train and update rollout engines every step (the reference system's ``run``).

Resolves the run from the model's profile and the machine: where the machine has the GPUs the
profile needs, the profile runs as is; otherwise ``run`` says so in one line and runs the
*embedded default*: the same family at tiny scale on CPU, trainer TP 2 and engine TP 2 (EP 2
for MoE families, DP-attention where the profile uses it). Any of ``--scale``, ``--train``,
``--rollout``, ``--device`` given, the run is the profile's parallel sizes with ``--train`` /
``--rollout`` replacing the keys they name (:func:`weightsync.models.fit.profile_sizes`, the same
as in ``prepare``, ``plan`` and ``bench``), at ``--scale`` (default full on cuda, else tiny).

Many nodes: with ``--head-ip`` (or a ``--node-rank`` above 0) a profile of several nodes runs on
that many nodes through Ray (:mod:`weightsync.launch.cluster`). Node rank 0 starts the Ray head,
waits for the other nodes, places the trainer ranks and engines on them by the profile
(:func:`weightsync.models.fit.plan_nodes`; the embedded default: trainer on node 0, one engine on
each other node) and runs the job; every other node joins, hosts what is placed on it and leaves
when the job ends. Without ``--head-ip`` on node rank 0 everything runs on this machine, as before.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from weightsync.launch.config import (
    ClusterSpec,
    Deadlines,
    EnvSettings,
    RunConfig,
    RunMode,
    env_settings,
    writable_dir,
)
from weightsync.models import list_models
from weightsync.models.fit import cuda_device_count, fit_profile, plan_nodes, profile_sizes
from weightsync.models.profiles import get_profile

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registry model name (weightsync list)")
    p.add_argument("--mode", default=RunMode.P2P.value, help="p2p (default), broadcast, or both (alternating, one run)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's rank in a multi-node run (0 = the head, which runs the job; 1.. join it)")
    p.add_argument("--head-ip", default="",
                   help="the head node's address as the other nodes reach it: run a multi-node profile on its nodes "
                        "through Ray (port WEIGHTSYNC_RAY_PORT, default 6379; the head waits "
                        "WEIGHTSYNC_NODE_TIMEOUT_S, default 300, for the nodes); without it node 0 runs alone")
    p.add_argument("--num-rollout", type=int, default=3, help="training steps, each followed by an update")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when the profile fits")
    p.add_argument("--scale", default=None, help="full | layers=N | tiny (default: the profile's or tiny)")
    p.add_argument("--train", default=None,
                   help="tp=..,pp=..,cp=..,ep=..,etp=..,world=..,dp=..,last=..,mla_rep=0|1: the run profile's sizes "
                        "with these replaced, keys not given keep the profile's (world: the profile's unless "
                        "world= or dp=; see `weightsync list`). mla_rep=1: MLA down projections whole on every TP "
                        "rank, as Megatron's TE spec; 0: split over TP, as its local spec")
    p.add_argument("--rollout", default=None,
                   help="tp=..,ep=..,dp=..,engines=..: the run profile's engine sizes with these replaced")
    p.add_argument("--transport", default="auto", help="p2p transport: auto | shm | mooncake | cuda_ipc")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--hf-checkpoint", type=Path, default=None,
                   help="HF checkpoint directory to run (its config.json gives the architecture and shapes; prepared "
                        "like `weightsync prepare --hf-checkpoint`); default: the one prepare recorded, else "
                        "synthetic weights at tiny scale")
    p.add_argument("--synthetic", action="store_true",
                   help="synthetic weights where no checkpoint is prepared, also beyond the tiny scale")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                   help="weight dtype of the trainer and the engines (default bfloat16; float32 keeps float32)")
    p.add_argument("--engine-urls", default="",
                   help="comma-separated URLs of engines already serving this run's model and layout (started "
                        "with `weightsync serve`): update them instead of starting engines; one URL per engine")
    p.add_argument("--placement", choices=("split", "colocated"), default=None,
                   help="split: trainer and engine ranks on GPUs of their own; colocated: trainer rank i and engine "
                        "rank i share GPU i (p2p over CUDA IPC within the GPU, broadcast through "
                        "/update_weights_from_tensor); default: colocated where the GPUs do not fit both, else split")
    p.add_argument("--trainer", choices=("synthetic", "megatron"), default=None,
                   help="megatron: megatron-core GRPO on the engines' rollouts (default on cuda); synthetic: a "
                        "deterministic update of every weight that learns nothing (default on cpu)")
    p.add_argument("--group-size", type=int, default=4, help="GRPO samples per prompt (megatron trainer)")
    p.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate (megatron trainer)")
    p.add_argument("--update-retries", type=int, default=0,
                   help="try a failed update (a rank's or engine's error, a checksum mismatch) again from scratch up "
                        "to N times before stopping; the engines stay paused and dirty at the old version until an "
                        "attempt verifies (default 0: stop at the first failure)")
    p.add_argument("--deadlines", default="",
                   help="KEY=SECONDS,... replacing the default deadline of each wait: "
                        + ", ".join(f"{f.name.removesuffix('_s')} ({f.default:g})" for f in fields(Deadlines)))


def resolve(args: argparse.Namespace, env: EnvSettings) -> RunConfig:
    """The run this invocation stands for; on a worker node of a multi-node run, the head's run
    (whose ``cluster`` says this node's part).

    Raises:
        ValueError: unknown model or mode, or a bad parallel layout (the message says which).
    """
    if args.model not in list_models():
        raise ValueError(f"unknown model {args.model!r}; known: {', '.join(list_models())}")
    mode = RunMode.parse(args.mode)
    deadlines = Deadlines.parse(args.deadlines)
    if args.node_rank < 0:
        raise ValueError(f"--node-rank must be >= 0, got {args.node_rank}")
    profile = get_profile(args.model)
    multi_node = profile.num_nodes > 1 and (bool(args.head_ip) or args.node_rank > 0)
    if args.node_rank > 0 and not multi_node:
        raise ValueError(f"--node-rank {args.node_rank}: {args.model}'s profile runs on one node; run it there "
                         "without --node-rank")
    num_nodes = profile.num_nodes if multi_node else 1
    explicit = any(x is not None for x in (args.scale, args.train, args.rollout, args.device))
    have = cuda_device_count()
    embedded = False
    if explicit:
        device = args.device or ("cuda" if have else "cpu")
        scale = args.scale or ("full" if device == "cuda" else "tiny")
        train, rollout = profile_sizes(args.model, args.train, args.rollout)
    else:
        fit = fit_profile(args.model, have, multi_node=multi_node)
        if fit.note and args.node_rank == 0:
            print(fit.note)
        device, scale, train, rollout, embedded = fit.device, fit.scale, fit.train, fit.rollout, fit.embedded
    urls = tuple(u.strip().rstrip("/") for u in args.engine_urls.split(",") if u.strip())
    if urls:
        rollout = replace(rollout, num_engines=len(urls))
    nodes = None
    if multi_node:
        # on CPU the trainer keeps node 0 and the engines take the others (the cross-host path); on
        # GPUs the profile's placement fills the nodes in order
        nodes = plan_nodes(train, rollout, num_nodes=num_nodes, by_role=device == "cpu",
                           gpus_per_node=profile.gpus_per_node)
    placement = args.placement or ("colocated" if device == "cuda" and not multi_node
                                   and have < train.world_size + rollout.world_size else "split")
    if placement == "colocated" and multi_node:
        raise ValueError("--placement colocated runs on one node; a multi-node run places its ranks by the profile")
    if placement == "colocated" and device == "cuda" and have < max(train.world_size, rollout.world_size):
        raise ValueError(f"colocated, this run needs {max(train.world_size, rollout.world_size)} GPUs "
                         f"(trainer rank i and engine rank i share GPU i); this machine has {have}")
    if placement == "colocated" and device == "cpu":
        print("placement colocated on CPU: trainer and engine ranks share this host's memory; p2p writes through shm "
              "(as split does: a CPU has no device to share), broadcast hands full tensors over in shared memory "
              "through /update_weights_from_tensor (the colocated path GPUs take)")
    if not multi_node and placement == "split" and device == "cuda" and have < train.world_size + rollout.world_size:
        raise ValueError(f"this run needs {train.world_size + rollout.world_size} GPUs on one node "
                         f"({train.world_size} train + {rollout.world_size} rollout); this machine has {have}"
                         + (f"; {args.model}'s profile spans {profile.num_nodes} nodes: give --head-ip (and "
                            "--node-rank on each node) to run it on them" if profile.num_nodes > 1 else "")
                         + "; --placement colocated shares the GPUs")
    cluster = (ClusterSpec(num_nodes=num_nodes, node_rank=args.node_rank, head_ip=args.head_ip, port=env.ray_port,
                           timeout_s=env.node_timeout_s, gpus=device == "cuda") if multi_node else None)
    if args.hf_checkpoint is None:  # a given checkpoint's own shapes are checked once it is read
        _check_layouts(args.model, scale, train, rollout)
    log_dir = env.log_dir or Path("logs") / f"{args.model}_{mode}_{time.strftime('%Y%m%d-%H%M%S')}"
    writable_dir(log_dir, "MILES_LOG_DIR" if env.log_dir else "the log directory")
    if env.ckpt_dir.exists() and not env.ckpt_dir.is_dir():
        raise ValueError(f"CKPT_SAVE_DIR {env.ckpt_dir} is a file, not a directory: point it at a directory")
    return RunConfig(model=args.model, scale=scale, mode=mode, device=device, train=train, rollout=rollout,
                     num_steps=args.num_rollout, env=env,
                     # every node writes its processes' logs under the head's directory, by absolute path
                     log_dir=Path(log_dir).absolute() if multi_node else Path(log_dir), transport=args.transport,
                     prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens,
                     embedded_default=embedded, engine_urls=urls, dtype=args.dtype,
                     hf_checkpoint=args.hf_checkpoint, synthetic=args.synthetic, nodes=nodes, cluster=cluster,
                     placement=placement, trainer=args.trainer or ("megatron" if device == "cuda" else "synthetic"),
                     group_size=args.group_size, lr=args.lr, update_retries=args.update_retries,
                     deadlines=deadlines)


def _check_layouts(model: str, scale: str, train: Any, rollout: Any) -> None:
    """Refuse parallel sizes the model cannot be split by (the registry's shapes at ``scale``).

    Raises:
        ValueError: naming ``--train`` or ``--rollout`` and what does not divide.
    """
    from weightsync.layout.megatron import check_trainer_config
    from weightsync.layout.sglang import check_engine_parallel
    from weightsync.models import get_model

    spec = get_model(model, scale)
    for flag, check, sizes in (("--train", check_trainer_config, train), ("--rollout", check_engine_parallel, rollout)):
        try:
            check(spec, sizes)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None


def main(args: argparse.Namespace) -> int:
    from weightsync.launch.procs import TrainerError
    from weightsync.launch.session import RunError, RunSession
    from weightsync.launch.trainer_worker import SYNTHETIC_LABEL
    from weightsync.sources.prepare import ensure_prepared, weights_label
    from weightsync.sync.engine_client import EngineError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        env = env_settings()
        cfg = resolve(args, env)
    except ValueError as exc:
        print(f"weightsync run: {exc}", file=sys.stderr)
        return 2
    if cfg.cluster is not None and cfg.cluster.node_rank > 0:
        return _worker(cfg)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        hf_dir, torch_dist_dir = ensure_prepared(cfg.model, scale=cfg.scale, ckpt_dir=env.ckpt_dir, train=cfg.train,
                                                 hf_checkpoint=cfg.hf_checkpoint, dtype=cfg.dtype,
                                                 synthetic=cfg.synthetic)
    except (ValueError, FileExistsError) as exc:  # prepare's errors name the checkpoint and what is wrong
        print(f"weightsync run: prepare: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # CKPT_SAVE_DIR not writable (a read-only mount, a file in the path, a full disk)
        print(f"weightsync run: prepare: CKPT_SAVE_DIR {env.ckpt_dir}: cannot write "
              f"{exc.filename or env.ckpt_dir} ({exc.strerror or exc}); point CKPT_SAVE_DIR at a writable directory",
              file=sys.stderr)
        return 2
    weights = weights_label(hf_dir)
    print(f"trainer: {SYNTHETIC_LABEL if cfg.trainer == 'synthetic' else 'megatron-core GRPO'}; placement "
          f"{cfg.placement}", flush=True)
    print(f"model {cfg.model} ({cfg.scale}), mode {cfg.mode}, {cfg.device}; checkpoint {hf_dir}; weights "
          f"{'SYNTHETIC (seeded random-init, not a trained model)' if weights == 'synthetic' else weights}; "
          f"logs {cfg.log_dir}", flush=True)
    try:
        # the checkpoint's own shapes against the layouts, before any process starts
        session = RunSession(cfg, hf_dir=hf_dir, torch_dist_dir=torch_dist_dir) if cfg.cluster is None else None
    except ValueError as exc:
        print(f"weightsync run: {exc}", file=sys.stderr)
        return 2
    stop_on_signals()
    try:
        if session is not None:
            summary = session.run()
        else:
            summary = _head(cfg, hf_dir.absolute(), torch_dist_dir.absolute())
    except (RunError, EngineError, TrainerError) as exc:
        # The message says what failed (a trainer rank's traceback is in its log); the launcher's
        # own stack adds nothing.
        print(f"weightsync run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: everything this run started was stopped on the way out
        print("weightsync run: interrupted; every process this run started is stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:  # the cluster's errors say what to check
        from weightsync.launch.cluster import ClusterError

        if not isinstance(exc, ClusterError):
            raise
        print(f"weightsync run: {exc}", file=sys.stderr)
        return 1
    return 0 if summary["validation_passed"] else 1


def stop_on_signals() -> None:
    """SIGTERM (and SIGHUP) end the run as Ctrl-C does: a KeyboardInterrupt in the main thread, so
    that the session's teardown stops every trainer rank and engine it started. (A SIGKILL cannot
    be caught: the children's parent-death signal ends them then.)"""
    import signal

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def _head(cfg: RunConfig, hf_dir: Path, torch_dist_dir: Path) -> dict:
    """Node rank 0 of a multi-node run: the cluster, the placement on it, the run."""
    from weightsync.launch.cluster import HeadCluster
    from weightsync.launch.placement_ray import RayPlacement
    from weightsync.launch.session import RunSession

    assert cfg.cluster is not None
    assert cfg.nodes is not None
    plan = cfg.nodes.nodes_of()
    print("placement: " + "; ".join(f"node {n}: {', '.join(what) or 'nothing'}" for n, what in plan.items()),
          flush=True)
    with HeadCluster(cfg.cluster, log_dir=cfg.log_dir, run=_job(cfg)) as cluster, cluster.guard():
        placement = RayPlacement(cluster, cfg.nodes, cfg.log_dir, gpus=cfg.device == "cuda")
        return RunSession(cfg, hf_dir=hf_dir, torch_dist_dir=torch_dist_dir, placement=placement).run()


def _job(cfg: RunConfig) -> dict[str, str]:
    """What every node of a multi-node run must agree on."""
    return {"model": cfg.model, "scale": cfg.scale, "device": cfg.device}


def _worker(cfg: RunConfig) -> int:
    """Node rank >= 1 of a multi-node run: join the head, host what it places here, leave at the end."""
    from weightsync.launch.cluster import ClusterError, run_worker

    assert cfg.cluster is not None
    assert cfg.nodes is not None
    here = cfg.nodes.nodes_of()[cfg.cluster.node_rank]
    try:
        return run_worker(cfg.cluster, run=_job(cfg),
                          runs_here=", ".join(here) or "nothing (the profile places no rank here)")
    except ClusterError as exc:
        print(f"weightsync run: {exc}", file=sys.stderr)
        return 1
