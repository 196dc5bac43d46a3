"""What an update returns or raises: :class:`UpdateStats` (what it cost), :class:`UpdateError`.

:meth:`WeightUpdater.update <weightsync.sync.updater.WeightUpdater.update>` returns the stats (the
same on every rank, built on rank 0 from every trainer rank's write); ``run`` prints them per step
and writes :meth:`UpdateStats.to_json` into ``results.json``. A failed update raises
:class:`UpdateError` on every rank.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from weightsync.plan.records import Mode


class UpdateError(RuntimeError):
    """An update failed; the message names the failing trainer rank or engine. The engines serve
    nothing of it: a pause-free update leaves them serving their old version, a paused one
    leaves them paused at it (the next update recovers them)."""


PHASES = ("pause", "begin", "pack", "wire", "barrier", "post_load", "verify", "publish", "resume")
"""The phases of an update as the trainer's rank 0 times them, in order (they add up to the update)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateStats:
    """One update, as rank 0 of the group timed it (pack and wire: the slowest rank's)."""

    version: str
    mode: Mode
    """``p2p`` or ``broadcast``."""
    path: str
    """``p2p``, ``group`` (broadcast over a weight-update group) or ``tensor`` (colocated)."""
    pause_free: bool
    """The engines generated through the update; only the flip that published it stopped them."""
    flip: str | None
    """How the session's copy became the served one (``swap``, ``copy``; ``swap/copy`` when the
    engines differ); None where the session wrote the served copy in place (paused only)."""
    engine_idle_s: float
    """How long the engines stood still for this update (the headline). Paused: from sending
    ``pause_generation`` to the return of ``continue_generation`` (every phase, verification
    included). Pause-free: the longest flip, as the engines measured it."""
    update_s: float
    """The whole update as the trainer waited for it: the sum of :attr:`phases`."""
    phases: dict[str, float]
    """:data:`PHASES`: ``pause``, ``begin``, ``pack``, ``wire``, ``barrier`` (the rest of the write
    phase), ``post_load`` (``end_weight_update``), ``verify``, ``publish``
    (``update_weight_version``; pause-free: the flip with it), ``resume`` (``continue_generation``).
    With engines that take the control extensions (:mod:`~weightsync.sync.update_flow`), ``pause``
    and ``resume`` are 0 (done inside ``begin`` and ``publish``), and the engines' hashing inside
    ``end_weight_update`` counts as ``verify``, not ``post_load``."""
    idle_phases: dict[str, float]
    """What the engines' idle window holds: paused, every phase; pause-free, the ``flip``."""
    pause_reason: str | None
    """Why this update paused the engines (``UpdaterConfig.pause_free``, or an engine without a
    shadow copy); None for a pause-free update."""
    bytes: int
    """Bytes put on links (broadcast: what every rollout rank receives, summed)."""
    bytes_per_receiver: dict[int, int]
    buckets: int
    post_load_engine_s: float
    """The engines' own post-load time (the slowest)."""
    verified: bool | None
    """True: every engine parameter's fingerprint matched; None: not verified this update."""
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    """Each trainer rank's write stats."""
    attempts: int = 1
    """Attempts it took (more than 1 with ``UpdaterConfig.update_retries``)."""
    failed_attempts: list[str] = field(default_factory=list)
    """Why each earlier attempt failed."""
    engines: list[str] = field(default_factory=list)
    """The engines that published this version (base URLs)."""
    dropped: dict[int, str] = field(default_factory=dict)
    """Engines dropped from this update (``UpdaterConfig.on_engine_failure`` drop), by index in
    the updater's engines, with the error that dropped each (it names the engine and its URL);
    each is told it is stale and left out of later updates until it is back at the published version."""
    group_rebuild_s: float = 0.0
    """Broadcast over a group: seconds spent rebuilding the weight-update groups for the engines
    left (after a drop in this update or an earlier one); p2p rebuilds nothing (0)."""

    @classmethod
    def from_ranks(cls, *, version: str, mode: Mode, path: str, results: list[dict[str, Any]], ends: list[Any],
                   times: dict[str, float], verify_s: float, verified: bool | None, num_receivers: int,
                   broadcast_buckets: int | None, published: list[Any], pause_reason: str | None) -> UpdateStats:
        """The stats of one attempt.

        Args:
            version: the version it published.
            mode: the transfer mode it used.
            path: ``p2p``, ``group`` or ``tensor``.
            results: every trainer rank's write stats (``pack_s``, ``wire_s``, ``bytes``,
                ``bytes_by_dest``, ``buckets``).
            ends: every engine's ``end_weight_update`` answer (its ``post_load_seconds``).
            times: rank 0's marks: ``t0`` (first call sent), ``paused`` (pause returned; ``t0``
                when pause-free), ``begun``, ``written``, ``ended``, and the seconds of
                ``publish`` and ``resume``.
            verify_s: the verification's seconds (0 when not verified).
            verified: the verification's outcome (None: not verified).
            num_receivers: rollout ranks (broadcast: each receives every byte sent).
            broadcast_buckets: broadcast: the plan's buckets (p2p counts the ranks' own).
            published: every engine's ``update_weight_version`` answer (pause-free: its flip).
            pause_reason: why the engines were paused (None: pause-free).
        """
        pack = max(r["pack_s"] for r in results)
        wire = max(r["wire_s"] for r in results)
        write = times["written"] - times["begun"]
        by_dest: dict[int, int] = defaultdict(int)
        if mode is Mode.P2P:
            for r in results:
                for d, n in r["bytes_by_dest"].items():
                    by_dest[int(d)] += n
            nbytes = sum(r["bytes"] for r in results)
            buckets = sum(r["buckets"] for r in results)
        else:
            sent = sum(r["bytes"] for r in results)
            by_dest = defaultdict(int, dict.fromkeys(range(num_receivers), sent))
            nbytes = sent * num_receivers
            buckets = broadcast_buckets or 0
        post = [e.get("post_load_seconds", 0.0) if isinstance(e, dict) else 0.0 for e in ends]
        phases = {"pause": times["paused"] - times["t0"], "begin": times["begun"] - times["paused"], "pack": pack,
                  "wire": wire, "barrier": max(0.0, write - pack - wire),
                  "post_load": times["ended"] - times["written"], "verify": verify_s, "publish": times["publish"],
                  "resume": times["resume"]}
        pause_free = pause_reason is None
        flips = sorted({str(a.get("flip")) for a in published if isinstance(a, dict) and a.get("flip")})
        if pause_free:
            idle = max((float(a.get("engine_idle_s") or 0.0) for a in published if isinstance(a, dict)), default=0.0)
            idle_phases = {"flip": idle}
        else:
            idle, idle_phases = sum(phases.values()), dict(phases)
        return cls(version=version, mode=mode, path=path, pause_free=pause_free, flip="/".join(flips) or None,
                   engine_idle_s=idle, update_s=sum(phases.values()), phases=phases, idle_phases=idle_phases,
                   pause_reason=pause_reason, bytes=nbytes, bytes_per_receiver=dict(by_dest), buckets=buckets,
                   post_load_engine_s=max(post, default=0.0), verified=verified, per_rank=results)

    @property
    def write_s(self) -> float:
        return self.phases["pack"] + self.phases["wire"] + self.phases["barrier"]

    @property
    def control_s(self) -> float:
        """The control calls that move no weight: pause, begin, publish (with its flip), resume."""
        return sum(self.phases[k] for k in ("pause", "begin", "publish", "resume"))

    @property
    def verify_s(self) -> float:
        return self.phases["verify"]

    @property
    def gb_per_s(self) -> float:
        """Bytes moved per second of the write phase (GB = 1e9 bytes)."""
        return self.bytes / 1e9 / self.write_s if self.write_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["mode"] = self.mode.value
        out["bytes_per_receiver"] = {str(k): v for k, v in sorted(self.bytes_per_receiver.items())}
        out["gb_per_s"] = self.gb_per_s
        out["write_s"] = self.write_s
        out["control_s"] = self.control_s
        return out
