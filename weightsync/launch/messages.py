"""The messages between a launcher and its rank processes: commands down, one reply up for each.

``run``'s trainer ranks (:mod:`~weightsync.launch.trainer_worker`) are driven by commands over a
pipe (or through their node's agent, :mod:`~weightsync.launch.ray_agent`). A rank answers its
start-up with :class:`Started`, then every command with one :class:`Reply` whose value has the
type the command names (``Command[R]``), in this order::

    command (Cmd)                 what every rank does                        reply value
    SetupUpdater (SETUP_UPDATER)  builds its WeightUpdater: plan share,       UpdaterReady
                                  connections, registration, checks
    TrainStep (TRAIN_STEP)        one step of its trainer backend             TrainStats
    Update (UPDATE)               one whole update of every engine            UpdateStats
    Refresh (REFRESH)             its updater's refresh(): engines replaced   bool (changed)
                                  or back rejoin the plan
    Export (EXPORT)               megatron: the stage sources write the full  Exported
                                  tensors (the run's reference copy)
    Memory (MEMORY)               the bytes it holds                          dict[str, int]
    Stop (STOP)                   releases everything and exits               None

A failure is a reply too (:attr:`Reply.error`, the rank's traceback), so that one rank's failure
stops the run everywhere with its cause. The benchmark's ranks (:mod:`~weightsync.launch.bench.worker`)
take no command: each sends one reply, its result.

Every message is a frozen record and picklable (pipes, Ray and multiprocessing queues carry them).
The module imports no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from weightsync.plan.records import Mode

if TYPE_CHECKING:  # the updater imports torch; these records do not (a node's Ray agent imports them)
    from weightsync.sync.updater import UpdaterConfig, UpdateStats  # noqa: F401 -- in Command["UpdateStats"] too

T = TypeVar("T")
R = TypeVar("R")


class Cmd(enum.StrEnum):
    """The trainer ranks' protocol: one member per command record (module docstring)."""

    SETUP_UPDATER = "setup_updater"
    TRAIN_STEP = "train_step"
    UPDATE = "update"
    REFRESH = "refresh"
    EXPORT = "export"
    MEMORY = "memory"
    STOP = "stop"


class Status(enum.StrEnum):
    OK = "ok"
    ERROR = "error"


@dataclass(frozen=True, kw_only=True, slots=True)
class Reply(Generic[T]):
    """One answer of a rank process: its value, or the error that stopped what it was asked."""

    rank: int
    """The rank that answers (a trainer rank, or a benchmark process)."""
    status: Status
    value: T | None = None
    """The command's result (``status`` OK)."""
    error: str = ""
    """What failed, with the rank's traceback (``status`` ERROR)."""

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @classmethod
    def success(cls, rank: int, value: T | None) -> Reply[T]:
        return cls(rank=rank, status=Status.OK, value=value)

    @classmethod
    def failure(cls, rank: int, error: str) -> Reply[Any]:
        return cls(rank=rank, status=Status.ERROR, error=error)


# -- replies' values -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Started:
    """A trainer rank loaded its shards and joined its process groups."""

    rank: int


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdaterReady:
    """A trainer rank built its updater."""

    ops: int
    """Its p2p ops (0 without p2p)."""
    plan_s: float
    """How long its share of the plan took."""
    bytes: int
    """Bytes its p2p sender writes per update (0 without p2p)."""
    memory: dict[str, int]
    """What it holds (:class:`Memory`'s reply)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainStats:
    """One training step of a trainer rank."""

    trainer: str
    """``synthetic`` or ``megatron``."""
    stats: dict[str, float]
    """The backend's figures (megatron: loss, mean reward, grad norm, ...; synthetic: the step)."""

    def to_json(self) -> dict[str, Any]:
        """The step record's ``train`` in ``results.json``."""
        return {**self.stats, "trainer": self.trainer}


@dataclass(frozen=True, kw_only=True, slots=True)
class Exported:
    """What a rank wrote for :class:`Export`."""

    tensors: int
    """Full tensors written (0 on ranks that are no stage source)."""


# -- commands ------------------------------------------------------------------------------------


class Command(Generic[R]):
    """A command to every trainer rank; ``R`` is the type of each rank's reply value."""

    __slots__ = ()
    cmd: ClassVar[Cmd]


@dataclass(frozen=True, kw_only=True, slots=True)
class SetupUpdater(Command[UpdaterReady]):
    cmd: ClassVar[Cmd] = Cmd.SETUP_UPDATER
    engine_urls: tuple[str, ...]
    config: UpdaterConfig
    """The run's updater configuration; each rank binds its own host to its transport."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainStep(Command[TrainStats]):
    cmd: ClassVar[Cmd] = Cmd.TRAIN_STEP
    samples: tuple[dict[str, Any], ...]
    """The engines' rollouts (the records the trainer backends read: prompt and output token ids,
    text, the engine's logprob of each output token, the prompt's answer)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Update(Command["UpdateStats"]):
    cmd: ClassVar[Cmd] = Cmd.UPDATE
    version: int
    mode: Mode


@dataclass(frozen=True, kw_only=True, slots=True)
class Refresh(Command[bool]):
    """``WeightUpdater.refresh()`` on every rank (collective): an engine restarted where one served
    (new sessions and addresses) or back from a drop takes part in the next update; the reply
    says whether the senders were rebuilt."""

    cmd: ClassVar[Cmd] = Cmd.REFRESH


@dataclass(frozen=True, kw_only=True, slots=True)
class Export(Command[Exported]):
    cmd: ClassVar[Cmd] = Cmd.EXPORT
    directory: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory(Command[dict[str, int]]):
    cmd: ClassVar[Cmd] = Cmd.MEMORY


@dataclass(frozen=True, kw_only=True, slots=True)
class Stop(Command[None]):
    cmd: ClassVar[Cmd] = Cmd.STOP


COMMANDS: tuple[type[Command[Any]], ...] = (SetupUpdater, TrainStep, Update, Refresh, Export, Memory, Stop)
"""One record per :class:`Cmd` member, in the protocol's order."""


__all__ = ["COMMANDS", "Cmd", "Command", "Export", "Exported", "Memory", "Refresh", "Reply", "SetupUpdater", "Started",
           "Status", "Stop", "TrainStats", "TrainStep", "Update", "UpdaterReady"]
