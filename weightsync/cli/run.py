"""``weightsync run MODEL``: train and update rollout engines every step (the reference system's ``run``).

Resolves the run from the model's profile and the machine: where the machine has the GPUs the
profile needs, the profile runs as is; otherwise ``run`` says so in one line and runs the
*embedded default*: the same family at tiny scale on CPU, trainer TP 2 and engine TP 2 (EP 2
for MoE families, DP-attention where the profile uses it). Any of ``--scale``, ``--train``,
``--rollout``, ``--device`` given, the run is the profile's parallel sizes with ``--train`` /
``--rollout`` replacing the keys they name (:func:`weightsync.models.fit.profile_sizes`, the same
as in ``prepare``, ``plan`` and ``bench``), at ``--scale`` (default full on cuda, else tiny).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

from weightsync.launch.config import EnvSettings, RunConfig, RunMode, env_settings
from weightsync.models import list_models
from weightsync.models.fit import cuda_device_count, fit_profile, profile_sizes

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registry model name (weightsync list)")
    p.add_argument("--mode", default=RunMode.P2P.value, help="p2p (default), broadcast, or both (alternating, one run)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (0 = head)")
    p.add_argument("--head-ip", default="", help="head node address (multi-node profiles)")
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


def resolve(args: argparse.Namespace, env: EnvSettings) -> RunConfig | None:
    """The run this invocation stands for, or None when this node has nothing to do.

    Raises:
        ValueError: unknown model or mode, or a bad parallel layout (the message says which).
    """
    if args.model not in list_models():
        raise ValueError(f"unknown model {args.model!r}; known: {', '.join(list_models())}")
    mode = RunMode.parse(args.mode)
    explicit = any(x is not None for x in (args.scale, args.train, args.rollout, args.device))
    have = cuda_device_count()
    embedded = False
    if explicit:
        device = args.device or ("cuda" if have else "cpu")
        scale = args.scale or ("full" if device == "cuda" else "tiny")
        train, rollout = profile_sizes(args.model, args.train, args.rollout)
    else:
        fit = fit_profile(args.model, have)
        if fit.embedded and args.node_rank != 0:
            print(f"{fit.note} It runs on the head node only: node {args.node_rank} has nothing to do.")
            return None
        if fit.note:
            print(fit.note)
        device, scale, train, rollout, embedded = fit.device, fit.scale, fit.train, fit.rollout, fit.embedded
    if device == "cuda" and have < train.world_size + rollout.world_size:
        raise ValueError(f"this run needs {train.world_size + rollout.world_size} GPUs on one node "
                         f"({train.world_size} train + {rollout.world_size} rollout); this machine has {have}. "
                         "Placement across several nodes is not built yet.")
    urls = tuple(u.strip().rstrip("/") for u in args.engine_urls.split(",") if u.strip())
    if urls:
        rollout = replace(rollout, num_engines=len(urls))
    log_dir = env.log_dir or Path("logs") / f"{args.model}_{mode}_{time.strftime('%Y%m%d-%H%M%S')}"
    return RunConfig(model=args.model, scale=scale, mode=mode, device=device, train=train, rollout=rollout,
                     num_steps=args.num_rollout, env=env, log_dir=Path(log_dir), transport=args.transport,
                     prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens,
                     embedded_default=embedded, engine_urls=urls, dtype=args.dtype,
                     hf_checkpoint=args.hf_checkpoint, synthetic=args.synthetic)


def main(args: argparse.Namespace) -> int:
    from weightsync.launch.procs import TrainerError
    from weightsync.launch.session import RunError, RunSession
    from weightsync.sources.prepare import ensure_prepared, weights_label
    from weightsync.sync.engine_client import EngineError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        env = env_settings()
        cfg = resolve(args, env)
    except ValueError as exc:
        print(f"weightsync run: {exc}", file=sys.stderr)
        return 2
    if cfg is None:
        return 0
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        hf_dir, torch_dist_dir = ensure_prepared(cfg.model, scale=cfg.scale, ckpt_dir=env.ckpt_dir, train=cfg.train,
                                                 hf_checkpoint=cfg.hf_checkpoint, dtype=cfg.dtype,
                                                 synthetic=cfg.synthetic)
    except (ValueError, FileExistsError) as exc:  # prepare's errors name the checkpoint and what is wrong
        print(f"weightsync run: prepare: {exc}", file=sys.stderr)
        return 2
    weights = weights_label(hf_dir)
    print(f"model {cfg.model} ({cfg.scale}), mode {cfg.mode}, {cfg.device}; checkpoint {hf_dir}; weights "
          f"{'SYNTHETIC (seeded random-init, not a trained model)' if weights == 'synthetic' else weights}; "
          f"logs {cfg.log_dir}", flush=True)
    try:
        summary = RunSession(cfg, hf_dir=hf_dir, torch_dist_dir=torch_dist_dir).run()
    except (RunError, EngineError, TrainerError) as exc:
        # The message says what failed (a trainer rank's traceback is in it); the launcher's own
        # stack adds nothing.
        print(f"weightsync run: {exc}", file=sys.stderr)
        return 1
    return 0 if summary["validation_passed"] else 1
