"""Contract of the engine's p2p receiving end and its parameter copies: with the ``shm`` transport
every published parameter address lies inside the one registered region ``"params"`` of the
descriptor, a writer on this host that connects with that descriptor writes into the engine's
inbox (copy 0, the only published copy), and the served parameters (private memory) change only
when the session is published (a flip by copy); a session's begin wipes what was written into the
inbox before. With a shadow and an in-place transport both copies are published: a pause-free
session writes the one not served, a swap serves it (the next session writes the other), a copy
flip copies it in and keeps the served addresses; an aborted session leaves the served copy as it
was; a session opened the sglang way writes the home copy (in place when it is served). The
receiver's decisions follow the backend's capabilities (``dest_needs_staging``, the memory it
moves), never the kind's name.
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
    receiver, copies = Receiver.open(transport.TransportConfig(kind="shm"), layout, device=torch.device("cpu"), rank=0,
                                     shadow=True)
    writer = transport.TransportConfig(kind="shm").make()
    try:
        desc = transport.PeerDescriptor.from_json(receiver.descriptor())
        assert desc.kind == "shm"
        assert desc.session_id == receiver.session_id
        region = desc.region(PARAMS_REGION)
        assert (len(copies.stores), copies.published, copies.served, copies.can_swap) == (2, 1, 1, False)
        inbox, store = copies.stores
        assert len(copies.tables()) == 1
        for name, (ptr, numel, esize) in copies.tables()[0].items():
            assert region.addr <= ptr, name
            assert ptr + numel * esize <= region.end, name
        for n, t in store.items():  # zeroed, but for the constant fp8 k/v scales (1.0)
            want = store.meta[n].constant or 0.0
            assert torch.equal(t, torch.full_like(t, want)), f"{n} does not start at {want}"
        name = "model.layers.1.mlp.experts.w2_weight"
        dst = inbox[name]
        src = torch.randn(dst.shape).to(dst.dtype)
        writer.register_tensor("staging", src)
        peer = writer.connect(desc)

        def write() -> None:
            handle = writer.write(peer, [(src.data_ptr(), dst.data_ptr(), src.numel() * src.element_size())])
            writer.wait(handle, transport.deadline_after(30.0))

        write()
        assert torch.equal(dst, src)
        assert torch.count_nonzero(store[name].view(torch.uint8)) == 0, "served parameters untouched by the write"
        for pause_free in (False, True):  # the sglang way or pause-free: the inbox either way, published by a copy
            begun = copies.begin(pause_free=pause_free, flip="swap")  # what was written before is gone
            assert (begun["target_copy"], begun["flip"], begun["in_place"]) == (0, "copy", False)
            assert copies.session_store() is inbox
            assert torch.count_nonzero(dst.view(torch.uint8)) == 0
            write()
            assert torch.count_nonzero(store[name].view(torch.uint8)) == 0
            assert copies.flip()["flip"] == "copy"  # the publication: the inbox is served
            assert torch.equal(store[name], src)
            assert copies.served_store is store
            assert copies.session_store() is store
            store[name].zero_()
    finally:
        writer.close()
        copies.close()
        receiver.close()


def test_a_shadow_is_swapped_or_copied_in_and_an_abort_serves_the_old_copy() -> None:
    layout = engine_layout(tiny("Qwen3-4B"), RolloutParallel(), 0)
    receiver, copies = Receiver.open(None, layout, device=torch.device("cpu"), rank=0, shadow=True)
    name = "model.layers.0.mlp.down_proj.weight"
    try:
        a, b = copies.stores
        assert (copies.published, copies.served, copies.can_swap, copies.pause_free) == (2, 0, True, True)
        tables = copies.tables()
        assert [t[name][0] for t in tables] == [a[name].data_ptr(), b[name].data_ptr()]
        a[name].fill_(1.0)
        begun = copies.begin(pause_free=True, flip="swap")
        assert (begun["target_copy"], begun["flip"]) == (1, "swap")
        assert torch.equal(b[name], a[name]), "the shadow starts as the served copy"
        b[name].fill_(2.0)
        assert copies.served_store is a
        assert torch.all(a[name] == 1.0), "generation reads the old copy"
        out = copies.flip()
        assert (out["flip"], out["served"]) == ("swap", 1)
        assert copies.served_store is b
        assert torch.all(b[name] == 2.0)
        assert copies.begin(pause_free=True)["target_copy"] == 0, "the next session writes the other copy"
        a[name].fill_(3.0)
        copies.abort()
        assert copies.served_store is b
        assert torch.all(b[name] == 2.0), "an abort serves the old copy"
        begun = copies.begin(pause_free=True, flip="copy")
        a[name].fill_(4.0)
        out = copies.flip()
        assert out["flip"] == "copy"
        assert copies.served_store is b, "a copy flip keeps the served addresses"
        assert torch.all(b[name] == 4.0)
        begun = copies.begin(pause_free=False)  # the sglang way: the home copy (not served now)
        assert (begun["target_copy"], begun["flip"], begun["in_place"]) == (0, "swap", False)
        assert torch.all(a[name] == 4.0), "refreshed from the served copy"
        copies.flip()
        assert copies.served_store is a
        assert copies.begin(pause_free=False)["in_place"] is True, "home served: written in place"
        copies.abort()
    finally:
        copies.close()
        receiver.close()


def test_without_a_shadow_no_session_is_pause_free() -> None:
    layout = engine_layout(tiny("Qwen3-4B"), RolloutParallel(), 0)
    receiver, copies = Receiver.open(None, layout, device=torch.device("cpu"), rank=0, shadow=False)
    try:
        assert (len(copies.stores), copies.pause_free) == (1, False)
        with pytest.raises(ValueError, match="no shadow copy"):
            copies.begin(pause_free=True)
        assert copies.begin(pause_free=False)["in_place"] is True
    finally:
        copies.close()
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
    receiver, copies = Receiver.open(transport.TransportConfig(kind="shm"), layout, device=torch.device("cpu"), rank=0)
    try:
        region = transport.PeerDescriptor.from_json(receiver.descriptor()).region(PARAMS_REGION)
        served = copies.served_store[layout[0].name].data_ptr()
        assert copies.begin(pause_free=False)["in_place"] is not staged
        assert (region.addr <= served < region.end) is not staged
    finally:
        copies.close()
        receiver.close()


def test_no_transport_is_a_plain_allocation() -> None:
    layout = engine_layout(tiny("Qwen3-4B"), RolloutParallel(), 0)
    receiver, copies = Receiver.open(None, layout, device=torch.device("cpu"), rank=0)
    try:
        assert receiver.kind == "none"
        assert receiver.descriptor() is None
        assert set(copies.served_store.names()) == {t.name for t in layout}
    finally:
        copies.close()
        receiver.close()
