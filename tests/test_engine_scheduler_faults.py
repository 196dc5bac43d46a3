"""The scheduler's driver thread survives a batch whose results cannot be turned into answers:
that batch's requests get the error, and the engine goes on serving (before, the thread died
with ``running`` set, and every later request and control call hung)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from weightsync.engine.engine import GenRequest, TransferInfo
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.scheduler import Scheduler
from weightsync.engine.session import UpdateSessions
from weightsync.models import get_model


class _Driver:
    """Rank 0's driver without a model: the first generation batch answers a malformed result."""

    world = 1

    def __init__(self) -> None:
        self.engine = SimpleNamespace(spec=get_model("Qwen3-4B", "tiny"), broadcast=None, p2p=None)
        self.batches = 0

    def run(self, op: str, **args: Any) -> list[Any]:
        if op != "generate":
            return [0.0]
        self.batches += 1
        return [[object() for _ in args["reqs"]]]  # no finish_reason, no output ids: post-processing fails

    def shutdown(self) -> None:
        pass


def test_a_batch_whose_results_fail_is_answered_and_the_driver_goes_on():
    sched = Scheduler(_Driver(), job_timeout_s=10, stop_timeout_s=10)
    info = TransferInfo(session_id="none://0", weights={}, descriptor=None, copies=[{}], shadow={"pause_free": False})
    UpdateSessions(sched, transfer_infos=[info], weight_version="v0", group_timeout_s=5)  # the gate
    sched.start()
    try:
        reqs = [GenRequest(rid=f"r{i}", input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=1)) for i in range(2)]
        futures = sched.submit(reqs)
        for fut in futures:
            exc = fut.exception(timeout=10)
            assert isinstance(exc, AttributeError), exc  # the cause, handed to the caller
        assert not sched.running, "the batch is over"
        assert sched.call(lambda: "alive", what="probe", timeout_s=10) == "alive", "the driver thread still runs"
        again = sched.submit([GenRequest(rid="r0", input_ids=(1,), sampling=SamplingParams(max_new_tokens=1))])
        assert again[0].exception(timeout=10) is not None, "a later batch runs (and meets the same driver)"
        assert sched.driver.batches == 2
    finally:
        sched.stop()
