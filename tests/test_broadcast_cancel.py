"""Contract: a broadcast receive whose source went quiet ends when it is cancelled, not at the
group's deadline, and its group is destroyed without waiting for gloo.

A trainer that gives up on a broadcast (another engine died mid-bucket) leaves the survivors
waiting in the broken receive; their engine's abort or group destroy must end it at once, or
every later call -- the destroy, the new group's join -- queues behind it until the group
timeout. Here one :class:`BroadcastReceiver` (tiny Qwen3, CPU) joins a gloo group with a source
in this process that never sends: a receive accepted before :meth:`cancel_receives` raises
:class:`ReceiveCancelled` naming the tensor and the group within a second (the deadline is 60 s),
``destroy_group`` then returns at once, and the cancel counter, shared through a
``multiprocessing`` ``RawValue`` as the engine's ranks share it, ends a receive as well.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.engine_helpers import tiny
from weightsync.layout.sglang import engine_layout
from weightsync.models.parallel import RolloutParallel
from weightsync.proc import free_port
from weightsync.sync.broadcast_receiver import BroadcastReceiver, ReceiveCancelled
from weightsync.sync.params import ParamStore
from weightsync.transport.group import new_weight_update_group

TIMEOUT_S = 60.0
MODEL = "Qwen3-4B"


def _joined(receiver: BroadcastReceiver, name: str) -> object:
    """A gloo group of (this process's source, ``receiver``); the source's side is returned."""
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        src = pool.submit(new_weight_update_group, master_address="127.0.0.1", master_port=port, rank=0,
                          world_size=2, group_name=name, backend="gloo",
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
        receiver.init_group(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
                            group_name=name, backend="gloo")
        return src.result(timeout=TIMEOUT_S)


@pytest.mark.parametrize("shared", [False, True], ids=["own-counter", "shared-counter"])
@pytest.mark.timeout(120)
def test_a_cancelled_receive_ends_at_once_and_its_group_is_destroyed(shared: bool) -> None:
    spec = tiny(MODEL)
    store = ParamStore(list(engine_layout(spec, RolloutParallel(), 0)), torch.device("cpu"))
    receiver = BroadcastReceiver(store, spec, 0, timeout_s=TIMEOUT_S)
    if shared:
        receiver.cancel = mp.get_context("spawn").RawValue("q", 0)
    name = f"cancel-{int(shared)}"
    source = _joined(receiver, name)
    embed = "model.embed_tokens.weight"
    shape = [spec.vocab_size, spec.hidden_size]
    errors: list[BaseException] = []
    epoch = receiver.cancel.value

    def receive() -> None:
        try:
            receiver.receive(names=[embed], dtypes=["bfloat16"], shapes=[shape], group_name=name, epoch=epoch)
        except BaseException as exc:  # the assertion below reads it
            errors.append(exc)

    t = threading.Thread(target=receive)
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), f"the receive ended before anything was sent: {errors}"
    t0 = time.monotonic()
    receiver.cancel_receives()
    t.join(timeout=10)
    took = time.monotonic() - t0
    assert not t.is_alive(), "the receive went on after it was cancelled"
    assert took < 2.0, f"the receive went on {took:.1f} s after it was cancelled"
    assert [type(e) for e in errors] == [ReceiveCancelled], errors
    assert embed in str(errors[0]), errors[0]
    assert repr(name) in str(errors[0]), errors[0]
    t0 = time.monotonic()
    assert "in the background" in receiver.destroy_group(name)
    assert time.monotonic() - t0 < 2.0, "destroying the group waited for gloo"
    with pytest.raises(ValueError, match="no weight update group"):
        receiver.receive(names=[embed], dtypes=["bfloat16"], shapes=[shape], group_name=name)
    del source
