"""``POST /donate_weights`` on a donor engine's rank 0: copy the served weights into a joiner.

The joiner (:mod:`weightsync.engine.join`) opened a session on its shadow and sends what each of
its ranks published for that copy. Here, after the ``donate_weights`` rows of the state table
allowed it (a current, clean version: serving, paused, or a pause-free session open): every donor
rank starts its share of the planned copy in a thread (:class:`~weightsync.sync.peer_sender.PeerDonation`,
through :data:`~weightsync.engine.control.Op.DONATE_START`), the engine goes on generating, rank 0
polls until every rank is done and answers the version it copied with the fingerprints every
joiner rank must report. Flips and in-place writes wait meanwhile
(:meth:`~weightsync.engine.session_fleet.FleetSessions.begin_donation`), so the version answered is
the one every byte came from. One copy at a time: a second joiner is told to ask another peer.

Typical usage::

    donor = Donor(sessions, transport=cfg.transport)
    answer = donor.donate(DonateWeightsReqInput(...))   # {"weight_version", "fingerprints", ...}
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from weightsync.engine.control import Op
from weightsync.engine.peer_io import DonateWeightsReqInput, model_key
from weightsync.engine.scheduler import EngineTimeout
from weightsync.engine.session import UpdateSessions
from weightsync.engine.states import Conflict
from weightsync.models.parallel import RolloutParallel
from weightsync.sync.peer_sender import expected_fingerprints
from weightsync.transport import TransportConfig

logger = logging.getLogger(__name__)

POLL_S = 0.02
"""How often rank 0 asks its ranks whether their share is done."""
GRACE_S = 30.0
"""Beyond the writes' deadline: planning and connecting."""


class Donor:
    """Rank 0's side of ``/donate_weights`` (module docstring)."""

    def __init__(self, sessions: UpdateSessions, transport: TransportConfig | None) -> None:
        """Args:
        sessions: the engine's state (its flips are held during a copy).
        transport: the engine's own transport configuration, used to write when the joiner
            receives through the same kind (else that kind with its default options).
        """
        self.sessions = sessions
        self.transport = transport
        self._busy = threading.Lock()

    def donate(self, body: DonateWeightsReqInput) -> dict[str, Any]:
        """Copy the served weights into the joiner's published copy; returns ``{"weight_version",
        "fingerprints": [per joiner rank {name: hex}], "nbytes", "seconds", "per_rank"}``.

        Raises:
            ValueError: another model, or a joiner without a one-sided transport.
            Conflict: nothing current to give, or a copy to another joiner is running.
            RuntimeError: a rank's share failed (each failed rank named).
            EngineTimeout: the copy did not end in time.
        """
        spec = self.sessions.spec
        if body.model_key != model_key(spec):
            raise ValueError("the joiner serves another model than this engine (model keys differ)")
        joiner = RolloutParallel(**{**body.joiner, "num_engines": 1})
        kinds = {(r.get("descriptor") or {}).get("kind") for r in body.ranks}
        if None in kinds or len(kinds) != 1:
            raise ValueError(f"the joiner's ranks publish no common one-sided transport (kinds "
                             f"{sorted(map(str, kinds))})")
        kind = kinds.pop()
        transport = (self.transport if self.transport is not None and self.transport.kind.value == kind
                     else TransportConfig(kind=kind))
        if not self._busy.acquire(blocking=False):
            raise Conflict("this engine is copying its weights to another joining engine; ask another peer")
        try:
            version = self.sessions.begin_donation()
            try:
                return {"success": True, "weight_version": version,
                        **self._copy(body, joiner, transport)}
            finally:
                self.sessions.end_donation()
        finally:
            self._busy.release()

    def _copy(self, body: DonateWeightsReqInput, joiner: RolloutParallel,
              transport: TransportConfig) -> dict[str, Any]:
        sched, driver = self.sessions.scheduler, self.sessions.driver
        t0 = time.perf_counter()
        args = {"joiner": {k: getattr(joiner, k) for k in ("tp", "dp", "ep", "moe_dense_tp", "dp_lm_head")},
                "ranks": body.ranks, "transport": transport.to_json(), "seed": body.seed,
                "deadline_s": body.deadline_s}
        sched.call(lambda: driver.run(Op.DONATE_START, **args), "donate_weights")
        end = time.monotonic() + body.deadline_s + GRACE_S
        while True:
            outs = sched.call(lambda: driver.run(Op.DONATE_STATUS), "donate_weights")
            if all(o is not None for o in outs):
                break
            if time.monotonic() > end:
                raise EngineTimeout(f"the copy to the joiner did not end within {body.deadline_s + GRACE_S:.0f} s")
            time.sleep(POLL_S)
        failed = [f"[rank{r}] {o['error']}" for r, o in enumerate(outs) if "error" in o]
        if failed:
            raise RuntimeError("copy to the joiner failed: " + "; ".join(failed))
        par = driver.engine.groups.par
        fingerprints = expected_fingerprints(self.sessions.spec, par, joiner, [o["partials"] for o in outs],
                                             seed=body.seed)
        seconds = time.perf_counter() - t0
        nbytes = sum(o["nbytes"] for o in outs)
        logger.info("donated %.1f MB to a joiner (tp %d) in %.3f s", nbytes / 1e6, joiner.tp, seconds)
        return {"fingerprints": fingerprints, "nbytes": nbytes, "seconds": seconds,
                "per_rank": [{k: o[k] for k in ("nbytes", "num_ops", "seconds")} for o in outs]}
