"""The request bodies of the fleet's routes (extensions of this engine) and the model's identity.

* ``POST /mark_stale`` (:class:`MarkStaleReqInput`): the fleet published a version without this
  engine;
* ``POST /join_from_peer`` (:class:`JoinFromPeerReqInput`): copy the fleet's current version from
  the first healthy peer engine, verify it, then serve it (:mod:`weightsync.engine.join`);
* ``POST /donate_weights`` (:class:`DonateWeightsReqInput`): a joining engine asks this one for its
  served copy (:mod:`weightsync.engine.donor`).

Every route is token-guarded like the others. A donor and a joiner must serve the same model
(another parallel layout allowed): :func:`model_key` is what they compare.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import Field

from weightsync.engine.io_struct import RequestBody
from weightsync.models.spec import ModelSpec


def model_key(spec: ModelSpec) -> str:
    """A digest of every field of ``spec`` that shapes a tensor or the forward (not where it was read from)."""
    fields = {f: getattr(spec, f) for f in spec.__dataclass_fields__ if f != "sources"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


class MarkStaleReqInput(RequestBody):
    published_version: str
    """The version the fleet published without this engine."""


class JoinFromPeerReqInput(RequestBody):
    peers: list[str] = Field(min_length=1)
    """Peer engines' base URLs (``http://host:port``), tried in order."""
    wait: bool = False
    """Answer once the join ended (serving, or stale naming every peer's failure); else at once."""


class DonateWeightsReqInput(RequestBody):
    model_key: str
    """The joiner's :func:`model_key`: the donor refuses another model."""
    joiner: dict[str, Any]
    """The joiner's parallel sizes (``RolloutParallel`` fields: tp, dp, ep, moe_dense_tp, dp_lm_head)."""
    ranks: list[dict[str, Any]] = Field(min_length=1)
    """Per joiner rank: ``{"session_id", "weights": the table of the copy its session writes, "descriptor"}``."""
    seed: int = Field(ge=0, lt=1 << 63)
    """The fingerprint's seed (drawn by the joiner per attempt)."""
    deadline_s: float = Field(gt=0)
    """How long the writes may take."""
