"""What one benchmark is: :class:`BenchConfig`, built from the command line by :func:`build_config`.

Also where the benchmark's ranks go (GPUs, or distinct slots on a CPU), which modes a placement
can run and why not, and the environment of every process the benchmark spawns. The module
imports no torch (the CLI imports it to build its parser); :func:`build_config` imports what it
needs to plan when it runs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightsync.models.fit import profile_sizes
from weightsync.models.parallel import Device, RolloutParallel, TrainParallel
from weightsync.plan.records import Mode
from weightsync.proc import free_port

if TYPE_CHECKING:
    from weightsync.transport import TransportConfig

TENSOR_MODE = "tensor"
"""The colocated baseline's mode (:mod:`weightsync.launch.bench.colocated`; not a plan mode)."""
MODES = (Mode.P2P.value, Mode.BROADCAST.value, TENSOR_MODE)
"""What a benchmark can measure, in the order it measures them."""

GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set in every process the benchmark spawns: NVLink multicast stays off on shared GPU hosts."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """Everything a benchmark process needs (picklable)."""

    model: str
    scale: str
    train: TrainParallel
    rollout: RolloutParallel
    device: str
    """``cpu`` or ``cuda``."""
    modes: tuple[str, ...]
    """Among :data:`MODES`."""
    repeats: int
    """Timed runs per mode, after one warm-up run."""
    bucket_bytes: int
    seed: int
    master_port: int
    transport: TransportConfig
    """The p2p transport (resolved; each rank binds its own GPU)."""
    group_ports: dict[int, int] = field(default_factory=dict)
    """Broadcast: stage source trainer rank -> port of its weight-update group's store."""
    train_gpus: tuple[int, ...] = ()
    """CUDA: GPU of each trainer rank."""
    rollout_gpus: tuple[int, ...] = ()
    """CUDA: GPU of each rollout rank."""
    threads: int = 1
    """torch CPU threads per process."""
    local_copy_bytes: int = 4 << 30
    """Cap of the in-process copy reference."""
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {self.modes}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.device == "cuda" and (
            len(self.train_gpus) != self.train.world_size or len(self.rollout_gpus) != self.rollout.world_size
        ):
            raise ValueError("a CUDA benchmark needs a GPU for every trainer and rollout rank")

    @property
    def world_size(self) -> int:
        return self.train.world_size + self.rollout.world_size

    def placement(self) -> tuple[list[Device], list[Device]]:
        """Devices for the planner: the GPUs on CUDA, distinct slots on CPU."""
        return bench_placement(self.device, self.train, self.rollout, self.train_gpus, self.rollout_gpus)


def bench_placement(
    device: str,
    train: TrainParallel,
    rollout: RolloutParallel,
    train_gpus: tuple[int, ...],
    rollout_gpus: tuple[int, ...],
) -> tuple[list[Device], list[Device]]:
    """Where the benchmark's ranks run (all on this host, each its own process): the GPUs on
    CUDA, distinct slots on CPU."""
    if device == "cuda":
        return [Device(0, g) for g in train_gpus], [Device(0, g) for g in rollout_gpus]
    t = train.world_size
    return [Device(0, i) for i in range(t)], [Device(0, t + i) for i in range(rollout.world_size)]


def gpu_placement(
    num_train: int, num_rollout: int, placement: str, num_gpus: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """GPU of each trainer and rollout rank.

    Raises:
        ValueError: the machine has too few GPUs for the placement.
    """
    if placement == "split":
        need = num_train + num_rollout
        if need > num_gpus:
            raise ValueError(
                f"split placement needs {need} GPUs ({num_train} trainer + {num_rollout} rollout "
                f"ranks), this machine has {num_gpus}: lower tp or use --placement colocated"
            )
        return tuple(range(num_train)), tuple(range(num_train, need))
    need = max(num_train, num_rollout)
    if need > num_gpus:
        raise ValueError(f"colocated placement needs {need} GPUs, this machine has {num_gpus}")
    return tuple(range(num_train)), tuple(range(num_rollout))


def broadcast_skip_reason(
    device: str, train_gpus: tuple[int, ...], rollout_gpus: tuple[int, ...], sources: list[int]
) -> str | None:
    """Why broadcast cannot run with this placement (NCCL refuses two ranks of a group on one GPU)."""
    if device != "cuda":
        return None
    for s in sources:
        members = [train_gpus[s], *rollout_gpus]
        if len(set(members)) != len(members):
            return (
                f"NCCL needs every rank of a weight-update group on its own GPU; source rank {s} and the "
                f"rollout ranks use GPUs {members} (use --placement split)"
            )
    return None


def tensor_skip_reason(device: str, train_world: int, rollout_world: int) -> str | None:
    """Why the colocated baseline cannot run with these sizes (None when it can)."""
    if device != "cuda":
        return "the colocated baseline hands CUDA IPC handles: it needs --device cuda"
    if train_world != 1 or rollout_world != 1:
        return (f"the colocated baseline is measured with one trainer rank holding whole tensors and one engine "
                f"rank (got {train_world} trainer and {rollout_world} rollout ranks: use --train tp=1 --rollout tp=1)")
    return None


def _modes(requested: tuple[Mode, ...], device: str, train: TrainParallel, rollout: RolloutParallel,
           gpus: tuple[tuple[int, ...], tuple[int, ...]], sources: list[int], notes: list[str]) -> tuple[str, ...]:
    """The modes this placement can run (``notes`` says what was skipped and what runs instead)."""
    modes = [m.value for m in requested]
    why = broadcast_skip_reason(device, *gpus, sources) if Mode.BROADCAST in requested else None
    if why is not None:
        notes.append("broadcast skipped: " + why)
        modes.remove(Mode.BROADCAST.value)
        why_not = tensor_skip_reason(device, train.world_size, rollout.world_size)
        if why_not is None:
            notes.append("the colocated baseline (update_weights_from_tensor over CUDA IPC) runs instead")
            modes.append(TENSOR_MODE)
        else:
            notes.append("colocated baseline skipped: " + why_not)
    return tuple(modes)


def build_config(args: argparse.Namespace) -> tuple[BenchConfig, list[str]]:
    """The :class:`BenchConfig` of the command line, and notes about what was changed or skipped.

    Raises:
        ValueError: an unknown model or mode, bad sizes, too few GPUs (the message says which).
    """
    # torch and the planner are imported here, not at the top (module docstring)
    import torch

    from weightsync.layout.megatron import trainer_layout
    from weightsync.layout.sglang import engine_layout
    from weightsync.models import get_model
    from weightsync.plan.broadcast import bucket_bytes_from_gb, plan_broadcast
    from weightsync.plan.inputs import build_inputs
    from weightsync.transport import TransportConfig

    train, rollout = profile_sizes(args.model, args.train, args.rollout)
    spec = get_model(args.model, args.scale)
    requested = Mode.parse(args.mode).transfers
    notes: list[str] = []
    gpus: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible")
        gpus = gpu_placement(train.world_size, rollout.world_size, args.placement, torch.cuda.device_count())
    bucket_bytes = bucket_bytes_from_gb(args.bucket_gb, what="--bucket-gb")
    inputs = build_inputs(spec, train, rollout, trainer_layout=trainer_layout, engine_layout=engine_layout)
    sources = sorted({b.src_rank for b in plan_broadcast(inputs, bucket_bytes=bucket_bytes, dst_rank=0).buckets})
    modes = _modes(requested, args.device, train, rollout, gpus, sources, notes)
    trainers, engines = bench_placement(args.device, train, rollout, *gpus)
    transport = TransportConfig.resolve(
        args.transport, [(a, b) for a in trainers for b in engines], on_gpu=args.device == "cuda"
    )
    cfg = BenchConfig(
        model=args.model,
        scale=args.scale,
        train=train,
        rollout=rollout,
        device=args.device,
        modes=modes,
        repeats=args.repeats,
        bucket_bytes=bucket_bytes,
        seed=args.seed,
        master_port=free_port(),
        group_ports={s: free_port() for s in sources},
        train_gpus=gpus[0],
        rollout_gpus=gpus[1],
        transport=transport,
        threads=args.threads,
        timeout_s=args.timeout,
    )
    return cfg, notes
