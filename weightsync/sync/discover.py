"""What the trainer learns from the engines before it plans: layout, parameter tables, transport.

Rank 0 asks the engines (:class:`~weightsync.sync.engines.Engines`) and every trainer rank gets
the answer (:func:`discover`, collective): the engines' :class:`RolloutParallel` with the layout
options they publish, each rollout rank's published parameter table when p2p writes them, the
transport they receive through, the fp8 block they serve in, whether they take this project's
control extensions, what kind each engine is, and why updates must pause them (None:
pause-free). An updater built from published tables (no engine to drive) takes those as
given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import ModelSpec
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.records import Mode
from weightsync.sync.p2p_sender import SGLANG_TRANSPORT
from weightsync.sync.rank_group import from_rank0
from weightsync.sync.updater_config import UpdaterConfig
from weightsync.transport import TransportConfig

if TYPE_CHECKING:  # the HTTP client (httpx) is imported only by an updater that drives engines
    from weightsync.sync.engines import Engines


@dataclass(frozen=True, kw_only=True, slots=True)
class Discovered:
    """What rank 0 learnt from the engines (broadcast to every rank)."""

    rollout: RolloutParallel
    infos: dict[int, dict[str, Any]] | None
    kind: str | None
    pause_reason: str | None = None
    """Why updates pause the engines (None: pause-free, :mod:`~weightsync.sync.update_flow`)."""
    fp8_block: tuple[int, int] | None = None
    """The block the engines serve fp8 weights in (the trainer quantizes into it)."""
    extensions: bool = False
    """Every engine takes this project's control extensions (:meth:`Engines.control_extensions
    <weightsync.sync.engines.Engines.control_extensions>`): fewer calls per update."""
    engines: tuple[tuple[bool, bool], ...] = ()
    """Per engine: (this project's engine, parameters on GPUs) -- how its checksums are computed."""


def discover(engines: Engines | None, spec: ModelSpec, config: UpdaterConfig, pg: Any,
             make_inputs: Callable[[RolloutParallel, ModelSpec], PlanInputs], *,
             rollout: RolloutParallel | None = None,
             published: Mapping[int, Mapping[str, Any]] | None = None) -> Discovered:
    """What the engines publish (rank 0 asks; collective over ``pg``), or ``rollout`` and
    ``published`` as given (no engine to drive).

    Args:
        make_inputs: the planner inputs of a layout (the destination tables p2p checks against).
        rollout: the engines' layout (default: read from their ``/server_info``).

    Raises:
        ValueError: engines of another layout, a transport they do not receive through, a
            ``pause_free="on"`` they cannot take (all named).
    """
    if published is not None and rollout is not None:
        kinds = {str(i["descriptor"]["kind"]) if i.get("descriptor") else SGLANG_TRANSPORT for i in published.values()}
        return Discovered(rollout=rollout, infos={int(k): dict(v) for k, v in published.items()},
                          kind=kinds.pop() if len(kinds) == 1 else None, fp8_block=spec.fp8_block)
    assert engines is not None

    def find() -> Discovered:
        r = rollout or engines.rollout_parallel(spec)
        block = engines.fp8_block(spec, r)
        extensions = engines.control_extensions()
        kinds = tuple(engines.kinds())
        inputs = make_inputs(r, spec.replace(fp8_block=block))
        if Mode.P2P not in config.modes:
            engines.check_tables(r, inputs.dest_layout)
            return Discovered(rollout=r, infos=None, kind=None, pause_reason=pause_reason(engines, config, None, r.tp),
                              fp8_block=block, extensions=extensions, engines=kinds)
        want = config.transport
        kind = want.kind.value if isinstance(want, TransportConfig) else None if want == "auto" else str(want)
        infos = engines.transfer_infos(r, inputs.dest_layout, kind)
        first = next(iter(infos.values()))
        found = str(first["descriptor"]["kind"]) if first.get("descriptor") else SGLANG_TRANSPORT
        return Discovered(rollout=r, infos=infos, kind=found, pause_reason=pause_reason(engines, config, infos, r.tp),
                          fp8_block=block, extensions=extensions, engines=kinds)

    return from_rank0(pg, find)


def pause_reason(engines: Engines, config: UpdaterConfig, infos: dict[int, dict[str, Any]] | None,
                 tp: int) -> str | None:
    """Why updates must pause the engines (config, or an engine without a usable shadow copy:
    :meth:`Engines.pause_free <weightsync.sync.engines.Engines.pause_free>`), or None.

    Raises:
        ValueError: ``pause_free="on"`` and an engine cannot take it (named).
    """
    if config.pause_free == "off":
        return "UpdaterConfig(pause_free='off')"
    why = engines.pause_free(infos, tp)
    if why is not None and config.pause_free == "on":
        raise ValueError(f"UpdaterConfig(pause_free='on'), but {why} (serve --shadow auto, with memory for it)")
    return why
