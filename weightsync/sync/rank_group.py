"""How the trainer ranks of one updater decide together: one rank decides, or every rank agrees.

An updater's set-up and each update step run on every trainer rank; a failure on any rank must
stop all of them with the same error, or the others would wait in the next collective until its
timeout. Both helpers are collective over the updater's process group (host objects: gloo) and
raise on every rank: :class:`ValueError` when the failure was a mismatch the caller can fix (a
layout, a name, a transport), :class:`~weightsync.sync.update_result.UpdateError` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from weightsync.sync.update_result import UpdateError

T = TypeVar("T")


def from_rank0(pg: Any, fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0 of ``pg``, its result (or error) on every rank.

    Raises:
        ValueError: ``fn`` raised one (a mismatch); UpdateError: any other failure.
    """
    box: list[Any] = [None]
    if dist.get_rank(pg) == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # shipped to every rank, which all raise it
            box[0] = ("error", isinstance(exc, ValueError), str(exc))
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    if box[0][0] == "error":
        _, mismatch, msg = box[0]
        raise (ValueError if mismatch else UpdateError)(msg)
    return box[0][1]


def agree(pg: Any, fn: Callable[[], T], what: str) -> T:
    """``fn()`` on every rank of ``pg``; when any rank fails, every rank raises with every rank's error.

    Raises:
        ValueError: some rank raised one; UpdateError: some rank failed otherwise (``what``
            and each failing trainer rank named).
    """
    rank = dist.get_rank(pg)
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # shipped to every rank
        error = (isinstance(exc, ValueError), f"trainer rank {rank}: {exc}")
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, error, group=pg)
    bad = [e for e in everyone if e]
    if bad:
        msg = f"{what}: " + "; ".join(m for _, m in bad)
        raise (ValueError if any(v for v, _ in bad) else UpdateError)(msg)
    return result  # type: ignore[return-value]
