"""How a :class:`~weightsync.sync.updater.WeightUpdater` moves the weights: :class:`UpdaterConfig`.

One frozen record, filled by the caller (a training loop, ``run``'s trainer ranks, the benchmark)
and checked when it is built; strings given for the mode are parsed here, at the library's edge,
into :class:`~weightsync.plan.records.Mode`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightsync.plan.broadcast import DEFAULT_BUCKET_BYTES
from weightsync.plan.records import Mode
from weightsync.sync.fleet import ON_ENGINE_FAILURE
from weightsync.sync.update_options import FLIPS, PAUSE_FREE
from weightsync.transport import TransportConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdaterConfig:
    """How a :class:`~weightsync.sync.updater.WeightUpdater` moves the weights."""

    mode: Mode = Mode.P2P
    """``p2p``, ``broadcast``, or ``both`` (both set up; updates alternate p2p, broadcast, ...
    unless :meth:`~weightsync.sync.updater.WeightUpdater.update` is given a mode); a string is
    parsed."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Broadcast buckets and p2p staging buckets (converted tensors), in bytes (1 GiB)."""
    transport: str | TransportConfig = "auto"
    """p2p transport: ``auto`` (the one the engines publish), a kind (``shm``, ``cuda_ipc``,
    ``mooncake``), or a full :class:`TransportConfig` (backend options)."""
    colocated: bool = False
    """Trainer ranks share GPUs with the engines: broadcast hands full tensors over through
    ``/update_weights_from_tensor`` (NCCL cannot put two ranks of a group on one GPU)."""
    verify_every: int = 1
    """Verify every ``verify_every``-th update (the first included; 1: every update) before it is
    published: every engine parameter's fingerprint against the sum of the trainer ranks' partials
    of what they wrote (:mod:`weightsync.sync.verify`); 0: never."""
    deadline_s: float = 300.0
    """A p2p write not complete within this long fails the update."""
    http_timeout_s: float = 600.0
    """Per engine HTTP request."""
    group_timeout_s: float = 600.0
    """Broadcast over a group: joining a weight-update group, and one broadcast over it (the
    trainer side's gloo / NCCL timeout)."""
    update_retries: int = 0
    """A failed attempt of an update (a rank's or engine's error, a fingerprint mismatch) is tried
    again from scratch -- engines re-queried, senders rebuilt, every byte rewritten, verified --
    this many times before :class:`~weightsync.sync.update_result.UpdateError` is raised; the engines
    stay paused and dirty at the old version until an attempt verifies."""
    master_address: str = "127.0.0.1"
    """Broadcast over a group: the address the engines reach the stage sources' group stores at."""
    group_prefix: str = "weightsync"
    """Broadcast over a group: names of the weight-update groups are ``{prefix}_src{rank}_{n}``."""
    pause_free: str = "auto"
    """``auto``: pause-free updates wherever every engine holds a shadow copy (each engine's
    ``/server_info`` says), the paused transaction elsewhere; ``on``: pause-free or an error at
    construction; ``off``: always pause generation around the update."""
    flip: str = "swap"
    """How a pause-free update is published: ``swap`` (the shadow becomes the served copy; the next
    update writes the other one; an engine whose served copy no sender can address -- shm --
    copies instead) or ``copy`` (the shadow is copied into the served copy, whose addresses never
    change)."""
    on_engine_failure: str = "auto"
    """An engine that fails during an update (an error or refusal, death, a fingerprint mismatch,
    the write deadline): ``drop`` -- it is dropped from that update, the others verify and
    publish, it is told it is stale and left out of later updates until ``refresh()`` finds it
    back (:mod:`weightsync.sync.fleet`); ``abort`` -- the update fails on every engine, nothing
    is published; ``auto`` -- drop where more than one engine takes part, abort with one."""
    join_timeout_s: float = 600.0
    """How long ``refresh()`` waits for an engine that is back or new to join the published
    version from a peer; one still joining then is left out of updates until a later
    ``refresh()`` finds it serving."""
    token: str | None = field(default=None, repr=False)
    """The engines' access token, sent as ``Authorization: Bearer <token>`` on every engine call
    (an engine started with a token answers 401 / 403 without it); None: no token."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.verify_every < 0:
            raise ValueError(f"verify_every must be >= 0 (0: never), got {self.verify_every}")
        if min(self.deadline_s, self.http_timeout_s, self.group_timeout_s, self.join_timeout_s) <= 0:
            raise ValueError("deadline_s, http_timeout_s, group_timeout_s and join_timeout_s must be positive")
        if self.pause_free not in PAUSE_FREE:
            raise ValueError(f"pause_free must be one of {', '.join(PAUSE_FREE)}, got {self.pause_free!r}")
        if self.flip not in FLIPS:
            raise ValueError(f"flip must be one of {', '.join(FLIPS)}, got {self.flip!r}")
        if self.on_engine_failure not in ON_ENGINE_FAILURE:
            raise ValueError(f"on_engine_failure must be one of {', '.join(ON_ENGINE_FAILURE)}, got "
                             f"{self.on_engine_failure!r}")
        if self.update_retries < 0:
            raise ValueError(f"update_retries must be >= 0 (0: the first failed attempt raises), got "
                             f"{self.update_retries}")

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The transfer modes set up, in the order updates alternate them."""
        return self.mode.transfers
