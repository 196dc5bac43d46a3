"""Contract of pause-free updates on the engine (in-process app over a one-rank engine with a shadow
copy): a session opened with ``pause_free`` writes the shadow while generation goes on from the
served copy (answers unchanged, no 503, no abort); its publication is a flip at a step boundary of
the running batch -- swap or copy, bit-exact either way -- and the answer that spans it says from
which output token the new version generated (``weight_version_spans``); ``recompute`` re-prefills
the running requests under the new version and ``abort`` ends them; an aborted session leaves the
old version served, untouched; an engine without a shadow refuses pause-free with 409; a session
opened the sglang way after a swap writes the home copy, whose published addresses are the served
ones again after it.

The multi-rank property -- every rank flips at the same step and no forward step reads two
versions -- is tests/test_engine_pause_free_tp.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from tests.engine_helpers import one_torch_thread, start_sessions, tiny, two_tiny_checkpoints  # noqa: F401
from weightsync.engine.control import Driver
from weightsync.engine.engine import Engine, GenRequest
from weightsync.engine.http_api import ServerContext, build_app
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import ByteTokenizer
from weightsync.engine.tp import EngineGroups
from weightsync.models.parallel import RolloutParallel

MODEL = "Qwen3-30B-A3B"
"""A model whose tiny synthetic weights answer greedily with varied tokens (Qwen3-4B's repeat one)."""
PROMPT = [7, 3, 99, 41, 5]
LONG = 200
"""New tokens of the request that spans a flip (the flip comes a few steps in: long enough that the
batch still runs then, on an idle machine too)."""
REF = 40
"""Greedy tokens of each version computed apart, to compare an answer's first tokens with."""
PUBLISH = {"new_version": "v1", "abort_all_requests": False}
"""The publication, as the updater sends it (sglang's default aborts every running request)."""
Serve = Callable[..., tuple[TestClient, Engine]]
"""The ``serve`` fixture's builder."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two checkpoints of one model: the version served at start and the one an update brings."""
    return two_tiny_checkpoints(tmp_path_factory, MODEL)


def _engine(ckpt: str, shadow: str = "auto") -> Engine:
    engine = Engine.build(tiny(MODEL), EngineGroups.single(), device=torch.device("cpu"), shadow=shadow)
    engine.load_checkpoint(ckpt)
    return engine


def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    req = GenRequest(rid="ref", input_ids=tuple(prompt), sampling=SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                                ignore_eos=True))
    return engine.generate([req])[0].output_ids


@pytest.fixture(scope="module")
def refs(ckpts: tuple[str, str]) -> dict[str, Any]:
    """Greedy tokens of :data:`PROMPT` under each version, and each version's checksums."""
    out: dict[str, Any] = {}
    for key, path in zip("ab", ckpts, strict=True):
        engine = _engine(path, shadow="off")
        out[key] = _greedy(engine, PROMPT, REF)
        out[key + "_sums"] = engine.checker.checksum()["checksums"]
        out[key + "_engine"] = engine
    yield out
    for key in "ab":
        out[key + "_engine"].close()


@pytest.fixture
def serve(ckpts: tuple[str, str]) -> Iterator[Serve]:
    """``serve(shadow=..., in_flight_at_flip=...)``: an app over a fresh engine serving version v0."""
    made: list[tuple[Any, Engine, TestClient]] = []

    def build(shadow: str = "auto", in_flight_at_flip: str = "keep") -> tuple[TestClient, Engine]:
        engine = _engine(ckpts[0], shadow)
        sessions = start_sessions(Driver(engine), weight_version="v0", in_flight_at_flip=in_flight_at_flip)
        app = build_app(ServerContext(sessions=sessions, tokenizer=ByteTokenizer(engine.spec.vocab_size),
                                      par=RolloutParallel(), server_info={"model": MODEL}))
        client = TestClient(app)
        client.__enter__()
        made.append((sessions, engine, client))
        return client, engine

    yield build
    for sessions, engine, client in made:
        client.__exit__(None, None, None)
        sessions.scheduler.stop()
        engine.close()


def _gen(c: TestClient, n: int = 8, prompt: list[int] = PROMPT) -> Any:
    r = c.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0.0,
                                                                          "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _state(c: TestClient) -> dict[str, Any]:
    return c.get("/server_info").json()["internal_states"][0]


def _during_long(c: TestClient, call: Callable[[], Any]) -> tuple[Any, Any]:
    """Start a :data:`LONG` request, run ``call`` a few of its tokens in; both answers."""
    with ThreadPoolExecutor(1) as pool:
        long: Future = pool.submit(_gen, c, LONG)
        t0 = time.monotonic()
        while not _state(c)["batch_running"]:
            assert time.monotonic() - t0 < 30, "the long request never started"
            time.sleep(0.005)
        time.sleep(0.3)  # a few tokens under the old version first
        out = call()
        return out, long.result(timeout=120)


def _shadow_session(c: TestClient, ckpt: str, flip: str) -> dict[str, Any]:
    """A pause-free session that writes ``ckpt`` into the shadow and ends, generation going on."""
    begun = c.post("/begin_weight_update", json={"pause_free": True, "flip": flip})
    assert begun.status_code == 200, begun.text
    assert (begun.json()["state"], begun.json()["pause_free"]) == ("shadow_updating", True)
    assert c.post("/update_weights_from_disk", json={"model_path": ckpt}).status_code == 200
    ended = c.post("/end_weight_update").json()
    assert (ended["state"], ended["weights_dirty"]) == ("shadow_ended", False)
    return begun.json()


@pytest.mark.parametrize("flip", ["swap", "copy"])
def test_pause_free_update_flips_mid_batch_with_spans(serve: Serve, ckpts: tuple[str, str],
                                                      refs: dict[str, Any], flip: str) -> None:
    c, _ = serve()
    assert _gen(c)["output_ids"] == refs["a"][:8]
    begun = _shadow_session(c, ckpts[1], flip)
    assert (begun["target_copy"], begun["flip"]) == (1, flip)
    during = _gen(c)
    assert (during["output_ids"], during["meta_info"]["weight_version"]) == (refs["a"][:8], "v0"), \
        "the session wrote the shadow: generation still reads the old version"
    published, long = _during_long(c, lambda: c.post("/update_weight_version", json=PUBLISH).json())
    assert (published["effect"], published["flip"], published["flip_at"]) == ("published", flip, "step")
    assert published["engine_idle_s"] >= 0
    meta = long["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["weight_version"] == "v1", "the version at the end"
    (first, v0), (k, v1) = meta["weight_version_spans"]
    assert (first, v0, v1) == (0, "v0", "v1")
    assert 0 < k < LONG
    first = min(k, REF)
    assert long["output_ids"][:first] == refs["a"][:first], "the tokens before the flip are the old version's"
    after = _gen(c)
    assert (after["output_ids"], after["meta_info"]["weight_version"]) == (refs["b"][:8], "v1")
    assert "weight_version_spans" not in after["meta_info"]
    sums = c.post("/weights_checker", json={"action": "checksum", "rank": 0}).json()["checksums"]
    assert sums == refs["b_sums"], "the served weights are the update's, bit for bit"
    assert _state(c)["state"] == "serving"


@pytest.mark.parametrize("in_flight", ["recompute", "abort"])
def test_in_flight_requests_recomputed_or_aborted_at_the_flip(serve: Serve, ckpts: tuple[str, str],
                                                              refs: dict[str, Any], in_flight: str) -> None:
    c, _ = serve(in_flight_at_flip=in_flight)
    _shadow_session(c, ckpts[1], "swap")
    published, long = _during_long(c, lambda: c.post("/update_weight_version", json=PUBLISH).json())
    assert published["flip_at"] == "between batches", "the running batch was stopped first"
    meta, ids = long["meta_info"], long["output_ids"]
    if in_flight == "abort":
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < len(ids) < LONG
        assert ids[:REF] == refs["a"][: min(len(ids), REF)]
        assert (meta["weight_version"], "weight_version_spans" in meta) == ("v0", False)
        return
    (_, v0), (k, v1) = meta["weight_version_spans"]
    assert (v0, v1, meta["weight_version"], meta["num_retractions"]) == ("v0", "v1", "v1", 1)
    assert ids[:min(k, REF)] == refs["a"][:min(k, REF)]
    assert ids[k:] == _greedy(refs["b_engine"], PROMPT + ids[:k], LONG - k), \
        "recomputed: prompt and old tokens re-prefilled under the new version"


def test_an_aborted_pause_free_update_serves_the_old_version(serve: Serve, ckpts: tuple[str, str],
                                                             refs: dict[str, Any]) -> None:
    c, _ = serve()
    _shadow_session(c, ckpts[1], "swap")
    aborted = c.post("/abort_weight_update").json()
    assert (aborted["state"], aborted["weights_dirty"], aborted["weight_version"]) == ("serving", False, "v0")
    assert _gen(c)["output_ids"] == refs["a"][:8]
    sums = c.post("/weights_checker", json={"action": "checksum", "rank": 0}).json()["checksums"]
    assert sums == refs["a_sums"], "nothing of the aborted session is served"


def test_no_shadow_refuses_pause_free(serve: Serve) -> None:
    c, _ = serve(shadow="off")
    r = c.post("/begin_weight_update", json={"pause_free": True})
    assert r.status_code == 409
    assert "no shadow copy" in r.json()["message"]
    assert _state(c)["state"] == "serving"


def test_sglang_way_after_a_swap_writes_the_published_home_copy(serve: Serve,
                                                                ckpts: tuple[str, str], refs: dict[str, Any]) -> None:
    """miles caches the addresses of ``/get_remote_instance_transfer_engine_info`` at start-up: a
    session opened the sglang way writes them, and they are served again once it is published."""
    c, engine = serve()
    home = c.get("/get_remote_instance_transfer_engine_info", params={"rank": 0}).json()
    table = home["remote_instance_transfer_engine_info"][1]
    assert home["weight_copies"][0] == table
    _shadow_session(c, ckpts[1], "swap")
    c.post("/update_weight_version", json=PUBLISH)  # swapped: copy 1 is served
    assert c.post("/pause_generation").status_code == 200
    begun = c.post("/begin_weight_update").json()
    assert (begun["target_copy"], begun["flip"], begun["state"]) == (0, "swap", "updating")
    assert c.post("/update_weights_from_disk", json={"model_path": ckpts[0], "weight_version": "v2"}).status_code == 200
    assert c.post("/end_weight_update").json()["state"] == "paused"
    assert c.post("/continue_generation").status_code == 200
    assert _gen(c)["output_ids"] == refs["a"][:8]
    again = c.get("/get_remote_instance_transfer_engine_info", params={"rank": 0}).json()
    assert again["remote_instance_transfer_engine_info"][1] == table, "the published addresses never change"
    assert all(engine.store[n].data_ptr() == v[0] for n, v in table.items()), "the home copy is served"
