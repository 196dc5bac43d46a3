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
    """An update failed; the message names the failing trainer rank or engine. The engines stay
    paused at their old version and serve nothing of it: the next update recovers them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateStats:
    """One update, as rank 0 of the group timed it (pack and wire: the slowest rank's)."""

    version: str
    mode: Mode
    """``p2p`` or ``broadcast``."""
    path: str
    """``p2p``, ``group`` (broadcast over a weight-update group) or ``tensor`` (colocated)."""
    update_s: float
    """From the return of ``pause_generation`` to the return of ``continue_generation``, the
    verify phase left out (it is reported on its own)."""
    phases: dict[str, float]
    """``pause``, ``pack``, ``wire``, ``barrier`` (the rest of the write phase, begin included),
    ``post_load`` (``end_weight_update``), ``resume`` (version + continue); ``verify``."""
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

    @classmethod
    def from_ranks(cls, *, version: str, mode: Mode, path: str, results: list[dict[str, Any]], ends: list[Any],
                   times: dict[str, float], verify_s: float, verified: bool | None, num_receivers: int,
                   broadcast_buckets: int | None) -> UpdateStats:
        """The stats of one attempt.

        Args:
            version: the version it published.
            mode: the transfer mode it used.
            path: ``p2p``, ``group`` or ``tensor``.
            results: every trainer rank's write stats (``pack_s``, ``wire_s``, ``bytes``,
                ``bytes_by_dest``, ``buckets``).
            ends: every engine's ``end_weight_update`` answer (its ``post_load_seconds``).
            times: rank 0's marks: ``t0`` (pause sent), ``t1`` (paused), ``t2`` (written),
                ``t3`` (post-load done), and ``resume`` (version + continue, seconds).
            verify_s: the verification's seconds (0 when not verified).
            verified: the verification's outcome (None: not verified).
            num_receivers: rollout ranks (broadcast: each receives every byte sent).
            broadcast_buckets: broadcast: the plan's buckets (p2p counts the ranks' own).
        """
        pack = max(r["pack_s"] for r in results)
        wire = max(r["wire_s"] for r in results)
        write = times["t2"] - times["t1"]
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
        phases = {"pause": times["t1"] - times["t0"], "pack": pack, "wire": wire,
                  "barrier": max(0.0, write - pack - wire), "post_load": times["t3"] - times["t2"],
                  "resume": times["resume"], "verify": verify_s}
        update_s = sum(v for k, v in phases.items() if k not in ("pause", "verify"))
        return cls(version=version, mode=mode, path=path, update_s=update_s, phases=phases, bytes=nbytes,
                   bytes_per_receiver=dict(by_dest), buckets=buckets, post_load_engine_s=max(post, default=0.0),
                   verified=verified, per_rank=results)

    @property
    def write_s(self) -> float:
        return self.phases["pack"] + self.phases["wire"] + self.phases["barrier"]

    @property
    def gb_per_s(self) -> float:
        """Bytes moved per second of the write phase (GB = 1e9 bytes)."""
        return self.bytes / 1e9 / self.write_s if self.write_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["mode"] = self.mode.value
        out["bytes_per_receiver"] = {str(k): v for k, v in sorted(self.bytes_per_receiver.items())}
        out["gb_per_s"] = self.gb_per_s
        return out
