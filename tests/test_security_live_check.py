"""Contract of the live weights check (``weightsync/engine/live_check.py``), in process:

* its digest of the served copy names every tensor a write changed, derived tensors included (a
  foreign write reaches MLA's ``w_kc`` as well as a weight), by fingerprint (a GPU's way) and by
  xxh64 (the CPU's), and the fingerprint depends on the check's seed;
* a pause-free session writes the shadow while the engine serves: the check looks at nothing then
  (the state table's ``shadow_updating, shadow_ended`` row) -- it neither finds a "foreign" write in
  the session's writes nor turns the engine dirty, and generation goes on; after the publication
  it compares against the new weights, and a write outside any session is still found;
* a checkpoint reload without a session (``/update_weights_from_disk``, sglang's rule) is a
  publication too: the check takes its reference anew instead of calling the load a foreign write.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from tests.engine_helpers import one_torch_thread, start_sessions, tiny, two_tiny_checkpoints  # noqa: F401 -- autouse fixture
from weightsync.engine.checker import WeightChecker
from weightsync.engine.control import Driver
from weightsync.engine.engine import Engine
from weightsync.engine.http_api import SESSION_HEADER, ServerContext, build_app
from weightsync.engine.live_check import LiveCheck
from weightsync.engine.tokenizer import ByteTokenizer
from weightsync.engine.tp import EngineGroups
from weightsync.layout.sglang import engine_layout
from weightsync.models.parallel import RolloutParallel
from weightsync.sync.params import ParamStore

GREEDY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}


@pytest.mark.parametrize("fingerprint", [True, False], ids=["fingerprint", "xxh64"])
def test_the_digest_names_every_changed_tensor_derived_ones_included(fingerprint: bool) -> None:
    spec = tiny("GLM-4.7-Flash")  # MLA: derived w_kc / w_vc
    store = ParamStore(engine_layout(spec, RolloutParallel(), 0), device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for _, t in store.items():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    checker = WeightChecker(store)
    derived = store.derived_names()
    assert derived, "the model has derived tensors"
    weight = next(n for n, _ in store.items() if not store.meta[n].derived and store.meta[n].constant is None)
    before = checker.live_digest(store, 7, fingerprint=fingerprint)
    assert set(derived) <= set(before)
    assert weight in before
    for name in (derived[0], weight):
        flat = store[name].view(-1)
        flat[flat.numel() // 2] += 1
        after = checker.live_digest(store, 7, fingerprint=fingerprint)
        assert {n for n in before if before[n] != after[n]} == {name}
        before = after
    if fingerprint:
        assert checker.live_digest(store, 8, fingerprint=True) != before


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return two_tiny_checkpoints(tmp_path_factory, "Qwen3-4B")


@pytest.fixture(scope="module")
def served(ckpts: tuple[str, str]) -> Iterator[tuple[TestClient, LiveCheck, Engine]]:
    spec = tiny("Qwen3-4B")
    engine = Engine.build(spec, EngineGroups.single(), device=torch.device("cpu"), shadow="auto")
    engine.load_checkpoint(ckpts[0])
    tokenizer = ByteTokenizer(spec.vocab_size)
    engine.decode = tokenizer.decode
    sessions = start_sessions(Driver(engine), weight_version="v0")
    live = LiveCheck(sessions, interval_s=0.0)
    ctx = ServerContext(sessions=sessions, tokenizer=tokenizer, par=RolloutParallel(), server_info={"model_path": "x"},
                        live_check=live)
    with TestClient(build_app(ctx)) as client:
        yield client, live, engine
    sessions.scheduler.stop()
    engine.close()


def _ok(r: Any) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def _state(c: TestClient) -> dict[str, Any]:
    return c.get("/server_info").json()["internal_states"][0]


def test_a_pause_free_session_is_not_a_foreign_write(served: tuple[TestClient, LiveCheck, Engine],
                                                     ckpts: tuple[str, str]) -> None:
    client, live, engine = served
    assert _ok(client.post("/live_weights_check"))["reference"] == "taken"
    first = _ok(client.post("/generate", json=GREEDY))
    assert first["meta_info"]["weight_version"] == "v0"
    begun = _ok(client.post("/begin_weight_update", json={"pause_free": True, "flip": "swap"}))
    assert begun["state"] == "shadow_updating", begun
    header = {SESSION_HEADER: begun["session_id"]}
    _ok(client.post("/update_weights_from_disk", json={"model_path": ckpts[1]}, headers=header))
    for _ in range(2):  # the session's writes, then its end, are the session's
        seen = _ok(client.post("/live_weights_check"))
        assert (seen["checked"], "session is open" in seen["reason"]) == (False, True), seen
        assert _state(client)["weights_dirty"] is False
        during = _ok(client.post("/generate", json=GREEDY))
        assert (during["output_ids"], during["meta_info"]["weight_version"]) == (first["output_ids"], "v0")
        if _state(client)["state"] == "shadow_updating":
            _ok(client.post("/end_weight_update", json={}, headers=header))
    assert live.found == 0
    _ok(client.post("/update_weight_version", json={"new_version": "v1"}, headers=header))
    assert _ok(client.post("/generate", json=GREEDY))["meta_info"]["weight_version"] == "v1"
    assert _ok(client.post("/live_weights_check"))["reference"] == "taken"
    assert _ok(client.post("/live_weights_check"))["match"] is True
    # a write outside any session, into the copy served now, is still found
    name = "model.norm.weight"
    engine.store[name].view(-1)[0] += 1
    found = _ok(client.post("/live_weights_check"))
    assert (found["match"], found["mismatched"]) == (False, [f"rank 0: {name}"]), found
    assert _state(client)["weights_dirty"] is True
    assert client.post("/generate", json=GREEDY).status_code == 503


def test_a_reload_from_disk_without_a_session_is_a_publication(served: tuple[TestClient, LiveCheck, Engine],
                                                                ckpts: tuple[str, str]) -> None:
    client, live, _ = served
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    _ok(client.post("/update_weights_from_disk", json={"model_path": ckpts[0], "weight_version": "d1"}))
    _ok(client.post("/continue_generation", json={}))
    assert _ok(client.post("/live_weights_check"))["reference"] == "taken"
    found = live.found
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    _ok(client.post("/update_weights_from_disk", json={"model_path": ckpts[1], "weight_version": "d2"}))
    _ok(client.post("/continue_generation", json={}))
    seen = _ok(client.post("/live_weights_check"))
    assert (seen["reference"], seen["weight_version"]) == ("taken", "d2"), seen
    assert _ok(client.post("/live_weights_check"))["match"] is True
    assert (live.found, _state(client)["weights_dirty"]) == (found, False)
    assert _ok(client.post("/generate", json=GREEDY))["meta_info"]["weight_version"] == "d2"
