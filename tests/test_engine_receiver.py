"""Contract of the engine's p2p receiving end: with the ``shm`` transport every published
parameter address lies inside the one registered region ``"params"`` of the descriptor, a writer
on this host that connects with that descriptor writes into the engine's inbox, and the served
parameters change only when the inbox is committed (an update session's end); a refresh (a
session's begin) wipes what was written into the inbox before. The receiver's decisions follow the
backend's capabilities (``dest_needs_staging``, the memory it moves), never the kind's name.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import one_torch_thread, tiny  # noqa: F401 -- autouse fixture
from weightsync import transport
from weightsync.layout.sglang import engine_layout
from weightsync.models.parallel import RolloutParallel
from weightsync.sync.p2p_receiver import PARAMS_REGION, Receiver


def test_shm_receiver_publishes_one_region_and_takes_writes() -> None:
    layout = engine_layout(tiny("Kimi-K2"), RolloutParallel(), 0)
    receiver, store = Receiver.open(transport.TransportConfig(kind="shm"), layout, device=torch.device("cpu"), rank=0)
    writer = transport.TransportConfig(kind="shm").make()
    try:
        desc = transport.PeerDescriptor.from_json(receiver.descriptor())
        assert desc.kind == "shm"
        assert desc.session_id == receiver.session_id
        region = desc.region(PARAMS_REGION)
        assert receiver.staged
        assert receiver.inbox is not None
        for name, (ptr, numel, esize) in receiver.inbox.transfer_info().items():
            assert region.addr <= ptr, name
            assert ptr + numel * esize <= region.end, name
        assert all(torch.count_nonzero(t.view(torch.uint8)) == 0 for _, t in store.items()), "parameters start zeroed"
        name = "model.layers.1.mlp.experts.w2_weight"
        dst = receiver.inbox[name]
        src = torch.randn(dst.shape).to(dst.dtype)
        writer.register_tensor("staging", src)
        peer = writer.connect(desc)

        def write() -> None:
            handle = writer.write(peer, [(src.data_ptr(), dst.data_ptr(), src.numel() * src.element_size())])
            writer.wait(handle, transport.deadline_after(30.0))

        write()
        assert torch.equal(dst, src)
        assert torch.count_nonzero(store[name].view(torch.uint8)) == 0, "served parameters untouched by the write"
        receiver.refresh(store)  # a session begins: what was written before it is gone
        assert torch.count_nonzero(dst.view(torch.uint8)) == 0
        write()
        receiver.commit(store)  # the session ends: the inbox is served
        assert torch.equal(store[name], src)
    finally:
        writer.close()
        store.close()
        receiver.close()


def test_unsuitable_transports_are_refused() -> None:
    layout = engine_layout(tiny("Qwen3-4B"), RolloutParallel(), 0)
    with pytest.raises(ValueError, match="receives through one of"):
        Receiver.open(transport.TransportConfig(kind="dist"), layout, device=torch.device("cpu"), rank=0)
    with pytest.raises(ValueError, match="needs a CUDA engine"):
        Receiver.open(transport.TransportConfig(kind="cuda_ipc"), layout, device=torch.device("cpu"), rank=0)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in-place"])
def test_staging_follows_the_capability_not_the_name(monkeypatch: pytest.MonkeyPatch, staged: bool) -> None:
    """The same backend staged or not, by its ``dest_needs_staging`` alone: staged, the registered
    region is an inbox apart from the served parameters; in place, it holds them."""
    from weightsync.transport.shm import ShmTransport

    monkeypatch.setattr(ShmTransport, "dest_needs_staging", staged)
    layout = engine_layout(tiny("Qwen3-4B"), RolloutParallel(), 0)
    receiver, store = Receiver.open(transport.TransportConfig(kind="shm"), layout, device=torch.device("cpu"), rank=0)
    try:
        region = transport.PeerDescriptor.from_json(receiver.descriptor()).region(PARAMS_REGION)
        served = store[layout[0].name].data_ptr()
        assert receiver.staged is staged
        assert (receiver.write_target(store) is store) is not staged
        assert (region.addr <= served < region.end) is not staged
    finally:
        store.close()
        receiver.close()


def test_no_transport_is_a_plain_allocation() -> None:
    layout = engine_layout(tiny("Qwen3-4B"), RolloutParallel(), 0)
    receiver, store = Receiver.open(None, layout, device=torch.device("cpu"), rank=0)
    try:
        assert receiver.kind == "none"
        assert receiver.descriptor() is None
        assert set(store.names()) == {t.name for t in layout}
    finally:
        store.close()
        receiver.close()
