"""One trainer rank as a process: holds its shards, trains, and sends its weights when told.

The launcher starts ``world_size`` of these (spawned processes) and drives them over a pipe
with :class:`Cmd` messages; every rank answers every command with ``("ok", payload)`` or
``("error", formatted traceback)`` so that one rank's failure stops the run everywhere, with the
cause.

Protocol (launcher -> every rank, in this order)::

    SETUP_P2P(dests)        build the rank's P2PSender from its share of the plan
    SETUP_BROADCAST(group)  stage sources join the weight-update group with the engines
    TRAIN_STEP              one step of the trainer backend (weights change in place)
    SEND_P2P                write this rank's ops; all ranks barrier before answering
    SEND_BROADCAST(names)   gather a bucket's full tensors on the stage source and broadcast them
    STOP                    release everything and exit
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from weightsync.layout.box import LocalTensor
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.models.spec import ModelSpec
from weightsync.plan.inputs import PlanInputs, build_inputs
from weightsync.transport import TransportConfig

log = logging.getLogger(__name__)


class Cmd(enum.StrEnum):
    SETUP_P2P = "setup_p2p"
    SETUP_BROADCAST = "setup_broadcast"
    TRAIN_STEP = "train_step"
    SEND_P2P = "send_p2p"
    SEND_BROADCAST = "send_broadcast"
    STOP = "stop"


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
    bucket_bytes: int
    transport: TransportConfig
    """The run's resolved p2p transport (each rank binds its own GPU)."""
    seed: int = 1234


class Worker:
    """The state of one trainer rank between commands."""

    def __init__(self, rank: int, cfg: WorkerConfig) -> None:
        from weightsync.sources.synthetic import SyntheticTrainer

        self.rank = rank
        self.cfg = cfg
        self.spec: ModelSpec = cfg.spec if cfg.spec is not None else get_model(cfg.model, cfg.scale)
        dist.init_process_group(
            "gloo", init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}", rank=rank, world_size=cfg.train.world_size
        )
        self.layout: list[LocalTensor] = trainer_layout(self.spec, cfg.train, rank)
        self.gpu = trainer_gpu(rank) if cfg.device == "cuda" else None
        device = f"cuda:{self.gpu}" if self.gpu is not None else cfg.device
        self.trainer = SyntheticTrainer.from_torch_dist(cfg.ckpt_dir, self.spec, cfg.train, rank, device=device,
                                                        seed=cfg.seed)
        self._inputs: PlanInputs | None = None
        self.sender: Any = None
        self.bcast: Any = None

    @property
    def inputs(self) -> PlanInputs:
        if self._inputs is None:
            self._inputs = build_inputs(self.spec, self.cfg.train, self.cfg.rollout, trainer_layout=trainer_layout,
                                        engine_layout=engine_layout)
        return self._inputs

    def setup_p2p(self, dests_json: dict[int, dict[str, Any]]) -> dict[str, Any]:
        from weightsync.plan.p2p import plan_p2p_for_rank
        from weightsync.sync.p2p_sender import P2PSender, dest_rank_from_info

        t0 = time.perf_counter()
        plan = plan_p2p_for_rank(self.inputs, src_rank=self.rank)
        plan_s = time.perf_counter() - t0
        needed = {op.dst_rank for op in plan.ops}
        dests = {r: dest_rank_from_info(r, dests_json[r], self.inputs.dest_layout(r)) for r in sorted(needed)}
        blocks = {g.name: g.block for g in self.inputs.globals.values() if g.block is not None and g.quant_of is None}
        self.sender = P2PSender(plan.ops, self.trainer.params, self.cfg.transport.on_device(self.gpu).make(), dests,
                                bucket_bytes=self.cfg.bucket_bytes, source_regions=self.trainer.regions(),
                                fp8_blocks=blocks)
        return {"ops": len(plan.ops), "plan_s": plan_s, "bytes": self.sender.bytes_direct + self.sender.bytes_staged}

    def send_p2p(self) -> dict[str, Any]:
        stats = self.sender.send()
        t0 = time.perf_counter()
        dist.barrier()
        return {"total_s": stats.total_s, "pack_s": stats.pack_s, "wire_s": stats.wire_s,
                "barrier_s": time.perf_counter() - t0, "bytes": stats.nbytes, "bytes_by_dest": stats.bytes_by_dest,
                "buckets": self.sender.num_buckets}

    def setup_broadcast(self, group: dict[str, Any]) -> dict[str, Any]:
        from weightsync.sync.broadcast_sender import BroadcastSender

        self.bcast = BroadcastSender(self.spec, self.inputs, self.rank, self.layout, self.trainer.params,
                                     group=group, device=self.cfg.device)
        return {"source": self.bcast.is_source}

    def send_broadcast(self, names: list[str]) -> dict[str, Any]:
        return self.bcast.send_bucket(names)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.bcast is not None:
            self.bcast.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def trainer_gpu(rank: int) -> int:
    """The GPU of trainer rank ``rank`` on this node, made current.

    Engine ranks take GPUs from 0 up (``weightsync serve`` puts rank r on cuda:r), so trainer
    ranks take them from the last one down: on a node with room for both they do not share a
    GPU, and where they must share (fewer GPUs than ranks) the writes stay on that GPU.
    """
    n = torch.cuda.device_count()
    gpu = (n - 1 - rank) % n
    torch.cuda.set_device(gpu)
    return gpu


def worker_main(rank: int, cfg: WorkerConfig, conn: Any) -> None:
    """Entry point of a spawned trainer rank: serve commands until STOP (or the pipe closes)."""
    logging.basicConfig(level=logging.INFO, format=f"[trainer rank{rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    worker: Worker | None = None
    try:
        worker = Worker(rank, cfg)
        conn.send(("ok", {"rank": rank, "params": len(worker.trainer.params)}))
        while True:
            try:
                cmd, arg = conn.recv()
            except EOFError:
                break
            if cmd == Cmd.STOP:
                conn.send(("ok", None))
                break
            try:
                conn.send(("ok", _dispatch(worker, cmd, arg)))
            except Exception:  # shipped to the launcher with the traceback, which re-raises
                conn.send(("error", f"trainer rank {rank}: {cmd}: " + traceback.format_exc()))
    except Exception:  # start-up failure, reported the same way
        conn.send(("error", f"trainer rank {rank}: start-up: " + traceback.format_exc()))
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


def _dispatch(worker: Worker, cmd: str, arg: Any) -> Any:
    if cmd == Cmd.SETUP_P2P:
        return worker.setup_p2p(arg)
    if cmd == Cmd.SETUP_BROADCAST:
        return worker.setup_broadcast(arg)
    if cmd == Cmd.TRAIN_STEP:
        return worker.trainer.step()
    if cmd == Cmd.SEND_P2P:
        return worker.send_p2p()
    if cmd == Cmd.SEND_BROADCAST:
        return worker.send_broadcast(arg)
    raise ValueError(f"unknown trainer command {cmd!r}")
