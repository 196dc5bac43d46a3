"""What a ``run`` becomes on this machine: a :class:`RunRequest` (the command line's choices)
resolved into a :class:`~weightsync.launch.config.RunConfig`.

Where the machine has the GPUs the model's profile needs, the profile runs as is; otherwise the
run is the *embedded default*: the same family at tiny scale on CPU, trainer TP 2 and engine TP 2
(EP 2 for MoE families, DP-attention where the profile uses it), and a note says so. Any of
``scale``, ``train``, ``rollout``, ``device`` given, the run is the profile's parallel sizes with
``train`` / ``rollout`` replacing the keys they name (:func:`weightsync.models.fit.profile_sizes`,
the same as in ``prepare``, ``plan`` and ``bench``), at ``scale`` (default full on cuda, else tiny).

Placement, decided here and nowhere else:

* **nodes** -- with a head address (or a node rank above 0) a profile of several nodes runs on
  that many nodes (:func:`weightsync.models.fit.plan_nodes`: on CPU the trainer keeps node 0 and the
  engines take the others, the cross-host path; on GPUs the profile's placement fills the nodes in
  order), and :class:`~weightsync.launch.config.ClusterSpec` says this node's part;
* **GPUs** -- ``split`` (trainer and engine ranks on GPUs of their own) or ``colocated`` (trainer
  rank i and engine rank i share GPU i); by default colocated where one node's GPUs do not fit
  both, else split; a run that cannot fit is refused naming what it needs.

The module imports no torch (the CLI imports it to build its parser).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from weightsync.launch.config import ClusterSpec, Deadlines, EnvSettings, RunConfig, writable_dir
from weightsync.layout.megatron import check_trainer_config
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model, list_models
from weightsync.models.fit import NodePlan, cuda_device_count, fit_profile, plan_nodes, profile_sizes
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.models.profiles import get_profile
from weightsync.models.profiles_base import RunProfile
from weightsync.plan.records import Mode
from weightsync.sources.prepare import recorded_given


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRequest:
    """What ``weightsync run`` was asked for, before the machine and the profile decide the rest
    (None: the profile's or the machine's choice). The fields the resolution does not touch are
    :class:`~weightsync.launch.config.RunConfig`'s of the same name."""

    model: str
    mode: Mode = Mode.P2P
    node_rank: int = 0
    """This node's rank in a multi-node run (0: the head)."""
    head_ip: str = ""
    """The head node's address as the other nodes reach it ("": node 0 runs alone)."""
    num_steps: int = 3
    device: str | None = None
    scale: str | None = None
    train: str | None = None
    """``--train``: keys replacing the profile's trainer sizes."""
    rollout: str | None = None
    """``--rollout``: keys replacing the profile's engine sizes."""
    placement: str | None = None
    """``split`` or ``colocated``; None: colocated where the GPUs do not fit both, else split."""
    engine_urls: tuple[str, ...] = ()
    trainer: str | None = None
    """None: megatron on cuda, synthetic on cpu."""
    transport: str = "auto"
    prompts_per_step: int = 4
    max_new_tokens: int = 8
    hf_checkpoint: Path | None = None
    synthetic: bool = False
    dtype: str = "bfloat16"
    group_size: int = 4
    lr: float = 1e-5
    update_retries: int = 0
    pause_free: str = "auto"
    flip: str = "swap"
    replace_dead_engines: bool = False
    deadlines: Deadlines = field(default_factory=Deadlines)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Sizes:
    device: str
    scale: str
    train: TrainParallel
    rollout: RolloutParallel
    embedded: bool


def resolve_run(req: RunRequest, env: EnvSettings, *, say: Callable[[str], None] = print) -> RunConfig:
    """The run ``req`` stands for on this machine; on a worker node of a multi-node run, the head's
    run (whose ``cluster`` says this node's part).

    Args:
        req: the command line's choices.
        env: the environment's settings (``env_settings()``).
        say: where notes go (the embedded default's reason, colocated on CPU); node rank 0 only
            for the first.

    Raises:
        ValueError: unknown model, a bad node rank, a parallel layout the model cannot be split by,
            a placement this machine cannot hold, an unwritable log directory (the message says
            which and how to fix it).
    """
    if req.model not in list_models():
        raise ValueError(f"unknown model {req.model!r}; known: {', '.join(list_models())}")
    if req.node_rank < 0:
        raise ValueError(f"--node-rank must be >= 0, got {req.node_rank}")
    profile = get_profile(req.model)
    multi_node = profile.num_nodes > 1 and (bool(req.head_ip) or req.node_rank > 0)
    if req.node_rank > 0 and not multi_node:
        raise ValueError(f"--node-rank {req.node_rank}: {req.model}'s profile runs on one node; run it there "
                         "without --node-rank")
    have = cuda_device_count()
    # a checkpoint of the user's, given or recorded by prepare for the embedded default's scale
    own = req.hf_checkpoint is not None or recorded_given(env.ckpt_dir, req.model, "tiny") is not None
    sizes = _sizes(req, have, multi_node=multi_node, own_checkpoint=own, say=say)
    num_nodes = profile.num_nodes if multi_node else 1
    nodes = None
    if multi_node:
        nodes = plan_nodes(sizes.train, sizes.rollout, num_nodes=num_nodes, by_role=sizes.device == "cpu",
                           gpus_per_node=profile.gpus_per_node)
    placement = choose_placement(req.placement, profile, device=sizes.device, train=sizes.train,
                                 rollout=sizes.rollout, have=have, multi_node=multi_node, say=say)
    cluster = (ClusterSpec(num_nodes=num_nodes, node_rank=req.node_rank, head_ip=req.head_ip, port=env.ray_port,
                           timeout_s=env.node_timeout_s, gpus=sizes.device == "cuda") if multi_node else None)
    if req.hf_checkpoint is None:  # a given checkpoint's own shapes are checked once it is read
        check_layouts(req.model, sizes.scale, sizes.train, sizes.rollout)
    trainer = req.trainer or ("megatron" if sizes.device == "cuda" else "synthetic")
    return RunConfig(model=req.model, scale=sizes.scale, mode=req.mode, device=sizes.device, train=sizes.train,
                     rollout=sizes.rollout, num_steps=req.num_steps, env=env,
                     log_dir=_log_dir(req, env, nodes), transport=req.transport,
                     prompts_per_step=req.prompts_per_step, max_new_tokens=req.max_new_tokens,
                     embedded_default=sizes.embedded, engine_urls=req.engine_urls, dtype=req.dtype,
                     hf_checkpoint=req.hf_checkpoint, synthetic=req.synthetic, nodes=nodes, cluster=cluster,
                     placement=placement, trainer=trainer, group_size=req.group_size, lr=req.lr,
                     update_retries=req.update_retries, pause_free=req.pause_free, flip=req.flip,
                     replace_dead_engines=req.replace_dead_engines, deadlines=req.deadlines)


def _sizes(req: RunRequest, have: int, *, multi_node: bool, own_checkpoint: bool, say: Callable[[str], None]
           ) -> _Sizes:
    """Device, scale and parallel sizes: the request's over the profile's, or the profile fitted to
    this machine (the embedded default where it does not fit; ``own_checkpoint``: its note speaks
    of the layout only, the model being the user's checkpoint)."""
    if any(x is not None for x in (req.scale, req.train, req.rollout, req.device)):
        device = req.device or ("cuda" if have else "cpu")
        train, rollout = profile_sizes(req.model, req.train, req.rollout)
        sizes = _Sizes(device=device, scale=req.scale or ("full" if device == "cuda" else "tiny"), train=train,
                       rollout=rollout, embedded=False)
    else:
        fit = fit_profile(req.model, have, multi_node=multi_node, checkpoint=own_checkpoint)
        if fit.note and req.node_rank == 0:
            say(fit.note)
        sizes = _Sizes(device=fit.device, scale=fit.scale, train=fit.train, rollout=fit.rollout,
                       embedded=fit.embedded)
    if req.engine_urls:
        sizes = replace(sizes, rollout=replace(sizes.rollout, num_engines=len(req.engine_urls)))
    return sizes


def choose_placement(requested: str | None, profile: RunProfile, *, device: str, train: TrainParallel,
                     rollout: RolloutParallel, have: int, multi_node: bool,
                     say: Callable[[str], None] = print) -> str:
    """``split`` or ``colocated`` for a run of ``profile``'s model at these sizes on a machine with
    ``have`` GPUs (module docstring); ``requested`` None picks.

    Raises:
        ValueError: colocated on several nodes, or the GPUs do not hold the run (naming how many it
            needs and the way out).
    """
    both = train.world_size + rollout.world_size
    gpu = device == "cuda"
    placement = requested or ("colocated" if gpu and not multi_node and have < both else "split")
    if placement == "colocated" and multi_node:
        raise ValueError("--placement colocated runs on one node; a multi-node run places its ranks by the profile")
    if placement == "colocated" and gpu and have < max(train.world_size, rollout.world_size):
        raise ValueError(f"colocated, this run needs {max(train.world_size, rollout.world_size)} GPUs "
                         f"(trainer rank i and engine rank i share GPU i); this machine has {have}")
    if placement == "colocated" and not gpu:
        say("placement colocated on CPU: trainer and engine ranks share this host's memory; p2p writes through shm "
            "(as split does: a CPU has no device to share), broadcast hands full tensors over in shared memory "
            "through /update_weights_from_tensor (the colocated path GPUs take)")
    if not multi_node and placement == "split" and gpu and have < both:
        raise ValueError(f"this run needs {both} GPUs on one node ({train.world_size} train + "
                         f"{rollout.world_size} rollout); this machine has {have}"
                         + (f"; {profile.model}'s profile spans {profile.num_nodes} nodes: give --head-ip (and "
                            "--node-rank on each node) to run it on them" if profile.num_nodes > 1 else "")
                         + "; --placement colocated shares the GPUs")
    return placement


def check_layouts(model: str, scale: str, train: TrainParallel, rollout: RolloutParallel) -> None:
    """Refuse parallel sizes the model cannot be split by (the registry's shapes at ``scale``).

    Raises:
        ValueError: naming ``--train`` or ``--rollout`` and what does not divide.
    """
    spec = get_model(model, scale)
    try:
        check_trainer_config(spec, train)
    except ValueError as exc:
        raise ValueError(f"--train: {exc}") from None
    try:
        # rank 0's whole layout: a shard that cuts an fp8 block (attention or experts) cuts rank 0's
        # shard, so it is refused here, before any process starts (the engines check every rank)
        engine_layout(spec, rollout, 0)
    except ValueError as exc:
        raise ValueError(f"--rollout: {exc}") from None


def _log_dir(req: RunRequest, env: EnvSettings, nodes: NodePlan | None) -> Path:
    """``MILES_LOG_DIR``, or ``logs/<model>_<mode>_<time>``; refused when it cannot be written.

    Raises:
        ValueError: the log directory or ``CKPT_SAVE_DIR`` is a file, or cannot be written.
    """
    log_dir = env.log_dir or Path("logs") / f"{req.model}_{req.mode}_{time.strftime('%Y%m%d-%H%M%S')}"
    writable_dir(log_dir, "MILES_LOG_DIR" if env.log_dir else "the log directory")
    if env.ckpt_dir.exists() and not env.ckpt_dir.is_dir():
        raise ValueError(f"CKPT_SAVE_DIR {env.ckpt_dir} is a file, not a directory: point it at a directory")
    # every node writes its processes' logs under the head's directory, by absolute path
    return Path(log_dir).absolute() if nodes is not None else Path(log_dir)


__all__ = ["RunRequest", "check_layouts", "choose_placement", "resolve_run"]
