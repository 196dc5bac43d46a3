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
  reason ``abort`` and the tokens they had; ``retract`` (and ``in_place``, which is the same
  here) stops the running batch the same way but requeues its unfinished requests *with the
  tokens they generated*: after ``continue_generation`` each re-prefills prompt + generated
  tokens (no KV is kept across a pause: the weights may change meanwhile) and goes on until its
  own ``max_new_tokens``; its one answer holds every token, the logprobs recorded when each was
  generated, and ``num_retractions``.
* ``abort_request`` ends one request (queued: at once; running: the batch stops and its other
  requests are requeued as by ``retract``) or all of them.
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

import dataclasses
import enum
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from weightsync.engine.control import Driver, Op
from weightsync.engine.engine import GenRequest, GenResult
from weightsync.engine.loader import validate_checkpoint
from weightsync.engine.sampling import SamplingParams
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


HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"
"""rid prefix of ``/health_generate`` probes (sglang's)."""


@dataclass(slots=True)
class _Pending:
    req: GenRequest
    """What runs next: the request itself, or its continuation after a retract."""
    future: Future
    partial: GenResult | None = None
    """What the request generated before it was retracted (None: never retracted)."""


def _aborted(req: GenRequest, why: str, partial: GenResult | None = None) -> GenResult:
    res = partial if partial is not None else GenResult(rid=req.rid)
    res.finish_reason = {"type": "abort", "message": why}
    return res


def _merge(partial: GenResult | None, new: GenResult) -> GenResult:
    """A retracted request's result so far followed by what its continuation generated."""
    if partial is None:
        return new
    return GenResult(
        rid=partial.rid,
        output_ids=partial.output_ids + new.output_ids,
        output_logprobs=partial.output_logprobs + new.output_logprobs,
        input_logprobs=partial.input_logprobs,
        output_top_logprobs=partial.output_top_logprobs + new.output_top_logprobs,
        output_token_ids_logprobs=partial.output_token_ids_logprobs + new.output_token_ids_logprobs,
        input_top_logprobs=partial.input_top_logprobs,
        input_token_ids_logprobs=partial.input_token_ids_logprobs,
        finish_reason=new.finish_reason,
        num_retractions=partial.num_retractions,
    )


def _continuation(req: GenRequest, done: GenResult) -> GenRequest:
    """The request that goes on from ``done``: prompt + generated tokens, no prompt logprobs again."""
    original = req.input_ids[: len(req.input_ids) - len(req.prior_output_ids)]
    return dataclasses.replace(
        req,
        input_ids=original + tuple(done.output_ids),
        prior_output_ids=tuple(done.output_ids),
        logprob_start_len=-1,
    )


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
        self._cancel: set[str] = set()
        """rids that ``abort_request`` ends while their batch runs (the others are requeued)."""
        self._rids: set[str] = set()
        """rids of every request not answered yet (sglang refuses a duplicate)."""
        self._fault: str | None = None
        """Why the engine is unhealthy (a batch failed on some rank), or None."""
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
                    for p in batch:
                        if p.future.cancelled():  # its client went away
                            self._rids.discard(p.req.rid)
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
                self._answer(p, exc=RuntimeError("the engine is shutting down"))
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
            with self._cv:
                self._fault = f"a generation batch failed: {exc}"
                for p in batch:
                    self._answer(p, exc=exc)
                self._running = False
                self._cv.notify_all()
            return
        with self._cv:
            requeue = []
            for p, r in zip(batch, results):
                merged = _merge(p.partial, r)
                aborted = bool(r.finish_reason) and r.finish_reason.get("type") == "abort"
                if aborted and self._retract and p.req.rid not in self._cancel:
                    merged.num_retractions += 1
                    requeue.append(_Pending(_continuation(p.req, merged), p.future, merged))
                else:
                    self._answer(p, (merged, version))
            self._pending.extendleft(reversed(requeue))
            self._running = False
            self._cv.notify_all()

    def _answer(self, p: _Pending, value: Any = None, exc: BaseException | None = None) -> None:
        """Resolve ``p`` and forget its rid (caller holds the lock)."""
        self._rids.discard(p.req.rid)
        _resolve(p.future, value, exc)

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
        """Queue requests; each future resolves to ``(GenResult, weight_version)``.

        Raises:
            ValueError: a rid is already in flight (sglang refuses duplicates too).
        """
        futures = []
        with self._cv:
            if self._stopped:
                raise RuntimeError("the engine is shutting down")
            dup = sorted({r.rid for r in reqs} & self._rids)
            if dup:
                raise ValueError(f"duplicate request id(s) {dup[:5]}: a request with this rid is still in flight")
            for r in reqs:
                fut: Future = Future()
                self._pending.append(_Pending(r, fut))
                self._rids.add(r.rid)
                futures.append(fut)
            self._cv.notify_all()
        return futures

    def _stop_batch(self, *, requeue: bool, cancel: set[str] = frozenset()) -> None:
        """Stop the running batch at its next step and wait; unfinished requests are requeued
        with their tokens when ``requeue`` (except ``cancel``), else answered as aborted.
        Caller holds the lock."""
        if not self._running:
            return
        self._abort, self._retract, self._cancel = True, requeue, set(cancel)
        while self._running:
            self._cv.wait()
        self._abort, self._retract, self._cancel = False, False, set()

    def _abort_all(self, why: str, retract: bool) -> int:
        """Stop the running batch (waits) and, unless retracting, answer queued requests as aborted."""
        with self._cv:
            dropped = 0
            if not retract:
                dropped = len(self._pending)
                for p in self._pending:
                    self._answer(p, (_aborted(p.req, why, p.partial), self.weight_version))
                self._pending.clear()
            self._stop_batch(requeue=retract)
            return dropped

    def abort_request(self, rid: str | None, abort_all: bool = False, message: str | None = None) -> int:
        """``/abort_request``: end request ``rid`` (or every request); returns how many ended.

        A queued request is answered at once; a running one ends at the batch's next step with
        the tokens it has (the batch's other requests are requeued and go on).
        """
        why = message or "Aborted"
        if abort_all:
            with self._cv:
                n = len(self._rids)
            self._abort_all(why, retract=False)
            return n
        with self._cv:
            for p in list(self._pending):
                if p.req.rid == rid:
                    self._pending.remove(p)
                    self._answer(p, (_aborted(p.req, why, p.partial), self.weight_version))
                    return 1
            if rid in self._rids and self._running:
                self._stop_batch(requeue=True, cancel={rid})
                return 1
            return 0

    def health_check(self, timeout_s: float) -> tuple[bool, str]:
        """``/health_generate``: generate one token (sglang's probe) within ``timeout_s``.

        The probe queues like any request (behind a pause too, as in sglang). Returns
        ``(healthy, why not)``.
        """
        if self._fault is not None:
            return False, self._fault
        probe = GenRequest(
            rid=f"{HEALTH_CHECK_PREFIX}{uuid.uuid4().hex}",
            input_ids=(0,),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        fut = self.submit([probe])[0]
        try:
            fut.result(timeout=timeout_s)
        except TimeoutError:
            with self._cv:
                self._pending = deque(p for p in self._pending if p.future is not fut)
                self._rids.discard(probe.rid)
            fut.cancel()
            return False, f"no token generated within {timeout_s:.0f} s (state {self.state.value})"
        except Exception as exc:  # the probe's own failure is the answer
            return False, f"the probe failed: {exc}"
        return True, ""

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        """``/pause_generation``: stop serving; returns once no batch runs (see the module docstring)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        with self._cv:
            if self.state is State.SERVING:
                self.state = State.PAUSED
            elif self.state is State.UPDATING:
                self._resume_to = State.PAUSED
        self._abort_all("Aborted", retract=mode != "abort")
        return {"message": "Generation paused successfully.", "status": "ok"}

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
        return {"success": True, "message": "Success"}

    def end_update(self) -> dict[str, Any]:
        """``/end_weight_update``: post-load derivations on every rank, then back to the state before."""
        with self._cv:
            if self.state is not State.UPDATING:
                raise Conflict("no weight update in progress; call /begin_weight_update first")
        timing = self._leave_update()
        return {"success": True, "message": "Success", **timing}

    def _run_update(
        self, what: str, job: Callable[[], list[Any]], weight_version: str | None, message: str
    ) -> dict[str, Any]:
        """Run an update call: inside begin ... end as it is, else as its own begin ... end."""
        implicit = self._enter_update(what, explicit=False)
        per_rank = self._call(job)
        out: dict[str, Any] = {"success": True, "per_rank": per_rank}
        if implicit:
            out.update(self._leave_update())
        if weight_version is not None:
            self.weight_version = weight_version
            message += f" Weight version updated to {weight_version}."
        out["message"] = message
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
            "Succeeded to update parameter online.",
        )

    def update_from_tensor(
        self, entries: list[str], load_format: str | None, weight_version: str | None = None
    ) -> dict[str, Any]:
        """``/update_weights_from_tensor``: every rank decodes and writes its own entry."""
        ranks = self.driver.world
        if len(entries) != ranks:
            raise ValueError(
                f"serialized_named_tensors has {len(entries)} entries; this engine has {ranks} TP ranks (one each)"
            )
        return self._run_update(
            "update_weights_from_tensor",
            lambda: self.driver.run(Op.UPDATE_FROM_TENSOR, entries=entries, load_format=load_format),
            weight_version,
            "Success",
        )

    def update_from_disk(self, path: str, weight_version: str | None = None) -> dict[str, Any]:
        """``/update_weights_from_disk``: reload every tensor from an HF checkpoint (validated first)."""
        with HFCheckpoint(path) as ckpt:
            validate_checkpoint(self.spec, ckpt)
        return self._run_update(
            "update_weights_from_disk",
            lambda: self.driver.run(Op.LOAD_CHECKPOINT, path=path),
            weight_version,
            "Succeeded to update model weights.",
        )

    def init_group(self, **kwargs: Any) -> dict[str, Any]:
        """``/init_weights_update_group`` (blocks until the trainer side joins)."""
        if kwargs["group_name"] in self._groups:
            raise ValueError(f"weight update group {kwargs['group_name']!r} exists; destroy it first")
        msgs = self._call(lambda: self.driver.run(Op.INIT_GROUP, **kwargs))
        self._groups.add(kwargs["group_name"])
        return {"success": True, "message": "Succeeded to initialize custom process group.", "per_rank": msgs}

    def destroy_group(self, group_name: str) -> dict[str, Any]:
        """``/destroy_weights_update_group``."""
        if group_name not in self._groups:
            raise ValueError("The group to be destroyed does not exist.")
        msgs = self._call(lambda: self.driver.run(Op.DESTROY_GROUP, group_name=group_name))
        self._groups.discard(group_name)
        return {"success": True, "message": "Succeeded to destroy custom process group.", "per_rank": msgs}

    def check_weights(
        self, action: str, seed: int = 0, allow_quant_error: bool = False, skip: tuple[str, ...] = ()
    ) -> list[Any]:
        """``/weights_checker``: per-rank results of ``action``."""
        if action == "reset_tensors":
            with self._cv:
                self._refuse_if_generating("reset_tensors")
                self.dirty = True
        return self._call(
            lambda: self.driver.run(
                Op.CHECK_WEIGHTS, action=action, seed=seed, allow_quant_error=allow_quant_error, skip=skip
            )
        )

    def set_weight_version(self, version: str, abort_all_requests: bool = False) -> None:
        """``/update_weight_version``."""
        if abort_all_requests:
            self._abort_all("Aborted", retract=False)
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
