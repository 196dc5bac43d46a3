"""Rank 0 drives the engine's other ranks: typed commands out, per-rank replies back.

Protocol (over the engine's gloo ``control`` group)::

    worker:  IDLE --broadcast(Command)--> EXECUTING --gather(Reply)--> IDLE   (SHUTDOWN: exit)
    rank 0:  broadcast(Command); execute it locally; gather every Reply; raise if any failed

A failing rank ships its formatted traceback in its :class:`Reply`; rank 0 raises one
:class:`RankError` naming every failed rank (its message holds each rank's exception line, never
a traceback: those are logged where they happen), so one failure stops the command everywhere in
the same way. Commands are validated on rank 0 before they are sent (bad input never reaches the
ranks); a failure on rank 0 while it samples a generation step is broadcast so that every rank
leaves the batch (:class:`~weightsync.engine.engine.StepError`); a rank that fails *inside* a
model collective leaves the others waiting until the collective times out (the engine's
``collective_timeout_s``).

A single-rank engine without torch.distributed runs the same commands locally.
"""

from __future__ import annotations

import enum
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from weightsync.engine.engine import Engine, FlipAt
from weightsync.models.parallel import RolloutParallel
from weightsync.sync.peer_sender import PeerDonation
from weightsync.transport import TransportConfig

logger = logging.getLogger(__name__)


class Op(enum.StrEnum):
    """What a command asks every rank to do (argument names in :func:`execute`)."""

    GENERATE = "generate"  # reqs -> list[GenResult] (rank 0)
    PROMPT_LOGITS = "prompt_logits"  # prompts -> list[Tensor] (rank 0)
    LOAD_CHECKPOINT = "load_checkpoint"  # path -> LoadStats
    LOAD_DUMMY = "load_dummy"  # seed -> LoadStats
    POST_LOAD = "post_load"  # -> seconds
    BEGIN_UPDATE = "begin_update"  # pause_free, flip -> {"target_copy", "flip", "in_place", ...}
    END_UPDATE = "end_update"  # -> seconds (post-load on the session's copy)
    PUBLISH = "publish"  # -> {"flip", "seconds", "served"} (the session's copy is served; closed)
    ABORT_UPDATE = "abort_update"  # the session closes unpublished
    UPDATE_FROM_DISK = "update_from_disk"  # path -> LoadStats (into the session's copy)
    TRANSFER_INFO = "transfer_info"  # -> TransferInfo
    CHECK_WEIGHTS = "check_weights"  # action, seed, allow_quant_error, skip -> dict
    LIVE_DIGEST = "live_digest"  # seed -> {name: hex} of the served copy (the live check)
    INIT_GROUP = "init_group"  # master_address, master_port, rank_offset, world_size, group_name, backend
    INIT_GROUP_START = "init_group_start"  # the same arguments; the join runs in the background
    GROUP_STATUS = "group_status"  # group_name -> "ok" | "pending" | the failure
    ABANDON_GROUP = "abandon_group"  # group_name: forget a join that failed or timed out
    UPDATE_FROM_DISTRIBUTED = "update_from_distributed"  # names, dtypes, shapes, group_name -> dict
    DESTROY_GROUP = "destroy_group"  # group_name
    UPDATE_FROM_TENSOR = "update_from_tensor"  # entries (one per rank), load_format -> dict
    DONATE_START = "donate_start"  # joiner, ranks, transport, seed, deadline_s: the copy starts in a thread
    DONATE_STATUS = "donate_status"  # -> None while it runs, then PeerDonation.result()
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, kw_only=True, slots=True)
class Command:
    op: Op
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class Reply:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    """Formatted traceback of the failure (empty when ok)."""
    user_error: bool = False
    """The failure was a ValueError: bad input or configuration, not an engine fault."""
    error_type: str = ""
    """The exception's class name."""


def _last_line(error: str) -> str:
    lines = error.strip().splitlines()
    return lines[-1] if lines else "unknown error"


class RankError(RuntimeError):
    """One or more ranks failed a command; ``str()`` has every failed rank's exception line (no
    traceback; :attr:`failed` keeps them)."""

    def __init__(self, op: Op, failed: list[Reply]) -> None:
        self.op = op
        self.failed = failed
        self.user_error = all(r.user_error for r in failed)
        self.step_error = all(r.error_type == "StepError" for r in failed)
        """Rank 0's generation step failed and every rank left the batch cleanly."""
        if self.user_error:
            # The same bad input fails every rank the same way: say it once.
            last = _last_line(failed[0].error)
            msg = last.split(": ", 1)[1] if ": " in last else last
        else:
            msg = "; ".join(f"[rank{r.rank}] {_last_line(r.error)}" for r in failed)
        super().__init__(msg)


def execute(engine: Engine, cmd: Command, should_abort: Callable[[], bool] | None = None,
            take_flip: Callable[[], FlipAt | None] | None = None) -> Reply:
    """Run ``cmd`` on this rank; failures become a :class:`Reply` carrying the traceback
    (``should_abort`` and ``take_flip``: rank 0's hooks into a generation batch)."""
    a = cmd.args
    try:
        match cmd.op:
            case Op.GENERATE:
                value: Any = engine.generate(a["reqs"], should_abort, take_flip)
            case Op.PROMPT_LOGITS:
                value = engine.prompt_logits(a["prompts"])
            case Op.LOAD_CHECKPOINT:
                value = engine.load_checkpoint(a["path"])
            case Op.LOAD_DUMMY:
                value = engine.load_dummy(a["seed"])
            case Op.POST_LOAD:
                value = engine.post_load()
            case Op.BEGIN_UPDATE:
                value = engine.begin_update(a.get("pause_free", False), a.get("flip", "swap"))
            case Op.END_UPDATE:
                value = engine.end_update()
            case Op.PUBLISH:
                value = engine.publish()
            case Op.ABORT_UPDATE:
                value = engine.abort_update()
            case Op.UPDATE_FROM_DISK:
                value = engine.update_from_disk(a["path"])
            case Op.TRANSFER_INFO:
                value = engine.transfer_info()
            case Op.CHECK_WEIGHTS:
                value = _check(engine, a["action"], a.get("seed", 0), a.get("allow_quant_error", False),
                               a.get("skip", ()))
            case Op.LIVE_DIGEST:
                value = engine.checker.live_digest(engine.store, a["seed"])
            case Op.INIT_GROUP:
                value = engine.broadcast.init_group(**a)
            case Op.INIT_GROUP_START:
                value = engine.broadcast.start_init(**a)
            case Op.GROUP_STATUS:
                value = engine.broadcast.init_status(a["group_name"])
            case Op.ABANDON_GROUP:
                value = engine.broadcast.abandon_init(a["group_name"])
            case Op.UPDATE_FROM_DISTRIBUTED:
                value = engine.broadcast.receive(**a)
            case Op.DESTROY_GROUP:
                value = engine.broadcast.destroy_group(a["group_name"])
            case Op.UPDATE_FROM_TENSOR:
                value = engine.update_from_tensor(a["entries"], a["load_format"])
            case Op.DONATE_START:
                value = _start_donation(engine, a)
            case Op.DONATE_STATUS:
                value = engine.donation.result() if engine.donation is not None else {"error": "no donation"}
            case Op.SHUTDOWN:
                value = None
    except Exception as exc:  # shipped to rank 0 with its traceback and re-raised there as RankError
        if isinstance(exc, ValueError):  # a refused request (answered 400): one line, no traceback in the log
            logger.warning("[rank%d] %s refused: %s", engine.rank, cmd.op, exc)
        else:
            logger.exception("[rank%d] %s failed", engine.rank, cmd.op)
        return Reply(rank=engine.rank, ok=False, error=traceback.format_exc(), user_error=isinstance(exc, ValueError),
                     error_type=type(exc).__name__)
    if engine.rank != 0 and cmd.op in (Op.GENERATE, Op.PROMPT_LOGITS):
        value = None  # rank 0 holds the outputs; do not ship copies back
    return Reply(rank=engine.rank, ok=True, value=value)


def _start_donation(engine: Engine, a: dict[str, Any]) -> None:
    """This rank's share of a copy to a joining engine, started in a thread (served copy as source)."""
    if engine.donation is not None and engine.donation.result() is None:
        raise RuntimeError("a copy to another joining engine is still running on this rank")
    engine.donation = PeerDonation(engine.store, engine.spec, engine.groups.par, engine.rank,
                                   RolloutParallel(**a["joiner"]), a["ranks"],
                                   transport=TransportConfig.from_json(a["transport"]), seed=a["seed"],
                                   deadline_s=a["deadline_s"])


def _check(engine: Engine, action: str, seed: int, allow_quant_error: bool, skip: tuple[str, ...]) -> dict[str, Any]:
    checker = engine.checker_on(action)
    if action == "snapshot":
        return checker.snapshot()
    if action == "reset_tensors":
        return engine.reset_tensors(seed, skip)
    if action == "compare":
        return checker.compare(allow_quant_error, skip)
    if action == "checksum":
        return checker.checksum(skip)
    if action == "fingerprint":
        return checker.fingerprint(seed, skip, store=engine.session_store())  # the copy an update session writes
    raise ValueError(f"unknown weights_checker action {action!r}; use snapshot, reset_tensors, compare, checksum "
                     f"or fingerprint")


class Driver:
    """Rank 0's side: send a command to every rank, run it locally, collect the replies."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.world = engine.groups.world
        self._pg = engine.groups.control

    def run(self, op: Op, should_abort: Callable[[], bool] | None = None,
            take_flip: Callable[[], FlipAt | None] | None = None, **args: Any) -> list[Any]:
        """Run ``op`` on all ranks (blocks until all have replied); ``should_abort`` and
        ``take_flip`` are rank 0's hooks into a generation batch (:meth:`Engine.generate`).

        Returns:
            Every rank's value, by rank.

        Raises:
            RankError: any rank failed.
        """
        cmd = Command(op=op, args=args)
        if self.world > 1:
            dist.broadcast_object_list([cmd], src=0, group=self._pg)
        mine = execute(self.engine, cmd, should_abort, take_flip)
        replies = [mine]
        if self.world > 1:
            gathered: list[Reply | None] = [None] * self.world
            dist.gather_object(mine, gathered, dst=0, group=self._pg)
            replies = [r for r in gathered if r is not None]
        failed = [r for r in replies if not r.ok]
        if failed:
            raise RankError(op, failed)
        return [r.value for r in replies]

    def shutdown(self) -> None:
        """Release the workers (they leave their loop)."""
        self.run(Op.SHUTDOWN)


def worker_loop(engine: Engine) -> None:
    """Ranks > 0: execute rank 0's commands until SHUTDOWN."""
    pg = engine.groups.control
    while True:
        box: list[Command | None] = [None]
        dist.broadcast_object_list(box, src=0, group=pg)
        cmd = box[0]
        assert cmd is not None
        reply = execute(engine, cmd)
        dist.gather_object(reply, None, dst=0, group=pg)
        if cmd.op is Op.SHUTDOWN:
            return
