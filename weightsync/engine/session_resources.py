"""The engine's resources outside the weights: the weight-update groups and the memory occupation.

A mixin of :class:`~weightsync.engine.session.UpdateSessions` (the same lock, the same table,
:data:`weightsync.engine.states.TRANSITIONS`): ``/init_weights_update_group`` and
``/destroy_weights_update_group`` (every rank joins in the background, the engine generates
meanwhile), ``/release_memory_occupation`` and ``/resume_memory_occupation`` (the tags are
recorded, nothing is freed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from weightsync.engine.control import Op
from weightsync.engine.scheduler import Scheduler
from weightsync.engine.states import Event, Rule

DEFAULT_GROUP_TIMEOUT_S = 600.0
GROUP_POLL_S = 0.05

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""sglang's ``srt/constants.py`` ``GPU_MEMORY_ALL_TYPES``."""


def _memory_tags(tags: list[str] | None) -> list[str]:
    """The tags of a memory call (sglang: None or [] means all).

    Raises:
        ValueError: a tag sglang does not have.
    """
    unknown = sorted(set(tags or ()) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}: sglang's are {', '.join(MEMORY_TAGS)}")
    return list(tags) if tags else list(MEMORY_TAGS)


class GroupError(RuntimeError):
    """Joining a weight-update group failed (HTTP 400 with sglang's message)."""


class ResourceSessions:
    """The group and memory rows (module docstring)."""

    lock: threading.Condition
    scheduler: Scheduler
    driver: Any
    group_timeout_s: float
    released: set[str]
    _groups: set[str]
    _joining: set[str]
    _decide: Callable[..., Rule]

    def release_memory(self, tags: list[str] | None) -> None:
        """``/release_memory_occupation`` (the ``release_memory_occupation`` rows): nothing is
        freed; the tags (all when None or empty) are recorded.

        Raises:
            NotIdle: generation in progress (sglang's assertion, its message).
            ValueError: a tag sglang does not have.
        """
        tags = _memory_tags(tags)
        with self.lock:
            self._decide(Event.RELEASE)
            self.released |= set(tags)

    def resume_memory(self, tags: list[str] | None) -> None:
        """``/resume_memory_occupation``: the tags (all when None or empty) are cleared.

        Raises:
            ValueError: a tag sglang does not have.
        """
        tags = _memory_tags(tags)
        with self.lock:
            self._decide(Event.RESUME)
            self.released -= set(tags)

    def init_group(self, **kwargs: Any) -> dict[str, Any]:
        """``/init_weights_update_group``: every rank joins in the background (the engine generates
        meanwhile) and this call waits at most ``group_timeout_s`` for all of them.

        Raises:
            ValueError: the group exists.
            EngineTimeout: the rendezvous did not complete in time (names the master).
            RuntimeError: a rank failed to join (its message).
        """
        name = kwargs["group_name"]
        where = f"{kwargs['master_address']}:{kwargs['master_port']}"
        with self.lock:
            if name in self._groups or name in self._joining:
                raise ValueError(f"weight update group {name!r} exists; destroy it first")
            self._joining.add(name)
        try:
            self.scheduler.call(lambda: self.driver.run(Op.INIT_GROUP_START, **kwargs), "init_weights_update_group")
            deadline = time.monotonic() + self.group_timeout_s + 5.0  # the ranks' own deadline comes first
            while True:
                statuses = self.scheduler.call(lambda: self.driver.run(Op.GROUP_STATUS, group_name=name),
                                               "init_weights_update_group")
                failed = [s for s in statuses if s not in ("ok", "pending")]
                if failed or all(s == "ok" for s in statuses):
                    break
                if time.monotonic() >= deadline:
                    failed = [f"the rendezvous with the master at {where} did not complete within "
                              f"{self.group_timeout_s:.0f} s"]
                    break
                time.sleep(GROUP_POLL_S)
            if failed:
                self.scheduler.call(lambda: self.driver.run(Op.ABANDON_GROUP, group_name=name),
                                    "init_weights_update_group")
                raise GroupError("; ".join(failed))
        finally:
            with self.lock:
                self._joining.discard(name)
        with self.lock:
            self._groups.add(name)
        return {"success": True, "message": "Succeeded to initialize custom process group.", "per_rank": statuses}

    def destroy_group(self, group_name: str) -> dict[str, Any]:
        """``/destroy_weights_update_group``."""
        if group_name not in self._groups:
            raise ValueError("The group to be destroyed does not exist.")
        with self.lock:
            self.driver.engine.broadcast.cancel_receives()  # a receive in flight on it ends
        msgs = self.scheduler.call(lambda: self.driver.run(Op.DESTROY_GROUP, group_name=group_name),
                                   "destroy_weights_update_group")
        self._groups.discard(group_name)
        return {"success": True, "message": "Succeeded to destroy custom process group.", "per_rank": msgs}
