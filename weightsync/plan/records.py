"""The plan record: the ops of one transfer mode plus the byte accounting of both modes.

Accounting (the same fields for ``p2p`` and ``broadcast``, so that the modes compare):

* ``receiver_bytes[d]`` -- bytes that arrive at rollout rank ``d`` over links. p2p: what its
  ops write. broadcast: every bucket of the whole model (each receiver gets every full tensor
  and keeps its slices).
* ``sender_bytes[s]`` -- bytes that trainer rank ``s`` puts on links. p2p: what its ops carry.
  broadcast: the stage source injects each bucket once (a ring or tree relays it onward).
* ``gather_bytes`` -- broadcast only: bytes the stage sources pull from the other trainer
  ranks of their stage to assemble full tensors (trainer-side all-gather); 0 for p2p.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from weightsync.plan.ops import CopyOp
from weightsync.plan.table import OpTable


class Mode(StrEnum):
    """The mode knob, one type from the command line down (``--mode``, ``RunConfig.mode``,
    ``UpdaterConfig.mode``, the plan's and each update's mode; strings are parsed at the edges).

    Two members are transfer modes (what a plan and one update are of); ``both`` is not a
    transfer but the two of them set up side by side, which a run, a benchmark or an updater
    alternates (:attr:`transfers`). It is a member here, not a type of its own above the plan,
    because it is a value of the same knob wherever the knob is set; the plan takes transfer
    modes only (:meth:`transfer`).
    """

    P2P = "p2p"
    """Every trainer rank writes the bytes each rollout rank needs straight into its memory."""
    BROADCAST = "broadcast"
    """The baseline: stage sources gather full tensors and broadcast them bucket by bucket."""
    BOTH = "both"
    """Both transfer modes set up; updates alternate p2p, broadcast, p2p, ..."""

    @classmethod
    def parse(cls, value: str) -> Mode:
        """``value`` as a mode (``both`` included).

        Raises:
            ValueError: not a mode (the message lists them).
        """
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown mode {value!r}: use {', '.join(cls)}") from None

    @classmethod
    def transfer(cls, value: str) -> Mode:
        """``value`` as one transfer mode (what a plan, or a single update, is of).

        Raises:
            ValueError: not a mode, or ``both`` (the message says why).
        """
        try:
            mode = cls(value)
        except ValueError:
            mode = None
        if mode is None or mode is cls.BOTH:
            raise ValueError(f"unknown transfer mode {value!r}: a plan or one update is "
                             f"{' or '.join(cls.BOTH.transfers)}") from None
        return mode

    @property
    def transfers(self) -> tuple[Mode, ...]:
        """The transfer modes this mode sets up, in the order updates alternate them."""
        return (Mode.P2P, Mode.BROADCAST) if self is Mode.BOTH else (self,)


@dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    """Broadcast: one bucket of full tensors sent by one stage source to every rollout rank."""

    src_rank: int
    names: tuple[str, ...]
    """Global tensors in the bucket, in send order."""
    nbytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The ops of one transfer (or one rank's share of them) and their byte accounting."""

    mode: Mode
    table: OpTable
    """The ops, columnar, in execution order: by destination rank, then destination layout order."""
    sender_bytes: tuple[int, ...]
    """Per trainer rank (the whole world, zeros for ranks outside a per-rank plan)."""
    receiver_bytes: tuple[int, ...]
    """Per rollout rank."""
    src_rank: int | None = None
    """Set on a per-rank plan: only this trainer rank's ops."""
    dst_rank: int | None = None
    """Set on a per-rank plan: only this rollout rank's ops."""
    buckets: tuple[Bucket, ...] = ()
    """Broadcast only."""
    gather_bytes: int = 0
    _ops: list[CopyOp] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.transfer(self.mode))  # a record read back holds the string

    @property
    def ops(self) -> list[CopyOp]:
        """The ops as records (built from :attr:`table` on first use; a million ops take seconds)."""
        if not self._ops and len(self.table):
            self._ops.extend(self.table.ops())
        return self._ops

    @property
    def num_ops(self) -> int:
        return len(self.table)

    @property
    def bytes_total(self) -> int:
        """Bytes put on links to the rollout ranks (sum over receivers)."""
        return sum(self.receiver_bytes)

    @property
    def is_partial(self) -> bool:
        return self.src_rank is not None or self.dst_rank is not None
