"""Megatron-core rank coordinates and pipeline stages of a training job.

Megatron-core (``megatron/core/parallel_state.py``, ``RankGenerator``) numbers the ranks of a
job twice, once for the dense part of the model and once for the experts, with the same
``order`` string (default ``"tp-cp-ep-dp-pp"``, ``"tp-cp-ep-pp-dp"`` with
``--use-tp-pp-dp-mapping``); the first axis varies fastest:

* dense:  axes ``tp, cp, ep=1, dp, pp`` with sizes ``tp, cp, 1, dp, pp``;
* expert: axes ``tp=etp, cp=1, ep, dp=edp, pp`` with sizes ``etp, 1, ep, edp, pp``.

Both numberings must give every rank the same PP stage (Megatron asserts that the two
generators' ``pp`` groups are equal).

Layers per stage follow ``get_transformer_layer_offset`` and the checks of
``TransformerConfig.__post_init__`` (``--decoder-last-pipeline-num-layers``): the last stage
holds ``pp_last_stage_layers`` layers and the other ``pp - 1`` stages share the rest evenly;
without it every stage holds ``num_layers / pp``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""Megatron's default rank order (``megatron/training/initialize.py``)."""
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"
"""Megatron's order under ``--use-tp-pp-dp-mapping``."""
ORDERS = (DEFAULT_ORDER, TP_PP_DP_ORDER)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainCoords:
    """One trainer rank's position on every Megatron parallel axis."""

    tp: int
    """Tensor-parallel rank (dense part)."""
    cp: int
    """Context-parallel rank."""
    dp: int
    """Data-parallel rank (dense part)."""
    pp: int
    """Pipeline stage (same in the dense and the expert numbering)."""
    ep: int
    """Expert-parallel rank."""
    etp: int
    """Expert tensor-parallel rank."""
    edp: int
    """Expert data-parallel rank."""


def _decompose(rank: int, order: str, sizes: dict[str, int]) -> dict[str, int]:
    """Coordinates of ``rank`` on the axes of ``order`` (first axis fastest)."""
    out: dict[str, int] = {}
    stride = 1
    for axis in order.split("-"):
        out[axis] = (rank // stride) % sizes[axis]
        stride *= sizes[axis]
    return out


def train_coords(par: TrainParallel, rank: int, *, order: str = DEFAULT_ORDER) -> TrainCoords:
    """Where global trainer rank ``rank`` sits on the dense and the expert axes.

    Args:
        par: the training job's parallel sizes.
        rank: global rank in ``[0, par.world_size)``.
        order: Megatron's rank order, one of :data:`ORDERS`.

    Returns:
        The rank's :class:`TrainCoords`.

    Raises:
        ValueError: ``rank`` out of range, an unknown ``order``, or a configuration in which
            the dense and the expert numbering put a rank on different PP stages.
    """
    if not 0 <= rank < par.world_size:
        raise ValueError(f"trainer rank {rank} is outside [0, world_size={par.world_size})")
    if order not in ORDERS:
        raise ValueError(f"unknown Megatron rank order {order!r}; expected one of {ORDERS}")
    if order != DEFAULT_ORDER and par.pp > 1 and par.edp != par.dp:
        # Megatron asserts the same: with pp not last, the pp groups of the two numberings differ.
        raise ValueError(
            f"rank order {order!r} with pp={par.pp} needs expert dp ({par.edp}) == dp ({par.dp})"
        )
    dense = _decompose(rank, order, {"tp": par.tp, "cp": par.cp, "ep": 1, "dp": par.dp, "pp": par.pp})
    expert = _decompose(rank, order, {"tp": par.etp, "cp": 1, "ep": par.ep, "dp": par.edp, "pp": par.pp})
    assert dense["pp"] == expert["pp"], (rank, dense, expert)
    return TrainCoords(
        tp=dense["tp"], cp=dense["cp"], dp=dense["dp"], pp=dense["pp"],
        ep=expert["ep"], etp=expert["tp"], edp=expert["dp"],
    )


def stage_layers(spec: ModelSpec, par: TrainParallel) -> list[range]:
    """The global decoder layers of each PP stage, as Megatron-core assigns them.

    Args:
        spec: the model (its ``num_layers``).
        par: parallel sizes (``pp`` and ``pp_last_stage_layers``).

    Returns:
        One ``range`` of global layer indices per stage, stage 0 first.

    Raises:
        ValueError: when Megatron would refuse the split (layers not divisible by the stages
            that share them, a last stage of no layers, or no layers left for the others).
    """
    return list(_stage_layers(spec.num_layers, par.pp, par.pp_last_stage_layers))


@functools.lru_cache(maxsize=1024)
def _stage_layers(num_layers: int, pp: int, last: int | None) -> tuple[range, ...]:
    if last is None:
        if num_layers % pp:
            raise ValueError(
                f"num_layers={num_layers} is not divisible by pp={pp}; set pp_last_stage_layers "
                f"(--decoder-last-pipeline-num-layers) or choose pp dividing the layer count"
            )
        per = num_layers // pp
        return tuple(range(s * per, (s + 1) * per) for s in range(pp))
    if last <= 0:
        raise ValueError(f"pp_last_stage_layers must be > 0, got {last}")
    middle_layers, middle_stages = num_layers - last, pp - 1
    if bool(middle_layers) != bool(middle_stages) or middle_layers < 0:
        raise ValueError(
            f"pp_last_stage_layers={last} leaves {middle_layers} layers for {middle_stages} other "
            f"stage(s) (num_layers={num_layers}, pp={pp}); each stage needs at least one layer"
        )
    if middle_stages and middle_layers % middle_stages:
        raise ValueError(
            f"num_layers={num_layers} minus pp_last_stage_layers={last} = {middle_layers} is not "
            f"divisible by the other pp-1={middle_stages} stages"
        )
    per = middle_layers // middle_stages if middle_stages else 0
    stages = [range(s * per, (s + 1) * per) for s in range(middle_stages)]
    stages.append(range(middle_layers, num_layers))
    return tuple(stages)
