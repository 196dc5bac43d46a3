"""Plans on disk and in JSON: compact arrays, and a cache keyed by what the plan depends on.

* :func:`save_plan` / :func:`load_plan` -- one ``.npz`` file: the op table's integer columns
  plus a JSON header (mode, byte accounting, buckets, name tables). A million ops take tens of
  MB and load in well under a second.
* :func:`plan_to_dict` / :func:`plan_from_dict` -- the same content as plain JSON types
  (arrays as lists), for small plans and wire messages.
* :func:`cached_plan` -- load the plan of ``inputs.cache_key(mode, ...)`` from a directory, or
  build and store it. The key hashes the model spec, both parallel configs, the placement, the
  mode and the planner version (:data:`weightsync.plan.inputs.PLANNER_VERSION`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from weightsync.plan.records import Bucket, Plan
from weightsync.plan.table import table_from_arrays

FORMAT = "weightsync-plan/1"


def _header(plan: Plan) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "mode": plan.mode,
        "sender_bytes": list(plan.sender_bytes),
        "receiver_bytes": list(plan.receiver_bytes),
        "src_rank": plan.src_rank,
        "dst_rank": plan.dst_rank,
        "gather_bytes": plan.gather_bytes,
        "buckets": [{"src_rank": b.src_rank, "names": list(b.names), "nbytes": b.nbytes} for b in plan.buckets],
        "global_names": list(plan.table.global_names),
        "param_names": list(plan.table.param_names),
    }


def _from_header(h: dict[str, Any], arrays: dict[str, np.ndarray]) -> Plan:
    if h.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} plan (format {h.get('format')!r})")
    return Plan(
        mode=h["mode"],
        table=table_from_arrays(h["global_names"], h["param_names"], arrays),
        sender_bytes=tuple(h["sender_bytes"]),
        receiver_bytes=tuple(h["receiver_bytes"]),
        src_rank=h["src_rank"],
        dst_rank=h["dst_rank"],
        gather_bytes=h["gather_bytes"],
        buckets=tuple(Bucket(src_rank=b["src_rank"], names=tuple(b["names"]), nbytes=b["nbytes"])
                      for b in h["buckets"]),
    )


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON types: the header fields plus ``"columns"`` (array name -> nested lists)."""
    d = _header(plan)
    d["columns"] = {k: v.tolist() for k, v in plan.table.arrays().items()}
    return d


def plan_from_dict(d: dict[str, Any]) -> Plan:
    """Inverse of :func:`plan_to_dict`."""
    arrays = {k: np.asarray(v) for k, v in d["columns"].items()}
    return _from_header(d, arrays)


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write ``plan`` to ``path`` (``.npz``), atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = np.frombuffer(json.dumps(_header(plan)).encode(), dtype=np.uint8)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, header=header, **plan.table.arrays())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan written by :func:`save_plan`."""
    with np.load(path) as z:
        header = json.loads(bytes(z["header"]).decode())
        arrays = {k: z[k] for k in z.files if k != "header"}
    return _from_header(header, arrays)


def cached_plan(build: Callable[[], Plan], key: str, cache_dir: str | os.PathLike[str] | None) -> tuple[Plan, bool]:
    """The plan stored under ``key`` in ``cache_dir``, or ``build()`` stored there.

    Args:
        build: zero-argument callable that computes the plan.
        key: the cache key (:meth:`weightsync.plan.inputs.PlanInputs.cache_key`).
        cache_dir: directory of cached plans; None disables caching.

    Returns:
        ``(plan, hit)``.
    """
    if cache_dir is None:
        return build(), False
    path = Path(cache_dir) / f"{key}.npz"
    if path.exists():
        return load_plan(path), True
    plan = build()
    save_plan(plan, path)
    return plan, False
