"""Rank 0's scheduler: one driver thread that batches generation, serializes weight work, and owns
the engine's state machine.

States::

    SERVING --pause_generation--> PAUSED --continue_generation--> SERVING
    SERVING | PAUSED --begin_weight_update--> UPDATING --end_weight_update--> (the state before)
    SERVING (idle) | PAUSED --update_weights_from_* (implicit begin ... end)--> (the state before)

* Generation requests that arrive while PAUSED or UPDATING are **queued**, not refused: they
  start when the engine is SERVING again (``continue_generation``).
* ``pause_generation`` waits for the running batch to stop. Mode ``abort`` (sglang's default)
  ends the running batch at its next step and returns the queued requests, all with finish
  reason ``abort``; ``retract`` and ``in_place`` stop the running batch the same way but
  requeue its unfinished requests, which restart from their prompts after
  ``continue_generation`` (no KV is kept across a pause: weights may change meanwhile).
* A weight update (begin, an update call, ``reset_tensors``) while a batch runs, or while
  queued requests are about to run (SERVING with clean weights), is refused with
  :class:`Conflict` (HTTP 409): pause first.
* Weights are *dirty* from ``begin_weight_update`` (or ``reset_tensors``, or the start of an
  implicit update) until an update has ended successfully (post-load derivations done).
  Dirty weights are never served: ``continue_generation`` is refused and queued requests
  wait. A failed update leaves the engine UPDATING and dirty, at its old weight version.

Every collective runs on the driver thread; HTTP handlers (in their own threads) submit work and
wait for its future.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from weightsync.engine.control import Driver, Op
from weightsync.engine.engine import GenRequest, GenResult
from weightsync.engine.loader import validate_checkpoint
from weightsync.models.checkpoint import HFCheckpoint
from weightsync.sync.broadcast_receiver import check_update_request

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class State(enum.StrEnum):
    SERVING = "serving"
    PAUSED = "paused"
    UPDATING = "updating"


class Conflict(Exception):
    """The call conflicts with the engine's state (HTTP 409); the message says what to do."""


@dataclass(slots=True)
class _Pending:
    req: GenRequest
    future: Future


def _aborted(req: GenRequest, why: str) -> GenResult:
    return GenResult(rid=req.rid, finish_reason={"type": "abort", "message": why})


def _resolve(fut: Future, value: Any = None, exc: BaseException | None = None) -> None:
    """Complete ``fut`` unless its waiter gave up (a cancelled future cannot take a result)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    except InvalidStateError:
        pass  # cancelled by its waiter (client gone): nobody to answer


class Scheduler:
    """See the module docstring.

    Typical usage::

        sched = Scheduler(driver, transfer_infos=driver.run(Op.TRANSFER_INFO))
        sched.start()
        result, version = sched.submit([req])[0].result()
        sched.stop()
    """

    def __init__(
        self, driver: Driver, *, transfer_infos: list[Any], max_batch_size: int = 32, weight_version: str = "default"
    ) -> None:
        self.driver = driver
        self.spec = driver.engine.spec
        self.transfer_infos = transfer_infos
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.state = State.SERVING
        self.dirty = False
        self._resume_to = State.SERVING
        self._groups: set[str] = set()
        self._cv = threading.Condition()
        self._pending: deque[_Pending] = deque()
        self._jobs: deque[tuple[Callable[[], Any], Future]] = deque()
        self._running = False
        self._abort = False
        self._retract = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-driver", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish the running work, fail queued requests, release the worker ranks."""
        with self._cv:
            self._stopped = True
            self._abort = True
            self._cv.notify_all()
        self._thread.join()
        self.driver.shutdown()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._jobs or (self._can_generate() and self._pending)):
                    self._cv.wait()
                if self._jobs:
                    job, fut = self._jobs.popleft()
                    batch = None
                elif self._stopped:
                    break
                else:
                    batch = [self._pending.popleft() for _ in range(min(self.max_batch_size, len(self._pending)))]
                    batch = [p for p in batch if not p.future.cancelled()]
                    if not batch:
                        continue
                    self._running = True
                    version = self.weight_version
            if batch is None:
                self._run_job(job, fut)
            else:
                self._run_batch(batch, version)
        with self._cv:
            for p in self._pending:
                _resolve(p.future, exc=RuntimeError("the engine is shutting down"))
            self._pending.clear()

    def _can_generate(self) -> bool:
        return self.state is State.SERVING and not self.dirty

    @staticmethod
    def _run_job(job: Callable[[], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(job())
        except BaseException as exc:  # handed to the waiting caller, which re-raises it
            fut.set_exception(exc)

    def _run_batch(self, batch: list[_Pending], version: str) -> None:
        try:
            results = self.driver.run(Op.GENERATE, should_abort=lambda: self._abort, reqs=[p.req for p in batch])[0]
        except BaseException as exc:
            for p in batch:
                _resolve(p.future, exc=exc)
            results = None
        with self._cv:
            if results is not None:
                requeue = []
                for p, r in zip(batch, results):
                    if self._retract and r.finish_reason and r.finish_reason.get("type") == "abort":
                        requeue.append(p)
                    else:
                        _resolve(p.future, (r, version))
                self._pending.extendleft(reversed(requeue))
            self._running = False
            self._cv.notify_all()

    def _call(self, job: Callable[[], Any]) -> Any:
        """Run ``job`` on the driver thread (after the running batch) and wait for its result."""
        fut: Future = Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("the engine is shutting down")
            self._jobs.append((job, fut))
            self._cv.notify_all()
        return fut.result()

    # ------------------------------------------------------------------ generation

    def submit(self, reqs: list[GenRequest]) -> list[Future]:
        """Queue requests; each future resolves to ``(GenResult, weight_version)``."""
        futures = []
        with self._cv:
            if self._stopped:
                raise RuntimeError("the engine is shutting down")
            for r in reqs:
                fut: Future = Future()
                self._pending.append(_Pending(r, fut))
                futures.append(fut)
            self._cv.notify_all()
        return futures

    def _abort_all(self, why: str, retract: bool) -> int:
        """Stop the running batch (waits) and, unless retracting, answer queued requests as aborted."""
        with self._cv:
            dropped = 0
            if not retract:
                dropped = len(self._pending)
                for p in self._pending:
                    _resolve(p.future, (_aborted(p.req, why), self.weight_version))
                self._pending.clear()
            if self._running:
                self._abort, self._retract = True, retract
                while self._running:
                    self._cv.wait()
                self._abort = self._retract = False
            return dropped

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        """``/pause_generation``: stop serving; returns once no batch runs (see the module docstring)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        with self._cv:
            if self.state is State.SERVING:
                self.state = State.PAUSED
            elif self.state is State.UPDATING:
                self._resume_to = State.PAUSED
        self._abort_all("generation paused (abort mode)", retract=mode != "abort")
        return {"message": "Generation paused successfully.", "status": "ok", "state": self.state.value}

    def resume(self) -> dict[str, Any]:
        """``/continue_generation``."""
        with self._cv:
            if self.state is State.UPDATING:
                raise Conflict("a weight update is in progress; call /end_weight_update first")
            if self.dirty:
                raise Conflict(
                    "the weights were reset or partly written and no update has completed since; "
                    "finish an update (end_weight_update) before serving"
                )
            self.state = State.SERVING
            self._cv.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # ------------------------------------------------------------------ weight updates

    def _refuse_if_generating(self, what: str) -> None:
        # Queued requests only count while they can run (SERVING with clean weights).
        if self._running or (self._can_generate() and self._pending):
            raise Conflict(f"{what} while generation is in progress; call /pause_generation first")

    def _enter_update(self, what: str, *, explicit: bool) -> bool:
        """Move to UPDATING (dirty); False when already UPDATING (inside begin ... end)."""
        with self._cv:
            if self.state is State.UPDATING:
                if explicit:
                    raise Conflict("a weight update is already in progress (begin_weight_update was called)")
                return False
            self._refuse_if_generating(what)
            self._resume_to = self.state
            self.state = State.UPDATING
            self.dirty = True
            return True

    def _leave_update(self) -> dict[str, Any]:
        seconds = self._call(lambda: self.driver.run(Op.POST_LOAD))
        with self._cv:
            self.dirty = False
            self.state = self._resume_to
            self._cv.notify_all()
        return {"post_load_seconds": max(seconds), "per_rank_post_load_seconds": seconds}

    def begin_update(self) -> dict[str, Any]:
        """``/begin_weight_update``: from now on the weights may be half-written."""
        self._enter_update("begin_weight_update", explicit=True)
        return {"success": True, "message": "weight update begun; generation is held until end_weight_update"}

    def end_update(self) -> dict[str, Any]:
        """``/end_weight_update``: post-load derivations on every rank, then back to the state before."""
        with self._cv:
            if self.state is not State.UPDATING:
                raise Conflict("no weight update in progress; call /begin_weight_update first")
        timing = self._leave_update()
        return {
            "success": True,
            "message": f"weight update ended; post-load {timing['post_load_seconds']:.4f} s",
            **timing,
        }

    def _run_update(self, what: str, job: Callable[[], list[Any]], weight_version: str | None) -> dict[str, Any]:
        implicit = self._enter_update(what, explicit=False)
        per_rank = self._call(job)
        out: dict[str, Any] = {"success": True, "per_rank": per_rank}
        if implicit:
            out.update(self._leave_update())
        if weight_version is not None:
            self.weight_version = weight_version
        out["message"] = f"{what} done" + (f"; weight version {weight_version}" if weight_version else "")
        return out

    def update_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """``/update_weights_from_distributed``: receive full tensors from the trainer's group."""
        check_update_request(self.spec, names, dtypes, shapes)
        if group_name not in self._groups:
            raise ValueError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        return self._run_update(
            "update_weights_from_distributed",
            lambda: self.driver.run(
                Op.UPDATE_FROM_DISTRIBUTED, names=names, dtypes=dtypes, shapes=shapes, group_name=group_name
            ),
            weight_version,
        )

    def update_from_disk(self, path: str, weight_version: str | None = None) -> dict[str, Any]:
        """``/update_weights_from_disk``: reload every tensor from an HF checkpoint (validated first)."""
        with HFCheckpoint(path) as ckpt:
            validate_checkpoint(self.spec, ckpt)
        return self._run_update(
            "update_weights_from_disk", lambda: self.driver.run(Op.LOAD_CHECKPOINT, path=path), weight_version
        )

    def init_group(self, **kwargs: Any) -> dict[str, Any]:
        """``/init_weights_update_group`` (blocks until the trainer side joins)."""
        if kwargs["group_name"] in self._groups:
            raise ValueError(f"weight update group {kwargs['group_name']!r} exists; destroy it first")
        msgs = self._call(lambda: self.driver.run(Op.INIT_GROUP, **kwargs))
        self._groups.add(kwargs["group_name"])
        return {"success": True, "message": msgs[0]}

    def destroy_group(self, group_name: str) -> dict[str, Any]:
        """``/destroy_weights_update_group``."""
        if group_name not in self._groups:
            raise ValueError(f"no weight update group {group_name!r}")
        msgs = self._call(lambda: self.driver.run(Op.DESTROY_GROUP, group_name=group_name))
        self._groups.discard(group_name)
        return {"success": True, "message": msgs[0]}

    def check_weights(self, action: str, seed: int = 0) -> list[Any]:
        """``/weights_checker``: per-rank results of ``action``."""
        if action == "reset_tensors":
            with self._cv:
                self._refuse_if_generating("reset_tensors")
                self.dirty = True
        return self._call(lambda: self.driver.run(Op.CHECK_WEIGHTS, action=action, seed=seed))

    def set_weight_version(self, version: str, abort_all_requests: bool = False) -> None:
        """``/update_weight_version``."""
        if abort_all_requests:
            self._abort_all("aborted by update_weight_version", retract=False)
        with self._cv:
            self.weight_version = version

    def flush_cache(self) -> bool:
        """``/flush_cache``: no KV outlives a batch, so this only reports whether the engine is idle."""
        with self._cv:
            return not self._running

    def prompt_logits(self, prompts: list[list[int]]) -> Any:
        """Full logits of each prompt (debug and tests); waits for the running batch."""
        return self._call(lambda: self.driver.run(Op.PROMPT_LOGITS, prompts=prompts))[0]

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {
                "state": self.state.value,
                "weights_dirty": self.dirty,
                "weight_version": self.weight_version,
                "num_queued": len(self._pending),
                "batch_running": self._running,
            }
