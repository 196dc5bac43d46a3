"""One attempt of an update, step by step: pause-free where the engines allow it, paused elsewhere.

Rank 0 of the trainer group drives the engines' control endpoints; every rank writes. The
engine's side of each call, its states and refusals: docs/engine.md, "States".

Pause-free (every engine holds a shadow copy of its parameters, ``UpdaterConfig.pause_free``
``auto`` or ``on``)::

    begin_weight_update(pause_free)     (rank 0; each engine answers the copy its session writes)
    write                               (every rank: into that copy; the engines keep generating)
    end_weight_update                   (rank 0; the engines' post-load, on the shadow)
    verify                              (every ``verify_every`` updates: the shadow's fingerprints
                                         against the trainer ranks', hashed as they wrote)
    update_weight_version               (rank 0: the publication, a flip at a step boundary,
                                         answered once flipped)

The paused transaction (an engine without a shadow copy, ``pause_free="off"``, and every engine
that is not this project's: a real sglang server publishes no shadow)::

    pause_generation -> begin_weight_update -> write -> end_weight_update -> verify
        -> update_weight_version -> continue_generation

Where every engine takes this project's control extensions (:data:`~weightsync.sync.update_options.CONTROL_EXTENSIONS`),
the same steps travel in three calls per engine, pause-free or paused: ``begin_weight_update``
pauses first (``pause_generation``), ``end_weight_update`` answers the fingerprints of the session's
copy (``fingerprint_seed``: the verification needs no call of its own) and
``update_weight_version`` continues generation (``continue_generation``). Either way rank 0 sends
``end_weight_update`` while the trainer ranks sum their partials into the expected fingerprints.

Either way the update is a transaction: only a verified session is published. On any failure rank
0 aborts every engine's session -- a pause-free engine goes on serving its old version untouched,
a paused one stays paused, dirty where the session wrote what it serves -- and every rank raises
:class:`~weightsync.sync.update_result.UpdateError` naming the failing rank or engine.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NoReturn, Protocol, TypeVar

import torch
import torch.distributed as dist

from weightsync.plan.inputs import PlanInputs
from weightsync.plan.records import Mode
from weightsync.sync.fleet import FleetError, Participants, drops
from weightsync.sync.rank_group import agree, from_rank0
from weightsync.sync.update_result import UpdateError, UpdateStats
from weightsync.sync.updater_config import UpdaterConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class WeightUpdater(Protocol):
    """What an attempt needs of :class:`weightsync.sync.updater.WeightUpdater` (which imports this)."""

    config: UpdaterConfig
    engines: Any
    """:class:`weightsync.sync.engines.Engines` (None: no engine to drive)."""
    discovered: Any
    """What rank 0 found (``pause_reason``: why updates pause the engines, None: pause-free)."""
    inputs: PlanInputs
    pg: Any
    rank: int
    train: Any
    verifier: Any
    """:class:`weightsync.sync.verify.Verifier` (or, against a real sglang,
    :class:`weightsync.sync.sglang_verify.ShareChecksum`), None when nothing is verified."""

    def write(self, mode: str | Mode = ..., *, targets: Mapping[int, int] | None = ...,
              fingerprint: tuple[torch.Tensor, int] | None = ...) -> dict[str, Any]: ...

    def path(self, mode: Mode) -> str: ...

    def broadcast_buckets(self, mode: Mode) -> int | None: ...

    def mark_stale(self) -> None: ...

    def regroup(self, engines: Sequence[int]) -> bool: ...

ABORT_WAIT_S = 10.0
"""How long a failed attempt waits for the engines to acknowledge ``abort_weight_update``."""


def run_attempt(u: WeightUpdater, version: str, m: Mode, *, verify: bool,
                excluded: Mapping[int, str] | None = None) -> UpdateStats:
    """One attempt of :meth:`WeightUpdater.update` (collective over the group; module docstring).

    Args:
        excluded: engines left out (dropped from an earlier update, not back yet), with why.

    Raises:
        UpdateError: any part failed (named), or with ``on_engine_failure`` drop every engine
            did; the engines' sessions are aborted.
    """
    eng = u.engines
    assert eng is not None
    reason = u.discovered.pause_reason
    pause_free = reason is None
    ext = u.discovered.extensions
    marks: dict[str, float] = {}
    try:
        p = Participants(eng, excluded or {}, drop=drops(u.config.on_engine_failure, len(eng.clients)))
    except FleetError as exc:
        held(u, version, [str(exc)])
    tp = u.inputs.rollout.tp

    def open_sessions() -> tuple[dict[int, int], int]:
        from weightsync.sync.engines import begin_recovering  # httpx: only where engines are driven

        marks["t0"] = marks["paused"] = time.perf_counter()
        if not pause_free and not ext:
            p.each(lambda c: c.pause_generation(), what="pause_generation")
            marks["paused"] = time.perf_counter()
        flip = u.config.flip if pause_free else None
        pause = None if pause_free or not ext else "abort"
        answers = p.each(lambda c: begin_recovering(c, pause_free=pause_free, flip=flip, pause_generation=pause),
                         what="begin_weight_update")
        marks["begun"] = time.perf_counter()
        # this attempt's fingerprint seed, unknown to any other writer
        return {e: int(a.get("target_copy", 0)) if isinstance(a, dict) else 0 for e, a in answers.items()}, \
            secrets.randbits(63)

    copies, seed = _step(u, version, p, open_sessions)
    verifier = u.verifier if verify else None
    partials = verifier.new_partials() if verifier is not None else None
    hashing = getattr(verifier, "hashes_while_writing", True)  # sglang's checksum: after the write
    fingerprint = (partials, seed) if partials is not None and m is Mode.P2P and hashing else None
    targets = {e * tp + r: c for e, c in copies.items() for r in range(tp)}
    results = _write_all(u, version, m, p, targets, fingerprint)
    marks["written"] = time.perf_counter()
    hash_at_end = ext and partials is not None

    def end() -> dict[int, Any]:
        ends = p.each(lambda c: c.end_weight_update(seed if hash_at_end else None), what="end_weight_update")
        # the engines' hashing inside end_weight_update is verification: counted there, not as post-load
        marks["ended"] = time.perf_counter() - (_hashing_s(list(ends.values())) if hash_at_end else 0.0)
        return ends

    ending = eng.submit(end) if u.rank == 0 else None  # in flight while the trainer ranks sum their partials
    expected = None
    if verifier is not None and partials is not None:
        expected = _expected(u, version, m, verifier, partials, seed)
    ends = _step(u, version, p, lambda: ending.result())  # type: ignore[union-attr]
    if verifier is not None and partials is not None:
        answers = {e: a.get("fingerprints") if isinstance(a, dict) else None for e, a in ends.items()} \
            if hash_at_end else None
        _step(u, version, p, lambda: p.drop(verifier.compare(eng, expected or {}, seed, answers=answers,
                                                             only=p.active)), what="verification")
    verify_s = time.perf_counter() - marks.get("ended", marks["written"])  # from the end's answer on rank 0
    times, published = _step(u, version, p, lambda: _publish(p, version, marks, pause_free, ext))
    stats = UpdateStats.from_ranks(version=version, mode=m, path=u.path(m), results=results,
                                   ends=[ends[e] for e in p.active], times=times, verify_s=verify_s,
                                   verified=True if verifier is not None else None,
                                   num_receivers=len(p.active) * tp, broadcast_buckets=u.broadcast_buckets(m),
                                   published=list(published.values()), pause_reason=reason)
    return replace(stats, engines=p.urls(), dropped=dict(p.dropped), group_rebuild_s=p.group_rebuild_s)


def _hashing_s(ends: Sequence[Any]) -> float:
    """The longest an engine rank spent hashing inside ``end_weight_update`` (its answer's
    ``fingerprints``)."""
    return max((float(r.get("seconds", 0.0)) for e in ends if isinstance(e, dict)
                for r in (e.get("fingerprints") or {}).get("ranks", [])), default=0.0)


def _publish(p: Participants, version: str, marks: dict[str, float], pause_free: bool,
             ext: bool) -> tuple[dict[str, float], dict[int, Any]]:
    """Rank 0's publication on the active engines: ``update_weight_version``, and generation
    continued where it was paused (in the same call where the engines take the extension); then
    the dropped engines are told they are stale. Returns the phases' marks and each answer."""
    t = time.perf_counter()
    resume_in_call = ext and not pause_free
    published = p.each(lambda c: c.update_weight_version(version, continue_generation=resume_in_call),
                       what="update_weight_version")
    tr = time.perf_counter()
    # paused engines resume: every one of a paused update, and those found paused by a pause-free one
    paused = [e for e, a in published.items()
              if not resume_in_call and (not pause_free or (isinstance(a, dict) and a.get("state") == "paused"))]
    p.each_of(paused, lambda c: c.continue_generation(), what="continue_generation")
    resume = time.perf_counter() - tr if paused else 0.0
    p.leave_dropped(version, ABORT_WAIT_S)
    return {**marks, "publish": tr - t, "resume": resume}, published


def _step(u: WeightUpdater, version: str, p: Participants, fn: Callable[[], T], what: str = "") -> T:
    """``fn()`` on rank 0 (its engine calls through ``p``), its result and who is still taking
    part on every rank; a failure (abort, or no engine left) is the attempt's (:func:`held`)."""
    def run() -> tuple[T, list[int], dict[int, str], float]:
        return fn(), p.active, p.dropped, p.group_rebuild_s

    try:
        out, p.active, p.dropped, p.group_rebuild_s = from_rank0(u.pg, run)
    except (UpdateError, ValueError) as exc:
        held(u, version, [f"{what}: {exc}" if what else str(exc)], p)
    return out


def _expected(u: WeightUpdater, version: str, m: Mode, verifier: Any, partials: torch.Tensor,
              seed: int) -> dict[int, dict[str, int]] | None:
    """The trainer side of the verification (collective): broadcast's hash-only pass, then the
    partials summed into every engine rank's expected fingerprints (on rank 0, None elsewhere).

    Raises:
        UpdateError: the hash-only pass failed on some rank; the engines' sessions are aborted.
    """
    if m is Mode.BROADCAST:
        try:
            agree(u.pg, lambda: verifier.hash_share(partials, seed), "fingerprint of the plan share")
        except (UpdateError, ValueError) as exc:
            held(u, version, [f"verification: {exc}"])
    return verifier.expected(partials, seed, same_for_every_engine=m is Mode.BROADCAST)


def _write_all(u: WeightUpdater, version: str, m: Mode, p: Participants, targets: dict[int, int],
               fingerprint: tuple[torch.Tensor, int] | None) -> list[dict[str, Any]]:
    """Every rank's write into the active engines (``targets``: rollout rank -> copy;
    ``fingerprint``: hashed as it is written); every rank learns every error.

    With drop, a p2p rank whose write failed drops its engine (the others are written to the end);
    a broadcast that failed drops the engines that no longer answer, rebuilds the weight-update
    groups for the survivors (timed: ``p.group_rebuild_s``) and broadcasts again.
    """
    tp = u.inputs.rollout.tp
    if m is Mode.BROADCAST:
        _regroup(u, version, p, [])
    for _ in range(len(p.engines.clients)):
        error = None
        local: dict[str, Any] = {}
        try:
            local = u.write(m, targets=targets, fingerprint=fingerprint, skip=p.skipped_ranks(tp),
                            tolerate=p.drop_failed)
        except Exception as exc:  # every rank's failure is reported on all
            error = f"trainer rank {u.rank}: {m} write: {type(exc).__name__}: {exc}"
        everyone: list[Any] = [None] * u.train.world_size
        dist.all_gather_object(everyone, (error, local), group=u.pg)
        errors = [e for e, _ in everyone if e]
        failed = {int(r): f"{p.engines.where(int(r) // tp)}: {m} write into rollout rank {r}: {why}"
                  for _, mine in everyone for r, why in (mine or {}).get("failed", {}).items()}
        try:
            p.drop({e: "; ".join(w for r, w in failed.items() if r // tp == e) for e in p.engines_of(failed, tp)})
        except FleetError as exc:
            held(u, version, [str(exc)])
        if not errors:
            return [r for _, r in everyone]
        if not p.drop_failed or m is Mode.P2P:
            held(u, version, errors)
        # broadcast: who is gone? the survivors get new groups and every bucket again
        _step(u, version, p, lambda: p.drop(p.unreachable()), what="after a failed broadcast")
        if not p.dropped:
            held(u, version, errors)
        _regroup(u, version, p, errors)
    held(u, version, ["every engine failed the broadcast"])


def _regroup(u: WeightUpdater, version: str, p: Participants, errors: Sequence[str]) -> None:
    """Broadcast's weight-update groups rebuilt for the active engines where they hold others
    (collective; timed into ``p.group_rebuild_s``)."""
    t0 = time.perf_counter()
    try:
        rebuilt = u.regroup(p.active)
    except (UpdateError, ValueError) as exc:
        held(u, version, [*errors, f"rebuilding the weight-update groups for the survivors: {exc}"])
    if rebuilt:
        p.group_rebuild_s += time.perf_counter() - t0


def held(u: WeightUpdater, version: str, errors: Sequence[str], p: Participants | None = None) -> NoReturn:
    """The failure step of an attempt: rank 0 aborts every engine's session (nothing of this
    attempt is ever served), and every rank raises the cause.

    Raises:
        UpdateError: always.
    """
    u.mark_stale()
    if u.rank == 0 and u.engines is not None:
        u.engines.abort_sessions(min(ABORT_WAIT_S, u.config.http_timeout_s))
    if u.discovered.pause_reason is None:
        where = "the engines keep serving their old version"
    else:
        where = "the engines stay paused and dirty at their old version"
    where += " (nothing of this update is served; the next update recovers them" + (
        u.engines.sglang_held() if u.engines is not None else "") + ")"
    log.error("update to version %s failed, %s: %s", version, where, "; ".join(errors))
    raise UpdateError(f"update to version {version} failed; {where}: " + "; ".join(errors))
