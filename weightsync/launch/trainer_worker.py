"""One trainer rank as a process: holds its shards, trains, and updates the engines when told.

The launcher starts ``world_size`` of these (spawned processes) and drives them over a pipe
with the commands of :mod:`~weightsync.launch.messages`; every rank answers every command with
one :class:`~weightsync.launch.messages.Reply` -- the command's typed result, or the formatted
traceback -- so that one rank's failure stops the run everywhere, with the cause. The update
itself is the library's: each rank holds a
:class:`~weightsync.sync.updater.WeightUpdater` over the process group of the trainer ranks
(rank 0 drives the engines' control endpoints, every rank writes).

Trainer backends (:attr:`WorkerConfig.trainer`):

* ``synthetic`` -- :class:`~weightsync.sources.synthetic.SyntheticTrainer`: a deterministic
  Adam-like update of every weight from seeded pseudo-gradients; it learns nothing (the CPU
  default: megatron-core's forward needs CUDA to be fast);
* ``megatron`` -- :class:`~weightsync.sources.train_step.MegatronTrainer`: the megatron-core
  ``GPTModel`` of the profile built from the torch_dist shards, one GRPO step per batch of
  rollouts (the CUDA default).

The rank's transport publishes the address of its own node (:attr:`WorkerConfig.host`, which the
placement sets per rank): the updater opens the run's transport configuration bound to it
(:func:`updater_config`), as it binds its own GPU. Its process group listens there too: rank 0's
store on the master address only, every rank's gloo pairs on that address's interface
(:func:`bind_collectives`).
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from weightsync.launch.messages import (
    Command,
    Export,
    Exported,
    Memory,
    Refresh,
    Reply,
    SetupUpdater,
    Started,
    Stop,
    TrainStats,
    TrainStep,
    Update,
    UpdaterReady,
)
from weightsync.models import get_model
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.models.spec import ModelSpec
from weightsync.sync.updater import UpdaterConfig, UpdateStats, WeightUpdater
from weightsync.transport import TransportConfig
from weightsync.transport.net import bound_store, interface_of

log = logging.getLogger(__name__)

TRAINERS = ("synthetic", "megatron")
SYNTHETIC_LABEL = "synthetic (no learning: a deterministic Adam-like update of every weight)"
"""How runs name the synthetic trainer in their output and ``results.json``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    """What every trainer rank needs to start (picklable)."""

    model: str
    scale: str
    spec: ModelSpec | None = None
    """The run's model (a checkpoint's own shapes); None: the registry's at ``scale``."""
    train: TrainParallel
    rollout: RolloutParallel
    ckpt_dir: str
    """The ``<MODEL>_torch_dist`` directory."""
    master_addr: str
    master_port: int
    device: str
    host: str = "127.0.0.1"
    """The address of this rank's node as peers reach it, set per rank by the placement: the
    transport this rank opens publishes it (:func:`updater_config`)."""
    seed: int = 1234
    trainer: str = "synthetic"
    """``synthetic`` or ``megatron`` (module docstring)."""
    gpus: tuple[int, ...] = ()
    """CUDA: the GPU of each trainer rank (default: :func:`trainer_gpu`)."""
    lr: float = 1e-5
    """megatron: Adam's learning rate."""
    group_size: int = 4
    """megatron: GRPO samples per prompt."""
    clip_eps: float = 0.2
    """megatron: GRPO's ratio clip."""
    synthetic_weights: bool = True
    """megatron: the checkpoint is synthetic (the toy token reward; else the math reward)."""
    collective_timeout_s: float = 300.0
    """The trainer ranks' process groups: a collective not complete within this long fails
    (a rank that died or hangs is then named by the launcher)."""
    fault_hook: str = ""
    """Tests only (``WEIGHTSYNC_FAULT_HOOK``): ``module:function[:argument]`` called as
    ``function(worker, argument)`` once the rank's updater is built ("": none)."""

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {TRAINERS}, got {self.trainer!r}")


class Worker:
    """The state of one trainer rank between commands."""

    def __init__(self, rank: int, cfg: WorkerConfig) -> None:
        self.rank = rank
        self.cfg = cfg
        self.spec: ModelSpec = cfg.spec if cfg.spec is not None else get_model(cfg.model, cfg.scale)
        self.gpu: int | None = None
        if cfg.device == "cuda":
            self.gpu = cfg.gpus[rank] if cfg.gpus else trainer_gpu(rank)
            torch.cuda.set_device(self.gpu)
        device = f"cuda:{self.gpu}" if self.gpu is not None else cfg.device
        megatron = cfg.trainer == "megatron"
        backend = "nccl" if megatron and cfg.device == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
        bind_collectives(cfg.host)
        # rank 0's store listens on the advertised address only (torch's own binds every interface)
        store = bound_store(cfg.master_addr, cfg.master_port, cfg.train.world_size, is_master=rank == 0,
                            timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=cfg.train.world_size, timeout=timeout)
        # The updater's group: control messages are host objects (gloo), whatever trains on NCCL.
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.updater: WeightUpdater | None = None
        if megatron:  # megatron-core is heavy and needed by this backend only
            from weightsync.sources.megatron_model import init_parallel_state
            from weightsync.sources.train_step import MegatronTrainer

            init_parallel_state(cfg.train, seed=cfg.seed)
            self.trainer: Any = MegatronTrainer.from_torch_dist(cfg.ckpt_dir, self.spec, cfg.train, rank,
                                                                device=device, lr=cfg.lr)
            self.params: Any = self.trainer.model
            self.regions = None
        else:
            from weightsync.sources.synthetic import SyntheticTrainer

            self.trainer = SyntheticTrainer.from_torch_dist(cfg.ckpt_dir, self.spec, cfg.train, rank, device=device,
                                                            seed=cfg.seed)
            self.params = self.trainer.params
            self.regions = self.trainer.regions()

    def setup_updater(self, msg: SetupUpdater) -> UpdaterReady:
        """Build this rank's :class:`WeightUpdater` (collective)."""
        urls, config = list(msg.engine_urls), updater_config(msg.config, self.cfg.host)
        if isinstance(self.params, torch.nn.Module):  # sizes from megatron-core's parallel state
            self.updater = WeightUpdater.from_megatron(self.params, spec=self.spec, engine_urls=urls,
                                                       group=self.group, config=config)
        else:
            self.updater = WeightUpdater(self.params, spec=self.spec, train=self.cfg.train, engine_urls=urls,
                                         group=self.group, config=config, source_regions=self.regions)
        if self.cfg.fault_hook:
            fault_hook(self.cfg.fault_hook)(self)
        sender = self.updater.p2p_sender
        return UpdaterReady(ops=self.updater.num_ops, plan_s=self.updater.plan_s,
                            bytes=0 if sender is None else sender.bytes_direct + sender.bytes_staged,
                            memory=self.memory())

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: the trainer's state and the updater's buffers (and, on CUDA, the
        GPU's used memory as the driver reports it: every process on it)."""
        out = {f"updater_{k}": v for k, v in (self.updater.memory() if self.updater is not None else {}).items()}
        if self.cfg.trainer == "megatron":
            out.update({f"trainer_{k}": v for k, v in self.trainer.memory.items()})
        else:
            out["trainer_params"] = sum(a.numel() * a.element_size() for _, a in self.trainer.regions())
            out["trainer_adam_state"] = 2 * 4 * sum(p.numel() for p in self.trainer.params.values())
        if self.gpu is not None:
            free, total = torch.cuda.mem_get_info(self.gpu)
            out["gpu_used_all_processes"] = total - free
            out["gpu_allocated_this_rank"] = torch.cuda.memory_allocated(self.gpu)
        return out

    def train_step(self, samples: tuple[dict[str, Any], ...]) -> TrainStats:
        if self.cfg.trainer != "megatron":
            return TrainStats(trainer="synthetic", stats=self.trainer.step())
        from weightsync.sources.train_step import grpo_batch, math_or_token_reward  # megatron only

        t0 = time.perf_counter()
        rewards = [math_or_token_reward(s, self.spec.vocab_size, synthetic=self.cfg.synthetic_weights)
                   for s in samples]
        kept = [dict(s, reward=r) for s, r in zip(samples, rewards, strict=True)]
        device = torch.device(f"cuda:{self.gpu}") if self.gpu is not None else torch.device("cpu")
        batch = grpo_batch(kept, group_size=self.cfg.group_size, device=device)
        stats = self.trainer.grpo_step(batch, clip_eps=self.cfg.clip_eps)
        if self.gpu is not None:
            torch.cuda.synchronize(self.gpu)
        return TrainStats(trainer="megatron", stats={**stats, "mean_reward": sum(rewards) / len(rewards),
                                                     "train_s": time.perf_counter() - t0})

    def update(self, msg: Update) -> UpdateStats:
        return self._updater().update(msg.version, mode=msg.mode)

    def refresh(self) -> bool:
        """The updater's :meth:`~weightsync.sync.updater.WeightUpdater.refresh` (collective)."""
        return self._updater().refresh()

    def _updater(self) -> WeightUpdater:
        if self.updater is None:
            raise RuntimeError("no updater yet: the launcher sends SetupUpdater first")
        return self.updater

    def export(self, directory: str) -> Exported:
        """Write the trainer's full tensors (stage sources, one file each; collective)."""
        out: dict[str, torch.Tensor] = {}
        for part in self._updater().full_tensors():
            out.update({n: t.detach().cpu().contiguous() for n, t in part.items()})
        if out:
            Path(directory).mkdir(parents=True, exist_ok=True)
            save_file(out, str(Path(directory) / f"trainer-rank{self.rank}.safetensors"))
        dist.barrier(group=self.group)
        return Exported(tensors=len(out))

    def close(self) -> None:
        if self.updater is not None:
            self.updater.close()
        if self.cfg.trainer == "megatron":
            from weightsync.sources.megatron_model import destroy_parallel_state

            destroy_parallel_state()
        if dist.is_initialized():
            dist.destroy_process_group()


def bind_collectives(host: str) -> None:
    """The rank's gloo pairs (and NCCL's bootstrap) listen on the interface of ``host``, the
    address peers reach this rank at, unless the environment names one (``GLOO_SOCKET_IFNAME``,
    ``NCCL_SOCKET_IFNAME``: a multi-node run's agents set them); without it gloo binds the
    address of the host's name, an interface the run does not use."""
    iface = interface_of(host)
    if iface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)


def updater_config(config: UpdaterConfig, host: str) -> UpdaterConfig:
    """The run's updater configuration as the rank at ``host`` opens it: its transport publishes
    ``host`` (a transport given by kind only is left to the updater, which discovers it)."""
    if isinstance(config.transport, TransportConfig):
        return replace(config, transport=config.transport.on_host(host))
    return config


def trainer_gpu(rank: int) -> int:
    """The GPU of trainer rank ``rank`` in a split placement on this node.

    Engine ranks take GPUs from 0 up (``weightsync serve`` puts rank r on cuda:r), so trainer
    ranks take them from the last one down: on a node with room for both they do not share a
    GPU, and where they must share (fewer GPUs than ranks) the writes stay on that GPU.
    """
    n = torch.cuda.device_count()
    return (n - 1 - rank) % n


def fault_hook(spec: str) -> Any:
    """The test hook ``module:function[:argument]`` as a callable of the worker.

    Raises:
        ValueError: not of that form, or the function cannot be imported (named).
    """
    parts = spec.split(":", 2)
    if len(parts) < 2 or not all(parts[:2]):
        raise ValueError(f"WEIGHTSYNC_FAULT_HOOK {spec!r}: expected module:function[:argument]")
    try:
        fn = getattr(importlib.import_module(parts[0]), parts[1])
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"WEIGHTSYNC_FAULT_HOOK {spec!r}: {exc}") from None
    arg = parts[2] if len(parts) == 3 else ""
    return lambda worker: fn(worker, arg)


def worker_main(rank: int, cfg: WorkerConfig, conn: Any) -> None:
    """Entry point of a spawned trainer rank: serve commands until STOP (or the pipe closes)."""
    from weightsync.proc import die_with_parent

    die_with_parent()  # the launcher's death (even SIGKILL) ends this rank
    logging.basicConfig(level=logging.INFO, format=f"[trainer rank{rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine request otherwise
    torch.set_num_threads(1)
    worker: Worker | None = None
    try:
        worker = Worker(rank, cfg)
        conn.send(Reply.success(rank, Started(rank=rank)))
        while True:
            try:
                msg: Command[Any] = conn.recv()
            except EOFError:
                break
            if isinstance(msg, Stop):
                conn.send(Reply.success(rank, None))
                break
            try:
                conn.send(Reply.success(rank, _dispatch(worker, msg)))
            except Exception:  # shipped to the launcher with the traceback, which re-raises
                conn.send(Reply.failure(rank, f"trainer rank {rank}: {msg.cmd}: " + traceback.format_exc()))
    except Exception:  # start-up failure, reported the same way
        conn.send(Reply.failure(rank, f"trainer rank {rank}: start-up: " + traceback.format_exc()))
    finally:
        if worker is not None:
            worker.close()
    # Everything is released (transport, process groups): skip the interpreter's teardown of
    # torch's module graph, ~2 s of CPU per rank (a spawned child otherwise ends with sys.exit),
    # which on a 2-core machine was most of a run's teardown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _dispatch(worker: Worker, msg: Command[Any]) -> Any:
    """The value of the reply to ``msg`` (every command but :class:`Stop`)."""
    match msg:
        case SetupUpdater():
            return worker.setup_updater(msg)
        case TrainStep():
            return worker.train_step(msg.samples)
        case Update():
            return worker.update(msg)
        case Refresh():
            return worker.refresh()
        case Export():
            return worker.export(msg.directory)
        case Memory():
            return worker.memory()
    raise ValueError(f"unknown trainer command {msg!r}")
