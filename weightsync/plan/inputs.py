"""What a plan is computed from: the model's global tensors, both sides' layouts, and placement.

The planner never imports a layout module: the caller passes the layout functions (or the
layouts themselves), so that tests can plan over hand-written layouts and the CLI over the
Megatron and sglang ones.

Typical usage::

    from weightsync.layout.megatron import trainer_layout
    from weightsync.layout.sglang import engine_layout
    inputs = build_inputs(spec, train, rollout, trainer_layout=trainer_layout,
                          engine_layout=engine_layout)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from weightsync.layout.box import LocalTensor
from weightsync.models.hf import GlobalTensor, global_tensors
from weightsync.models.parallel import Device, RolloutParallel, TrainParallel, default_placement
from weightsync.models.spec import ModelSpec
from weightsync.plan.util import paused_gc

TrainerLayoutFn = Callable[[ModelSpec, TrainParallel, int], Sequence[LocalTensor]]
EngineLayoutFn = Callable[[ModelSpec, RolloutParallel, int], Sequence[LocalTensor]]

PLANNER_VERSION = 1
"""Bump when the op rule changes, so that cached plans are not reused."""


@dataclass(frozen=True, kw_only=True, eq=False)
class PlanInputs:
    """Everything the planner reads. Layouts are per rank and frozen; nothing here is mutated."""

    spec: ModelSpec
    train: TrainParallel
    rollout: RolloutParallel
    source_layouts: tuple[tuple[LocalTensor, ...], ...]
    """Per trainer rank (index = global trainer rank)."""
    engine_layouts: tuple[tuple[LocalTensor, ...], ...]
    """Per rank inside one engine (index in ``[0, rollout.tp)``); every engine is the same."""
    train_devices: tuple[Device, ...]
    rollout_devices: tuple[Device, ...]
    globals: dict[str, GlobalTensor] = field(default_factory=dict)
    """``global_tensors(spec)`` (computed when left empty)."""

    def __post_init__(self) -> None:
        if not self.globals:
            object.__setattr__(self, "globals", global_tensors(self.spec))
        if len(self.source_layouts) != self.train.world_size:
            raise ValueError(f"{len(self.source_layouts)} trainer layouts for a train world of {self.train.world_size}")
        if len(self.engine_layouts) != self.rollout.tp:
            raise ValueError(f"{len(self.engine_layouts)} engine layouts for an engine of tp={self.rollout.tp}")
        if len(self.train_devices) != self.train.world_size or len(self.rollout_devices) != self.rollout.world_size:
            raise ValueError(
                f"placement has {len(self.train_devices)}+{len(self.rollout_devices)} devices, expected "
                f"{self.train.world_size}+{self.rollout.world_size} (train + rollout ranks)"
            )

    @property
    def num_dest(self) -> int:
        return self.rollout.world_size

    def dest_layout(self, rank: int) -> tuple[LocalTensor, ...]:
        """Layout of rollout rank ``rank`` (engine ``rank // tp``, rank ``rank % tp`` inside it)."""
        return self.engine_layouts[rank % self.rollout.tp]

    def cache_key(self, mode: str, **options: object) -> str:
        """Hash of (spec, train par, rollout par, placement, mode, options, planner version)."""
        payload = {
            "version": PLANNER_VERSION,
            "spec": {k: v for k, v in _spec_dict(self.spec).items() if k != "sources"},
            "train": asdict(self.train),
            "rollout": asdict(self.rollout),
            "train_devices": [(d.node, d.gpu) for d in self.train_devices],
            "rollout_devices": [(d.node, d.gpu) for d in self.rollout_devices],
            "mode": mode,
            "options": options,
        }
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


def _spec_dict(spec: ModelSpec) -> dict[str, object]:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


def build_inputs(spec: ModelSpec, train: TrainParallel, rollout: RolloutParallel, *,
                 trainer_layout: TrainerLayoutFn, engine_layout: EngineLayoutFn,
                 placement: tuple[Sequence[Device], Sequence[Device]] | None = None) -> PlanInputs:
    """Compute both sides' layouts for every rank and bundle them with the placement.

    Args:
        spec: the model.
        train: trainer parallel sizes.
        rollout: rollout parallel sizes (one engine; ``num_engines`` identical engines).
        trainer_layout: ``(spec, train, rank) -> local tensors`` of a trainer rank.
        engine_layout: ``(spec, rollout, rank) -> local tensors`` of a rank inside one engine.
        placement: ``(train devices, rollout devices)``; default :func:`default_placement`.

    Returns:
        The planner inputs.
    """
    if placement is None:
        placement = default_placement(train.world_size, rollout.world_size)
    with paused_gc():
        return PlanInputs(
            spec=spec,
            train=train,
            rollout=rollout,
            source_layouts=tuple(tuple(trainer_layout(spec, train, r)) for r in range(train.world_size)),
            engine_layouts=tuple(tuple(engine_layout(spec, rollout, r)) for r in range(rollout.tp)),
            train_devices=tuple(placement[0]),
            rollout_devices=tuple(placement[1]),
        )
