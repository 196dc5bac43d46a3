"""Contract: one :class:`WeightUpdater` over a live engine -- updates under TE-spec names are
bit-exact in both modes and pause-free (the engine holds a shadow copy: its inbox); a failed
update names the engine and leaves it serving its old version; with ``pause_free="off"`` the
update pauses the engine and says so, and a failure leaves it paused; an engine restarted between
updates is picked up by ``refresh()``, not by a new updater.

One trainer rank (a gloo group of one, in this process) and one ``weightsync serve`` engine
(Qwen3-4B tiny, TP 2, shm, dummy weights) on a fixed port, so that the restarted engine has the
same URL and new parameter addresses. Bit-exact: ``stats.verified`` (every engine parameter's
fingerprint equals the sum of the fingerprints of what the trainer ranks wrote into it).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.e2e_helpers import serve_engine
from tests.test_sync_updater_names import te_name
from weightsync import UpdateError, UpdaterConfig, WeightUpdater
from weightsync.layout.megatron import trainer_layout
from weightsync.models import get_model
from weightsync.models.parallel import TrainParallel
from weightsync.proc import free_port
from weightsync.sync.engine_client import EngineClient
from weightsync.sync.update_result import PHASES

SPEC = get_model("Qwen3-4B", "tiny")
TRAIN = TrainParallel(world_size=1)
ENGINE_ARGV = ["Qwen3-4B", "--scale", "tiny", "--tp", "2", "--transport", "shm", "--load-format", "dummy"]


def engine_on(port: int, log: Path):
    """``weightsync serve`` on ``port`` until the block ends (a restart gets the same URL)."""
    return serve_engine(ENGINE_ARGV, log, port=port)


@pytest.fixture(scope="module")
def group(trainer_group: object) -> object:
    """A gloo group of this one trainer rank (conftest's ``trainer_group``)."""
    return trainer_group


def te_named_params(seed: int) -> dict[str, torch.Tensor]:
    """Plain tensors of the trainer layout under their Transformer Engine spec names."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in trainer_layout(SPEC, TRAIN, 0):
        name = te_name(t.name, mla=False, moe_layer=False)
        out[name] = torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype))
    return out


def _step(params: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in params.values():
        t.add_(torch.randn(t.shape, generator=gen).to(t.dtype), alpha=1e-2)


def _state(url: str) -> str:
    return _engine(url)["state"]


def _engine(url: str) -> dict:
    client = EngineClient(url)
    try:
        return client.engine_state()
    finally:
        client.close()


@pytest.mark.timeout(300)
def test_update_failure_restart_refresh(group: object, tmp_path: Path):
    port = free_port()
    params = te_named_params(0)
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n in params)
    config = UpdaterConfig(mode="both", bucket_bytes=1 << 18, verify_every=1)
    with engine_on(port, tmp_path / "engine.log") as url:
        updater = WeightUpdater(params, spec=SPEC, train=TRAIN, engine_urls=[url], group=group, config=config)
        try:
            for version in (1, 2):  # p2p, then broadcast, under TE names
                _step(params, version)
                stats = updater.update(version)
                assert stats.verified, stats
                assert stats.mode == ("p2p" if version == 1 else "broadcast"), stats
                assert stats.bytes > 0
                assert stats.gb_per_s > 0
                assert set(stats.phases) == set(PHASES)
                assert (stats.pause_free, stats.flip, stats.pause_reason) == (True, "copy", None)  # shm: copies
                assert stats.phases["pause"] == stats.phases["resume"] == 0.0
                assert set(stats.idle_phases) == {"flip"}
                assert 0 < stats.engine_idle_s < stats.update_s
            assert _state(url) == "serving"

            # a write that did not happen: the verification finds every changed tensor and the
            # update stops, naming the engine, which goes on serving the version before it
            _step(params, 3)
            sender = updater.p2p_sender
            real_send = sender.send
            sender.send = lambda **kw: _no_write()
            with pytest.raises(UpdateError, match=rf"keep serving their old version .*fingerprints differ: engine 0 at "
                                                  rf"{url}, rank 0: .* differ"):
                updater.update(3, mode="p2p")
            assert {k: _engine(url)[k] for k in ("state", "weight_version", "weights_dirty")} == {
                "state": "serving", "weight_version": "2", "weights_dirty": False}
            sender.send = real_send
            stats = updater.update(3, mode="p2p")  # the next update publishes it
            assert stats.verified
            assert _state(url) == "serving"
        except BaseException:
            updater.close()
            raise
    # the engine is gone: the next update fails at begin, naming the engine
    with pytest.raises(UpdateError, match=rf"begin_weight_update: engine 0 at {url}"):
        updater.update(4)
    with engine_on(port, tmp_path / "engine.log") as url:  # restarted: same URL, new parameter memory
        try:
            assert updater.refresh() is True
            for version in (5, 6):
                _step(params, version)
                assert updater.update(version).verified
        finally:
            updater.close()
        # the paused transaction, asked for: its stats say so; a failure leaves the engine paused
        paused = WeightUpdater(params, spec=SPEC, train=TRAIN, engine_urls=[url], group=group,
                               config=replace(config, pause_free="off"))
        try:
            _step(params, 7)
            stats = paused.update(7, mode="p2p")
            assert stats.verified
            assert (stats.pause_free, stats.flip) == (False, "copy")  # shm: the inbox is copied in
            assert stats.pause_reason == "UpdaterConfig(pause_free='off')"
            assert stats.idle_phases == stats.phases
            assert stats.engine_idle_s == pytest.approx(stats.update_s)
            # the engine takes the control extensions: begin pauses it, the publication continues it
            assert (stats.phases["pause"], stats.phases["resume"]) == (0.0, 0.0)
            assert stats.phases["begin"] > 0
            assert stats.phases["publish"] > 0
            paused.p2p_sender.send = lambda **kw: _no_write()
            _step(params, 8)
            with pytest.raises(UpdateError, match="stay paused"):
                paused.update(8, mode="p2p")
            assert _engine(url)["state"] == "paused"
        finally:
            paused.close()


def _no_write() -> object:
    """What ``P2PSender.send`` returns, without writing anything."""
    from weightsync.sync.p2p_sender import SendStats

    return SendStats(total_s=0.0, pack_s=0.0, wire_s=0.0, bytes_direct=0, bytes_staged=0, bytes_by_dest={})
