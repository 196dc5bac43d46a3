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
from typing import Any, NoReturn, Protocol, TypeVar

import torch
import torch.distributed as dist

from weightsync.plan.inputs import PlanInputs
from weightsync.plan.records import Mode
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

ABORT_WAIT_S = 10.0
"""How long a failed attempt waits for the engines to acknowledge ``abort_weight_update``."""


def run_attempt(u: WeightUpdater, version: str, m: Mode, *, verify: bool) -> UpdateStats:
    """One attempt of :meth:`WeightUpdater.update` (collective over the group; module docstring).

    Raises:
        UpdateError: any part failed (named); the engines' sessions are aborted.
    """
    eng = u.engines
    assert eng is not None
    reason = u.discovered.pause_reason
    pause_free = reason is None
    ext = u.discovered.extensions
    marks: dict[str, float] = {}

    def open_sessions() -> tuple[list[int], int]:
        marks["t0"] = marks["paused"] = time.perf_counter()
        if not pause_free and not ext:
            eng.each(lambda c: c.pause_generation(), what="pause_generation")
            marks["paused"] = time.perf_counter()
        answers = eng.begin_weight_update(pause_free=pause_free, flip=u.config.flip if pause_free else None,
                                          pause_generation=None if pause_free or not ext else "abort")
        marks["begun"] = time.perf_counter()
        # this attempt's fingerprint seed, unknown to any other writer
        return [int(a.get("target_copy", 0)) if isinstance(a, dict) else 0 for a in answers], secrets.randbits(63)

    copies, seed = _on_rank0(u, version, open_sessions)
    tp = u.inputs.rollout.tp
    verifier = u.verifier if verify else None
    partials = verifier.new_partials() if verifier is not None else None
    hashing = getattr(verifier, "hashes_while_writing", True)  # sglang's checksum: after the write
    fingerprint = (partials, seed) if partials is not None and m is Mode.P2P and hashing else None
    results = _write_all(u, version, m, {g: copies[g // tp] for g in range(len(copies) * tp)}, fingerprint)
    marks["written"] = time.perf_counter()
    hash_at_end = ext and partials is not None

    def end() -> list[Any]:
        ends = eng.each(lambda c: c.end_weight_update(seed if hash_at_end else None), what="end_weight_update")
        # the engines' hashing inside end_weight_update is verification: counted there, not as post-load
        marks["ended"] = time.perf_counter() - (_hashing_s(ends) if hash_at_end else 0.0)
        return ends

    ending = eng.submit(end) if u.rank == 0 else None  # in flight while the trainer ranks sum their partials
    expected = None
    if verifier is not None and partials is not None:
        expected = _expected(u, version, m, verifier, partials, seed)
    ends = _on_rank0(u, version, lambda: ending.result())  # type: ignore[union-attr]
    if verifier is not None and partials is not None:
        answers = [e.get("fingerprints") if isinstance(e, dict) else None for e in ends] if hash_at_end else None
        bad = _on_rank0(u, version, lambda: verifier.compare(eng, expected or {}, seed, answers=answers),
                        what="verification")
        if bad:
            held(u, version, [f"{getattr(verifier, 'what', 'fingerprints')} differ: " + "; ".join(bad)])
    verify_s = time.perf_counter() - marks.get("ended", marks["written"])  # from the end's answer on rank 0
    times, published = _on_rank0(u, version, lambda: _publish(eng, version, marks, pause_free, ext))
    return UpdateStats.from_ranks(version=version, mode=m, path=u.path(m), results=results, ends=ends, times=times,
                                  verify_s=verify_s, verified=True if verifier is not None else None,
                                  num_receivers=u.inputs.rollout.world_size,
                                  broadcast_buckets=u.broadcast_buckets(m), published=published, pause_reason=reason)


def _hashing_s(ends: Sequence[Any]) -> float:
    """The longest an engine rank spent hashing inside ``end_weight_update`` (its answer's
    ``fingerprints``)."""
    return max((float(r.get("seconds", 0.0)) for e in ends if isinstance(e, dict)
                for r in (e.get("fingerprints") or {}).get("ranks", [])), default=0.0)


def _publish(eng: Any, version: str, marks: dict[str, float], pause_free: bool,
             ext: bool) -> tuple[dict[str, float], list[Any]]:
    """Rank 0's publication: ``update_weight_version`` on every engine, and generation continued
    where it was paused (in the same call where the engines take the extension); the phases' marks."""
    t = time.perf_counter()
    resume_in_call = ext and not pause_free
    published = eng.each(lambda c: c.update_weight_version(version, continue_generation=resume_in_call),
                         what="update_weight_version")
    tr = time.perf_counter()
    # paused engines resume: every one of a paused update, and those found paused by a pause-free one
    paused = [c for c, a in zip(eng.clients, published, strict=True)
              if not resume_in_call and (not pause_free or (isinstance(a, dict) and a.get("state") == "paused"))]
    for client in paused:
        client.continue_generation()
    return {**marks, "publish": tr - t, "resume": time.perf_counter() - tr if paused else 0.0}, published


def _on_rank0(u: WeightUpdater, version: str, fn: Callable[[], T], what: str = "") -> T:
    """``fn()`` on rank 0, its result on every rank; a failure is the attempt's (:func:`held`)."""
    try:
        return from_rank0(u.pg, fn)
    except (UpdateError, ValueError) as exc:
        held(u, version, [f"{what}: {exc}" if what else str(exc)])


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


def _write_all(u: WeightUpdater, version: str, m: Mode, targets: dict[int, int],
               fingerprint: tuple[torch.Tensor, int] | None) -> list[dict[str, Any]]:
    """Every rank's write (into ``targets``: rollout rank -> copy; ``fingerprint``: hashed as it is
    written); every rank learns every error."""
    error = None
    local: dict[str, Any] = {}
    try:
        local = u.write(m, targets=targets, fingerprint=fingerprint)
    except Exception as exc:  # every rank's failure is reported on all
        error = f"trainer rank {u.rank}: {m} write: {type(exc).__name__}: {exc}"
    everyone: list[Any] = [None] * u.train.world_size
    dist.all_gather_object(everyone, (error, local), group=u.pg)
    errors = [e for e, _ in everyone if e]
    if errors:
        held(u, version, errors)
    return [r for _, r in everyone]


def held(u: WeightUpdater, version: str, errors: Sequence[str]) -> NoReturn:
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
