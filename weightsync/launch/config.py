"""Run configuration: the one place where environment variables are read.

``RunConfig`` holds everything a ``run`` needs; :func:`env_settings` reads the reference
system's variables (``CKPT_SAVE_DIR``, ``SKIP_VALIDATION``, ``BUCKET_SIZE_GB``,
``MILES_LOG_DIR``), the transport ones (those the transport configuration's fields name:
``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``; :meth:`TransportConfig.env_options`) and the
multi-node ones (``WEIGHTSYNC_NODE_TIMEOUT_S``, ``WEIGHTSYNC_RAY_PORT``), the engines' access token
(``WEIGHTSYNC_TOKEN``, :func:`env_token`; ``weightsync serve`` reads it here too, at its CLI edge),
and nothing below this module reads the environment: values are passed down explicitly.

Every wait of a run has its deadline in :class:`Deadlines` (``run --deadlines KEY=SECONDS,...``);
``WEIGHTSYNC_FAULT_HOOK`` (tests only, :attr:`EnvSettings.fault_hook`) names a function the trainer
ranks call once their updater is built, which is how the fault-injection tests reach into a run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from weightsync.models.fit import NodePlan, plan_nodes
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.broadcast import DEFAULT_BUCKET_GB, bucket_bytes_from_gb
from weightsync.plan.records import Mode
from weightsync.transport import AUTO, TransportConfig, check_receiver

DEFAULT_CKPT_DIR = "/root/multinode"
"""The reference system's default checkpoint directory."""
DEFAULT_NODE_TIMEOUT_S = 300.0
"""How long the head waits for every node of a multi-node run to join (and a worker for the head)."""
DEFAULT_RAY_PORT = 6379
"""The port of the Ray head's GCS (Ray's own default)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvSettings:
    """The environment variables of the reference document, parsed once."""

    ckpt_dir: Path
    """``CKPT_SAVE_DIR`` (default ``/root/multinode``)."""
    skip_validation: bool
    """``SKIP_VALIDATION=1`` skips ``--check-weight-update-equal``."""
    bucket_bytes: int
    """``BUCKET_SIZE_GB`` (GiB, 2**30 bytes; default 1), in bytes."""
    log_dir: Path | None
    """``MILES_LOG_DIR``: logs, ``results.json`` and plots."""
    transport_options: dict[str, str] = field(default_factory=dict)
    """The transport options the environment sets (``MOONCAKE_PROTOCOL``, ...), by field of
    :class:`~weightsync.transport.TransportConfig`."""
    node_timeout_s: float = DEFAULT_NODE_TIMEOUT_S
    """``WEIGHTSYNC_NODE_TIMEOUT_S``: the deadline for the nodes of a multi-node run to join."""
    ray_port: int = DEFAULT_RAY_PORT
    """``WEIGHTSYNC_RAY_PORT``: the Ray head's port (open it between the nodes)."""
    token: str | None = field(default=None, repr=False)
    """``WEIGHTSYNC_TOKEN``: the engines' access token; None: unset. A run hands it to its placement,
    which starts the engines with it in their environment and passes it to every client (the
    launcher's, and the trainer ranks' through ``UpdaterConfig.token``)."""
    fault_hook: str = ""
    """``WEIGHTSYNC_FAULT_HOOK`` (tests only): ``module:function[:argument]``, called on every
    trainer rank as ``function(worker, argument)`` once its updater is built ("": none)."""


TOKEN_ENV = "WEIGHTSYNC_TOKEN"


def env_token(environ: Mapping[str, str] | None = None) -> str | None:
    """``WEIGHTSYNC_TOKEN`` (stripped), or None when unset or empty."""
    env = os.environ if environ is None else environ
    return env.get(TOKEN_ENV, "").strip() or None


def _positive(env: Mapping[str, str], name: str, default: float, kind: type) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{name} must be a positive {'integer' if kind is int else 'number'}, got {raw!r}")
    return value


def env_settings(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """Parse the environment variables (``os.environ`` by default).

    Raises:
        ValueError: a variable has a value that cannot be used (the message names it).
    """
    env = os.environ if environ is None else environ
    skip = env.get("SKIP_VALIDATION", "0").strip()
    if skip not in ("0", "1", ""):
        raise ValueError(f"SKIP_VALIDATION must be 0 or 1, got {skip!r}")
    bucket = bucket_bytes_from_gb(env.get("BUCKET_SIZE_GB", "").strip() or DEFAULT_BUCKET_GB, what="BUCKET_SIZE_GB")
    log_dir = env.get("MILES_LOG_DIR", "").strip()
    return EnvSettings(
        ckpt_dir=Path(env.get("CKPT_SAVE_DIR", "").strip() or DEFAULT_CKPT_DIR),
        skip_validation=skip == "1",
        bucket_bytes=bucket,
        log_dir=Path(log_dir) if log_dir else None,
        transport_options=TransportConfig.env_options(env),
        node_timeout_s=float(_positive(env, "WEIGHTSYNC_NODE_TIMEOUT_S", DEFAULT_NODE_TIMEOUT_S, float)),
        ray_port=int(_positive(env, "WEIGHTSYNC_RAY_PORT", DEFAULT_RAY_PORT, int)),
        token=env_token(env),
        fault_hook=env.get(FAULT_HOOK_ENV, "").strip(),
    )


FAULT_HOOK_ENV = "WEIGHTSYNC_FAULT_HOOK"


def writable_dir(path: Path, what: str) -> None:
    """Refuse a directory the run could not write into, before anything starts: a file, a file on
    the way to it, or a directory (``path`` or, when it does not exist yet, the nearest existing
    parent) where no file can be created (a read-only mount). Leaves nothing behind.

    Raises:
        ValueError: naming ``what`` (``MILES_LOG_DIR``, ...), the path and why.
    """
    import tempfile

    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == path else f"cannot be created: {probe} is a file"
        raise ValueError(f"{what} {path} {where}; point it at a directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot write into {probe} ({exc.strerror or exc}); point it at a "
                         "writable directory") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Deadlines:
    """How long a run waits for each thing, in seconds (``run --deadlines KEY=SECONDS,...``, the
    keys being the field names without ``_s``). A wait that expires fails the run with an error
    naming what timed out, where (trainer rank or engine) and after how long."""

    engine_start_s: float = 300.0
    """An engine started by the run answers ``/health``."""
    trainer_start_s: float = 300.0
    """The trainer ranks have loaded their shards (and joined their process group)."""
    engine_call_s: float = 120.0
    """One control call to an engine (pause, begin / end of an update, checker, version, ...)."""
    generate_s: float = 600.0
    """One generation request of a step."""
    command_s: float = 900.0
    """One command of the trainer ranks (a training step, an update, an export)."""
    collective_s: float = 300.0
    """One collective of the trainer ranks' process groups (gloo / NCCL timeout)."""
    write_s: float = 300.0
    """The p2p writes of one update (transport completion)."""
    group_s: float = 120.0
    """Creating or joining a weight-update group, and one broadcast over it."""
    failure_grace_s: float = 2.0
    """After a trainer rank reported an error or died: how long the others get to report theirs
    before the run stops (the first failure is the one shown)."""
    stop_s: float = 15.0
    """A process asked to stop exits (then it is killed)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"deadline {f.name.removesuffix('_s')} must be a positive number of seconds, "
                                 f"got {v!r}")

    @classmethod
    def parse(cls, text: str) -> Deadlines:
        """``KEY=SECONDS,...`` over the defaults (``--deadlines``; "" gives the defaults).

        Raises:
            ValueError: an unknown key or a value that is not a positive number (named, with the keys).
        """
        keys = [f.name.removesuffix("_s") for f in fields(cls)]
        out: dict[str, float] = {}
        for item in (x.strip() for x in text.split(",")):
            if not item:
                continue
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in keys:
                raise ValueError(f"--deadlines: {item!r} is not KEY=SECONDS with KEY one of {', '.join(keys)}")
            try:
                out[key.strip() + "_s"] = float(value)
            except ValueError:
                raise ValueError(f"--deadlines: {item!r}: {value!r} is not a number of seconds") from None
        return replace(cls(), **out)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """This node's part in a multi-node run (``--node-rank`` / ``--head-ip``)."""

    num_nodes: int
    """Nodes the run spans (the profile's)."""
    node_rank: int
    """0: the head (starts Ray, waits for the others, runs the job); 1..: a worker (joins, stays)."""
    head_ip: str
    """The head's address as the other nodes reach it."""
    port: int = DEFAULT_RAY_PORT
    """The Ray head's GCS port."""
    timeout_s: float = DEFAULT_NODE_TIMEOUT_S
    """How long the head waits for the nodes (a worker: for the head)."""
    gpus: bool = False
    """Ranks hold GPUs (bundles ask Ray for them)."""

    def __post_init__(self) -> None:
        if self.num_nodes < 2:
            raise ValueError(f"a multi-node run spans at least 2 nodes, got {self.num_nodes}")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"--node-rank {self.node_rank}: this run spans {self.num_nodes} nodes, so node ranks are "
                             f"0 (the head) .. {self.num_nodes - 1}")
        if not self.head_ip:
            raise ValueError(f"node rank {self.node_rank} needs --head-ip: the address of node rank 0 (the head)")

    @property
    def address(self) -> str:
        """``head_ip:port``, what ``ray start --address`` takes."""
        return f"{self.head_ip}:{self.port}"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """One ``run``: model, mode, layouts, and where things go."""

    model: str
    scale: str
    """``full``, ``layers=N`` or ``tiny`` (the embedded default runs ``tiny``)."""
    mode: Mode
    """``p2p``, ``broadcast``, or ``both`` (updates alternate p2p, broadcast, ... on the same
    engines and trainer ranks: both paths checked, and compared, in one run); the CLI parses it."""
    device: str
    """``cpu`` or ``cuda``."""
    train: TrainParallel
    rollout: RolloutParallel
    num_steps: int
    env: EnvSettings
    log_dir: Path
    transport: str = AUTO
    """p2p transport: ``auto`` (the written policy), or a kind an engine receives through, forced
    for every pair (:func:`~weightsync.transport.run_choices`)."""
    prompts_per_step: int = 4
    max_new_tokens: int = 8
    seed: int = 1234
    host: str = "127.0.0.1"
    embedded_default: bool = False
    """True when the profile did not fit this machine and the tiny CPU default runs instead."""
    engine_urls: tuple[str, ...] = ()
    """Engines already serving (``--engine-urls``): the run updates them and starts none; one URL
    per engine of ``rollout``."""
    dtype: str = "bfloat16"
    """Weight dtype of the trainer and of the engines' unquantized weights (``--dtype``)."""
    hf_checkpoint: Path | None = None
    """``--hf-checkpoint``: the checkpoint to run (else the one ``prepare`` recorded)."""
    synthetic: bool = False
    """``--synthetic``: synthetic weights where no checkpoint is found beyond the tiny scale."""
    nodes: NodePlan | None = None
    """Where each trainer and engine rank runs; None: every rank on this host."""
    cluster: ClusterSpec | None = None
    """This node's part in a multi-node run (None: one node)."""
    trainer: str = "synthetic"
    """``synthetic`` (learns nothing; the CPU default) or ``megatron`` (megatron-core GRPO; the
    CUDA default) -- ``--trainer``."""
    placement: str = "split"
    """``split``: trainer and engine ranks on GPUs of their own; ``colocated``: trainer rank i and
    engine rank i share GPU i (``--placement``)."""
    group_size: int = 4
    """GRPO: samples per prompt (``--group-size``)."""
    lr: float = 1e-5
    """megatron: Adam's learning rate (``--lr``)."""
    update_retries: int = 0
    """A failed update (a rank's or engine's error, a fingerprint mismatch) is tried again from
    scratch this many times before the run stops (``--update-retries``); every engine stays
    paused and dirty at the old version until an attempt verifies."""
    pause_free: str = "auto"
    """:attr:`~weightsync.sync.updater_config.UpdaterConfig.pause_free` (``--pause-free``)."""
    flip: str = "swap"
    """:attr:`~weightsync.sync.updater_config.UpdaterConfig.flip` (``--flip``)."""
    replace_dead_engines: bool = False
    """``--replace-dead-engines``: an engine this run started that died is started again where it
    served, joins the current version from a healthy peer and rejoins the updates
    (:mod:`~weightsync.launch.replace`); the updates drop an engine that fails in them. Off: a
    dead engine stops the run, named."""
    deadlines: Deadlines = field(default_factory=Deadlines)
    """Every wait of the run (``--deadlines``)."""
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            raise ValueError(f"mode must be a Mode (the CLI parses its string with Mode.parse), got {self.mode!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}: use cpu or cuda")
        if self.num_steps < 1:
            raise ValueError(f"--num-rollout must be >= 1, got {self.num_steps}")
        if self.engine_urls and len(self.engine_urls) != self.rollout.num_engines:
            raise ValueError(f"{len(self.engine_urls)} engine URL(s) for {self.rollout.num_engines} engine(s)")
        if self.trainer not in ("synthetic", "megatron"):
            raise ValueError(f"unknown trainer {self.trainer!r}: use synthetic or megatron")
        if self.placement not in ("split", "colocated"):
            raise ValueError(f"unknown placement {self.placement!r}: use split or colocated")
        if self.group_size < 1 or self.lr <= 0:
            raise ValueError(f"--group-size must be >= 1 and --lr > 0, got {self.group_size} and {self.lr}")
        if self.prompts_per_step < 1:
            raise ValueError(f"--prompts-per-step must be >= 1 (prompts each engine generates for per step), got "
                             f"{self.prompts_per_step}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.update_retries < 0:
            raise ValueError(f"--update-retries must be >= 0 (0: a failed update stops the run), got "
                             f"{self.update_retries}")
        if self.transport != AUTO:  # a kind no engine receives through, or not this device's memory
            check_receiver(self.transport, self.device, name="--transport")
        if self.engine_urls and self.cluster is not None:
            raise ValueError("--engine-urls updates engines that are already serving; a multi-node run (--head-ip) "
                             "starts its own: give one or the other")

    @property
    def node_plan(self) -> NodePlan:
        """:attr:`nodes`, or every rank on this host."""
        return self.nodes if self.nodes is not None else plan_nodes(self.train, self.rollout)

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The transfer modes this run sets up; update ``k`` uses ``modes[k % len(modes)]``."""
        return self.mode.transfers

    @property
    def bucket_bytes(self) -> int:
        """``BUCKET_SIZE_GB`` in bytes."""
        return self.env.bucket_bytes
