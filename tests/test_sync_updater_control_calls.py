"""Contract: the control calls an update makes, with and without the engine's control extensions.

An engine of this project lists its extension fields in ``/server_info``
(``weightsync.control_extensions``); the updater then drives each engine with three calls per
update, paused or pause-free -- ``begin_weight_update`` (which pauses first, where the update is
paused), ``end_weight_update`` (which answers the fingerprints the verification compares) and
``update_weight_version`` (which continues generation) -- and the update is still verified and
published. An engine that lists none (a real sglang server answers no such list, and drops fields
it does not know) gets sglang's calls only: ``pause_generation``, ``begin``, ``end``,
``weights_checker`` ``fingerprint``, ``update_weight_version``, ``continue_generation``, none of
them with an extension field.

One trainer rank (a gloo group of one, in this process) and one ``weightsync serve`` engine
(Qwen3-4B tiny, TP 1, shm, dummy weights); the calls are recorded at the client's one HTTP method.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests import test_sync_updater_engine as base
from tests.e2e_helpers import serve_engine
from weightsync import UpdaterConfig, WeightUpdater
from weightsync.layout.megatron import trainer_layout
from weightsync.models import get_model
from weightsync.models.parallel import TrainParallel
from weightsync.sync.engine_client import EngineClient
from weightsync.sync.update_options import CONTROL_EXTENSIONS

SPEC = get_model("Qwen3-4B", "tiny")
TRAIN = TrainParallel(world_size=1)
ENGINE = ["Qwen3-4B", "--scale", "tiny", "--tp", "1", "--transport", "shm", "--load-format", "dummy"]
EXTENSION_FIELDS = {name.split(".")[1] for name in CONTROL_EXTENSIONS}
group = base.group  # the fixture: a gloo group of this one trainer rank

WITH = ["/begin_weight_update", "/end_weight_update", "/update_weight_version"]
"""The calls of one update, paused or pause-free."""
WITHOUT = {  # pause_free -> the calls of one update
    "off": ["/pause_generation", "/begin_weight_update", "/end_weight_update", "/weights_checker",
            "/update_weight_version", "/continue_generation"],
    "on": ["/begin_weight_update", "/end_weight_update", "/weights_checker", "/update_weight_version"],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extensions", [True, False], ids=["extensions", "sglang-calls"])
def test_an_update_makes_three_calls_with_the_extensions(group: object, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, extensions: bool) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    call = EngineClient._call

    def recorded(self: EngineClient, method: str, path: str, **kw: Any) -> Any:
        calls.append((path, dict(kw.get("json") or {})))
        return call(self, method, path, **kw)

    monkeypatch.setattr(EngineClient, "_call", recorded)
    if not extensions:  # what an engine that lists none (a real sglang server) answers
        monkeypatch.setattr(EngineClient, "control_extensions", lambda self: ())
    gen = torch.Generator().manual_seed(3)
    params = {t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype))
              for t in trainer_layout(SPEC, TRAIN, 0)}
    with serve_engine(ENGINE, tmp_path / "engine.log") as url:
        for pause_free in ("off", "on"):
            config = UpdaterConfig(mode="p2p", verify_every=1, pause_free=pause_free)
            with WeightUpdater(params, spec=SPEC, train=TRAIN, engine_urls=[url], group=group,
                               config=config) as updater:
                for version in (f"{pause_free}-1", f"{pause_free}-2"):
                    for t in params.values():
                        t.add_(1)
                    calls.clear()
                    stats = updater.update(version)
                    assert stats.verified
                    assert stats.pause_free is (pause_free == "on")
                    want = WITH if extensions else WITHOUT[pause_free]
                    assert [path for path, _ in calls] == want
                    sent = {k for _, body in calls for k in body}
                    assert bool(sent & EXTENSION_FIELDS) is extensions, sent
                    if extensions and pause_free == "off":
                        assert (stats.phases["pause"], stats.phases["resume"]) == (0.0, 0.0)
            client = EngineClient(url)
            try:
                state = client.engine_state()
                assert (state["state"], state["weight_version"], state["weights_dirty"]) == (
                    "serving", f"{pause_free}-2", False)
            finally:
                client.close()
