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
    """A transfer mode: the plan's, and each update's (a run of both modes alternates them)."""

    P2P = "p2p"
    """Every trainer rank writes the bytes each rollout rank needs straight into its memory."""
    BROADCAST = "broadcast"
    """The baseline: stage sources gather full tensors and broadcast them bucket by bucket."""

    @classmethod
    def parse(cls, value: str) -> Mode:
        """``value`` as a mode.

        Raises:
            ValueError: not a mode (the message lists them).
        """
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown plan mode {value!r}; choose one of {', '.join(cls)}") from None


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
        object.__setattr__(self, "mode", Mode.parse(self.mode))  # a record read back holds the string

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
