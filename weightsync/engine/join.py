"""A (re)joining engine gets the fleet's current version from a healthy peer engine (rank 0).

``serve --join-from URL[,URL...]`` starts the engine ``joining``; ``POST /join_from_peer`` moves a
stale (or freshly restarted) one there. Then, for each peer in order until one succeeds:

1. ``GET /health`` of the peer: it must hold a current, clean version (serving, paused, or
   generating through a pause-free update) -- the fleet's, when ``/mark_stale`` told this engine
   which one that is (an older version is never served);
2. a session opens on this engine's shadow (in place without one: nothing is served anyway) and
   the peer is asked, with a deadline, to write its served copy into it
   (``POST /donate_weights``, :mod:`weightsync.engine.donor`): the peer's ranks write their planned
   shares one-sided into the copy this engine's ranks published -- another TP / EP layout than
   the peer's is fine -- and answer the version and the fingerprints every rank must report;
3. post-load (vocab padding zeroed, derived tensors recomputed), then every rank's fingerprint
   of the session's copy (the same seeded hash as a trainer update's verification) is compared
   with the peer's; a single differing tensor fails the attempt;
4. the copy is flipped in at the peer's version: the engine serves.

Any failure (the peer unreachable, dying mid-copy, a refusal, a deadline, a mismatch) aborts the
session and moves on to the next peer; when every peer failed the engine is ``stale`` and its
reason names each failure. No trainer rank is involved or waited for.

Typical usage::

    joiner = Joiner(sessions, token=cfg.token)
    joiner.start(["http://10.0.0.2:30000", "http://10.0.0.3:30000"])   # sessions already joining
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from weightsync.engine.control import Op
from weightsync.engine.peer_io import model_key
from weightsync.engine.session import UpdateSessions
from weightsync.sync.engine_client import EngineClient

logger = logging.getLogger(__name__)

DONOR_STATES = ("serving", "paused", "shadow_updating", "shadow_ended")
"""The states of a peer that holds a current version to give (clean weights)."""
DEFAULT_DEADLINE_S = 300.0
MAX_NAMED = 8


class JoinError(RuntimeError):
    """One peer could not give its version (the message names the peer and why)."""


class Joiner:
    """Rank 0's side of a join (module docstring)."""

    def __init__(self, sessions: UpdateSessions, *, token: str | None = None,
                 deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        """Args:
        sessions: the engine's state (``joining`` while the join runs).
        token: the fleet's token, sent to the peers.
        deadline_s: how long one peer's copy may take.
        """
        self.sessions = sessions
        self.token = token
        self.deadline_s = deadline_s
        self.last: dict[str, Any] | None = None
        """The outcome of the last join (its peer, version, bytes and timings, or every error)."""
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """Refuse a join this engine cannot take.

        Raises:
            ValueError: no p2p transport (``serve --transport none``): no peer can write into it.
        """
        if any(i.descriptor is None for i in self.sessions.transfer_infos):
            raise ValueError("this engine has no p2p transport (serve --transport): a peer cannot write into it")

    def start(self, peers: Sequence[str]) -> threading.Thread:
        """Run :meth:`join` in a thread (the engine answers ``/health`` meanwhile)."""
        self._thread = threading.Thread(target=self.join, args=(list(peers),), name="join-from-peer", daemon=True)
        self._thread.start()
        return self._thread

    def wait(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Wait for the running join; its outcome (:attr:`last`)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.last

    def join(self, peers: Sequence[str]) -> dict[str, Any]:
        """Try each peer in order (the engine must be ``joining``); returns the outcome."""
        errors = []
        t0 = time.perf_counter()
        for url in peers:
            try:
                out = self._from(url.rstrip("/"))
            except Exception as exc:  # any failure of a peer: try the next one
                logger.warning("join from %s failed: %s", url, exc)
                errors.append(f"{url}: {exc}")
                continue
            self.last = {"success": True, "peer": url, "seconds": time.perf_counter() - t0, **out,
                         "failed_peers": errors}
            logger.info("joined from %s at version %r in %.2f s", url, out["weight_version"], self.last["seconds"])
            return self.last
        self.sessions.fail_join("; ".join(errors))
        self.last = {"success": False, "errors": errors, "state": self.sessions.state.value}
        return self.last

    def _run(self, op: Op, **args: Any) -> list[Any]:
        return self.sessions.scheduler.call(lambda: self.sessions.driver.run(op, **args), f"join ({op.value})")

    def _from(self, url: str) -> dict[str, Any]:
        """One attempt: the copy from ``url`` verified and flipped in.

        Raises:
            JoinError: the peer has no current version, or the copy does not verify.
            Any error of the peer's answer or of this engine's ranks.
        """
        self.check()
        client = EngineClient(url, timeout_s=self.deadline_s + 60.0, token=self.token)
        try:
            self.sessions.join_progress(f"joining: asking {url} for its version")
            status, health = client.health()  # {"status", "state", "weights_dirty", "weight_version", ...}
            if status is None:
                raise JoinError(f"the peer does not answer /health ({health.get('error')})")
            if health.get("state") not in DONOR_STATES or health.get("weights_dirty"):
                raise JoinError(f"the peer is {health.get('state')}{' (dirty)' if health.get('weights_dirty') else ''}"
                                f": it holds no current version to give")
            fleet = self.sessions.fleet_version
            if fleet is not None and health.get("weight_version") != fleet:
                raise JoinError(f"the peer holds version {health.get('weight_version')!r}, the fleet published "
                                f"{fleet!r}: an older version is never served")
            self.sessions.join_progress(f"joining: copying version {health.get('weight_version')!r} from {url}")
            return self._copy(client, url)
        finally:
            client.close()

    def _copy(self, client: EngineClient, url: str) -> dict[str, Any]:
        seed = secrets.randbits(63)
        begun = self._run(Op.BEGIN_UPDATE, pause_free=self.sessions.shadow)
        try:
            target = begun[0]["target_copy"]
            ranks = [{"session_id": i.session_id, "weights": i.copies[target] if target < len(i.copies) else i.weights,
                      "descriptor": i.descriptor} for i in self.sessions.transfer_infos]
            par = self.sessions.driver.engine.groups.par
            t0 = time.perf_counter()
            answer = client.donate_weights({
                "model_key": model_key(self.sessions.spec), "ranks": ranks, "seed": seed,
                "deadline_s": self.deadline_s,
                "joiner": {k: getattr(par, k) for k in ("tp", "dp", "ep", "moe_dense_tp", "dp_lm_head")}})
            copy_s = time.perf_counter() - t0
            fleet = self.sessions.fleet_version
            if fleet is not None and answer["weight_version"] != fleet:
                raise JoinError(f"the peer copied version {answer['weight_version']!r}, the fleet published {fleet!r}")
            self._run(Op.END_UPDATE)
            t1 = time.perf_counter()
            got = self._run(Op.CHECK_WEIGHTS, action="fingerprint", seed=seed)
            bad = _differ(answer["fingerprints"], [g["fingerprints"] for g in got])
            if bad:
                raise JoinError(f"the copy from {url} does not verify: " + "; ".join(bad))
            verify_s = time.perf_counter() - t1
            flip = self.sessions.finish_join(answer["weight_version"])
        except BaseException:
            try:
                self._run(Op.ABORT_UPDATE)
            except Exception:  # the first failure is the one to report
                logger.exception("aborting the join's session failed")
            raise
        return {"weight_version": answer["weight_version"], "nbytes": answer["nbytes"], "copy_s": copy_s,
                "donor_seconds": answer["seconds"], "verify_s": verify_s, **flip}


def _differ(want: Sequence[dict[str, str]], got: Sequence[dict[str, str]]) -> list[str]:
    """One line per rank whose fingerprints differ from the peer's, naming the tensors."""
    bad = []
    if len(want) != len(got):
        return [f"the peer hashed {len(want)} ranks, this engine has {len(got)}"]
    for r, (w, g) in enumerate(zip(want, got, strict=True)):
        diff = sorted([n for n in w if g.get(n) != w[n]] + [n for n in g if n not in w])
        if diff:
            more = f" and {len(diff) - MAX_NAMED} more" if len(diff) > MAX_NAMED else ""
            bad.append(f"rank {r}: {len(diff)} of {len(w)} tensors differ: {', '.join(diff[:MAX_NAMED])}{more}")
    return bad
