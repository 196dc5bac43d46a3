"""Contract of the HTTP API (in-process app over a one-rank engine): sglang's routes and shapes,
bad input -> 400 with a message while the server keeps serving, the state machine (queued while
paused/updating, 409 for an update while generating, a write outside a session is a 400, dirty
weights never served), the checker cycle over HTTP, and refusal of mismatched checkpoints with
their tensor names.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from tests.engine_helpers import one_torch_thread, start_sessions, tiny, write_tiny_checkpoint  # noqa: F401 -- autouse fixture
from weightsync.engine.control import Driver
from weightsync.engine.engine import Engine
from weightsync.engine.http_api import ROUTES, ServerContext, build_app
from weightsync.engine.tokenizer import ByteTokenizer
from weightsync.engine.tp import EngineGroups
from weightsync.models.checkpoint import HFCheckpoint, hf_config_dict, write_hf_checkpoint
from weightsync.models.parallel import RolloutParallel
from weightsync.transport.group import new_weight_update_group

MODEL = "Qwen3-30B-A3B"
LONG = {"max_new_tokens": 600, "temperature": 0.0}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("http")
    write_tiny_checkpoint(MODEL, path)
    return str(path)


@pytest.fixture
def served(ckpt: str) -> Iterator[tuple[TestClient, Engine]]:
    """The HTTP client of a one-rank engine loaded from the checkpoint, and the engine."""
    spec = tiny(MODEL)
    engine = Engine.build(spec, EngineGroups.single(), device=torch.device("cpu"))
    engine.load_checkpoint(ckpt)
    driver = Driver(engine)
    sessions = start_sessions(driver, weight_version="v0")
    tokenizer = ByteTokenizer(spec.vocab_size)
    engine.decode = tokenizer.decode
    app = build_app(
        ServerContext(
            sessions=sessions,
            tokenizer=tokenizer,
            par=RolloutParallel(),
            server_info={"model": MODEL, "model_path": ckpt},
        )
    )
    with TestClient(app) as c:
        yield c, engine
    sessions.scheduler.stop()
    engine.close()


@pytest.fixture
def client(served: tuple[TestClient, Engine]) -> TestClient:
    return served[0]


def _gen(c: TestClient, **body: Any) -> Any:
    return c.post(
        "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}, **body}
    )


def _state(c: TestClient) -> dict[str, Any]:
    return c.get("/server_info").json()["internal_states"][0]


def _message(r: Any) -> str:
    """The error message of any of sglang's error bodies."""
    body = r.json()
    return body["error"]["message"] if "error" in body else body["message"]


def _wait_running(c: TestClient, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while not _state(c)["batch_running"]:
        assert time.monotonic() - t0 < timeout, "the long request never started"
        time.sleep(0.01)


def _background(c: TestClient, body: dict[str, Any]) -> tuple[ThreadPoolExecutor, Future]:
    pool = ThreadPoolExecutor(1)
    return pool, pool.submit(c.post, "/generate", json=body)


def test_routes_are_sglang_names(client: TestClient) -> None:
    """Public surface freeze: exactly these routes (sglang's names), nothing added silently."""
    served = {r.path for r in client.app.routes if not r.path.startswith(("/docs", "/redoc", "/openapi"))}
    assert served == set(ROUTES)


def test_openapi_has_one_operation_id_per_operation() -> None:
    """``serve --api-docs``: every (path, method) of the published OpenAPI has an operation id of
    its own (clients generate one function per id), and FastAPI warns of no duplicate. The app is
    only described here, so it is built without a running engine."""
    import warnings
    from collections import Counter
    from types import SimpleNamespace

    # build_app keeps the sessions for the routes and reads the scheduler's limits (the body budget)
    sched = SimpleNamespace(max_queued_requests=4, spec=SimpleNamespace(max_position_embeddings=64))
    sessions: Any = SimpleNamespace(scheduler=sched)
    app = build_app(ServerContext(sessions=sessions, tokenizer=sessions, par=RolloutParallel(), server_info={},
                                  api_docs=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI's "Duplicate Operation ID" is a UserWarning
        spec = app.openapi()
    ops = [(path, method, op["operationId"]) for path, item in spec["paths"].items() for method, op in item.items()]
    twice = {i: n for i, n in Counter(i for _, _, i in ops).items() if n > 1}
    assert not twice, twice
    published = {(path, method.upper()) for path, method, _ in ops}
    assert {("/generate", "POST"), ("/generate", "PUT"), ("/flush_cache", "GET"), ("/flush_cache", "POST"),
            ("/weights_checker", "GET"), ("/weights_checker", "POST")} <= published
    assert {path for path, _ in published} == set(ROUTES)


def test_generate_shapes_and_version(client: TestClient) -> None:
    r = _gen(client, return_logprob=True, logprob_start_len=0)
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == 3
    assert isinstance(body["text"], str)
    assert meta["weight_version"] == "v0"
    assert meta["prompt_tokens"] == 3
    assert meta["completion_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["input_token_logprobs"][0] == [None, 1, None]
    assert len(meta["input_token_logprobs"]) == 3
    assert [row[1] for row in meta["output_token_logprobs"]] == body["output_ids"]
    batch = client.post(
        "/generate", json={"text": ["ab", "cde"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}
    )
    assert batch.status_code == 200
    assert [len(x["output_ids"]) for x in batch.json()] == [1, 2]
    assert client.post("/update_weight_version", json={"new_version": "v7"}).json()["new_version"] == "v7"
    assert _gen(client).json()["meta_info"]["weight_version"] == "v7"
    assert client.get("/get_weight_version").json() == {"weight_version": "v7"}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        pytest.param(
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens", id="wrong-type"
        ),
        pytest.param(
            {"input_ids": [1, 2], "sampling_params": {"temperature": -1.0}}, "temperature", id="negative-temp"
        ),
        pytest.param({"input_ids": [1, 2], "sampling_params": {"top_p": 0.0}}, "top_p", id="top-p-zero"),
        pytest.param({"input_ids": [1, 999]}, "outside the vocab", id="token-out-of-vocab"),
        pytest.param(
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, "context length", id="too-long"
        ),
        pytest.param({"input_ids": [1, 2], "text": "x"}, "exactly one", id="text-and-ids"),
        pytest.param({}, "exactly one", id="no-prompt"),
        pytest.param({"input_ids": []}, "empty", id="empty-prompt"),
        pytest.param({"input_ids": [1, 2], "bogus": 1}, "bogus", id="unknown-field"),
        pytest.param({"input_ids": [[1], [2]], "rid": ["a"]}, "rid", id="batch-mismatch"),
        pytest.param(
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
            "logprob_start_len",
            id="logprob-start-too-far",
        ),
    ],
)
def test_bad_generate_input_is_400_and_server_keeps_serving(
    client: TestClient, body: dict[str, Any], needle: str
) -> None:
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert needle in _message(r)
    assert _gen(client).status_code == 200


def test_other_bad_requests(client: TestClient) -> None:
    r = client.post("/generate", content=b'{"input_ids": [1,', headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert "json" in _message(r).lower()
    assert client.get("/parallelism_config", params={"rank": 3}).status_code == 400
    assert client.get("/get_remote_instance_transfer_engine_info", params={"rank": -1}).status_code == 400
    assert client.post("/weights_checker", json={"action": "bogus"}).status_code == 400
    assert client.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
    assert (
        client.post(
            "/update_weights_from_distributed", json={"names": ["nope"], "dtypes": ["bfloat16"], "shapes": [[1]]}
        ).status_code
        == 400
    )
    assert client.post("/destroy_weights_update_group", json={"group_name": "none"}).status_code == 400
    assert _gen(client).status_code == 200


def test_parallelism_and_transfer_info(client: TestClient) -> None:
    par = client.get("/parallelism_config", params={"rank": 0}).json()
    assert par["tp_size"] == 1
    assert par["attn_tp_size"] == 1
    assert par["ep_size"] == 1
    assert par["global_rank"] == 0
    info = client.get("/get_remote_instance_transfer_engine_info", params={"rank": 0}).json()
    session, weights = info["remote_instance_transfer_engine_info"]
    assert session.startswith("none://")
    assert info["transport_descriptor"] is None
    ptr, numel, esize = weights["model.layers.0.mlp.experts.w13_weight"]
    spec = tiny(MODEL)
    assert numel == spec.num_experts * 2 * spec.moe_intermediate_size * spec.hidden_size
    assert esize == 2
    assert ptr > 0


def test_update_while_generating_is_409_and_pause_abort_stops_it(client: TestClient, ckpt: str) -> None:
    pool, running = _background(client, {"input_ids": [1, 2, 3], "sampling_params": LONG})
    _wait_running(client)
    for path, body in [
        ("/begin_weight_update", None),
        ("/weights_checker", {"action": "reset_tensors"}),
        ("/update_weights_from_disk", {"model_path": ckpt}),  # needs no session, but no weights change under a batch
    ]:
        r = client.post(path, json=body)
        assert r.status_code == 409, (path, r.text)
        assert "pause_generation" in _message(r)
    busy = client.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert busy.status_code == 400, busy.text
    assert busy.json() == {"error": {"message": "release_memory_occupation should be called only when server is "
                                                "idle."}}, "sglang's assertion, in its error body"
    assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    out = running.result(timeout=60).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 600
    assert client.post("/begin_weight_update").status_code == 200
    assert client.post("/end_weight_update").status_code == 200
    assert client.post("/continue_generation").status_code == 200
    pool.shutdown()


def test_pause_retract_requeues_and_paused_requests_queue(client: TestClient) -> None:
    pool, running = _background(client, {"input_ids": [4, 5], "sampling_params": {**LONG, "max_new_tokens": 300}})
    _wait_running(client)
    assert client.post("/pause_generation", json={"mode": "retract"}).json()["status"] == "ok"
    time.sleep(0.2)
    assert not running.done()
    info = _state(client)
    assert info["state"] == "paused"
    assert info["num_queued"] == 1
    assert not info["batch_running"]
    assert client.post("/continue_generation").status_code == 200
    out = running.result(timeout=120).json()
    assert len(out["output_ids"]) == 300
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    pool.shutdown()


def test_update_states_and_dirty_weights_are_never_served(client: TestClient, ckpt: str) -> None:
    assert client.post("/end_weight_update").status_code == 409
    assert client.post("/begin_weight_update").status_code == 409, "a session opens on a paused engine only"
    assert client.post("/pause_generation").status_code == 200
    assert client.post("/begin_weight_update").status_code == 200
    assert client.post("/begin_weight_update").status_code == 409
    pool, queued = _background(client, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    time.sleep(0.3)
    assert not queued.done(), "generation must wait while updating"
    assert client.post("/continue_generation").status_code == 409
    r = client.post("/end_weight_update").json()
    assert r["success"]
    assert r["post_load_seconds"] >= 0
    assert (r["state"], r["weights_dirty"]) == ("paused", False), "nothing was written: paused, clean"
    assert client.post("/continue_generation").status_code == 200
    assert queued.result(timeout=60).status_code == 200
    # reset_tensors makes the weights dirty: generation and continue are refused until an update
    # session writes and publishes.
    assert client.post("/pause_generation").status_code == 200
    assert client.post("/weights_checker", json={"action": "snapshot"}).json()["success"]
    assert client.post("/weights_checker", json={"action": "reset_tensors"}).status_code == 200
    assert client.post("/continue_generation").status_code == 409
    assert _gen(client).status_code == 503
    compare = client.post("/weights_checker", json={"action": "compare"})
    assert compare.status_code == 400
    assert not compare.json()["success"]
    assert client.post("/begin_weight_update").status_code == 200
    upd = client.post("/update_weights_from_disk", json={"model_path": ckpt, "weight_version": "v2"})
    assert upd.status_code == 200, upd.text
    assert upd.json()["success"]
    assert client.post("/end_weight_update").json()["weights_dirty"] is False, "the session's version is published"
    ok = client.post("/weights_checker", json={"action": "compare"}).json()
    assert ok["success"]
    assert ok["message"] == "All weights equal."
    assert ok["ranks"][0]["mismatches"] == []
    assert client.post("/continue_generation").status_code == 200
    assert _gen(client).json()["meta_info"]["weight_version"] == "v2"
    pool.shutdown()


def test_mismatched_checkpoint_is_refused_with_names(client: TestClient, tmp_path: Path) -> None:
    spec = tiny(MODEL)
    tensors = write_tiny_checkpoint(MODEL, tmp_path / "good")
    del tensors["model.layers.1.mlp.gate.weight"]
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    tensors["model.bogus.weight"] = torch.zeros(2)
    write_hf_checkpoint(tmp_path / "bad", tensors, hf_config_dict(spec))
    assert client.post("/pause_generation").status_code == 200
    assert client.post("/begin_weight_update").status_code == 200
    before = _state(client)
    r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "bad")})
    assert r.status_code == 400
    msg = _message(r)
    for needle in (
        "model.bogus.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "unknown",
        "missing",
        "mis-shaped",
    ):
        assert needle in msg
    after = _state(client)
    assert after["state"] == before["state"] == "updating"
    assert not after["weights_dirty"], "a refused checkpoint writes nothing"
    assert client.post("/end_weight_update").json()["weights_dirty"] is False
    assert client.post("/continue_generation").status_code == 200
    assert _gen(client).status_code == 200


def test_broadcast_update_over_http(client: TestClient, ckpt: str, free_port: int) -> None:
    """init_weights_update_group (the trainer thread is group rank 0), reset, broadcast every
    checkpoint tensor, compare: equal; the update set the weight version; destroy the group."""
    with HFCheckpoint(ckpt) as c:
        tensors = {n: c.get(n) for n in c.names()}

    def trainer() -> None:
        pg = new_weight_update_group(
            master_address="127.0.0.1", master_port=free_port, rank=0, world_size=2, group_name="g", backend="gloo"
        )
        for t in tensors.values():
            pg.broadcast(t.contiguous(), 0).wait()

    pool = ThreadPoolExecutor(1)
    sender = pool.submit(trainer)
    init = client.post(
        "/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": free_port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
            "backend": "gloo",
        },
    )
    assert init.status_code == 200, init.text
    assert init.json()["success"]
    assert client.post("/pause_generation").status_code == 200
    assert client.post("/weights_checker", json={"action": "snapshot"}).status_code == 200
    assert client.post("/weights_checker", json={"action": "reset_tensors"}).status_code == 200
    body = {
        "names": list(tensors),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": "g",
        "weight_version": "step-1",
    }
    assert client.post("/begin_weight_update").status_code == 200
    upd = client.post("/update_weights_from_distributed", json=body)
    assert upd.status_code == 200, upd.text
    assert upd.json()["success"]
    sender.result(timeout=60)
    assert client.post("/end_weight_update").json()["weights_dirty"] is False
    assert client.post("/weights_checker", json={"action": "compare"}).json()["success"]
    assert client.post("/continue_generation").status_code == 200
    assert _gen(client).json()["meta_info"]["weight_version"] == "step-1"
    assert client.post("/destroy_weights_update_group", json={"group_name": "g"}).json()["success"]
    pool.shutdown()


def test_weights_checker_rank_view(client: TestClient) -> None:
    """``rank`` narrows the answer to one rank and lifts its fields to the top level; compare
    always carries ``equal`` and the rank-tagged ``mismatches``."""
    one = client.post("/weights_checker", json={"action": "checksum", "rank": 0}).json()
    assert [r["rank"] for r in one["ranks"]] == [0]
    assert "model.layers.0.mlp.experts.w13_weight" in one["checksums"]
    assert client.post("/weights_checker", json={"action": "snapshot"}).status_code == 200
    same = client.post("/weights_checker", json={"action": "compare", "rank": 0}).json()
    assert same["equal"]
    assert same["mismatches"] == []
    assert client.post("/weights_checker", json={"action": "checksum", "rank": 1}).status_code == 400


def test_fingerprint_of_every_parameter_and_padding_zeroed_at_the_end_of_a_session(
        served: tuple[TestClient, Engine]) -> None:
    """``fingerprint`` (an extension) answers every non-derived parameter's fingerprint with the
    given seed; a writer of whole padded tensors (``direct``) leaves the vocab padding zero once
    the session ends, so the next verification still expects zeros there."""
    from tests.test_security_engine import _direct_entry
    from weightsync.fingerprint import fingerprint_tensor, to_hex

    client, engine = served
    got = client.post("/weights_checker", json={"action": "fingerprint", "seed": 7}).json()
    want = {n: to_hex(fingerprint_tensor(t, seed=7)) for n, t in engine.store.items()
            if not engine.store.meta[n].derived}
    assert got["ranks"][0]["fingerprints"] == want
    assert client.post("/weights_checker", json={"action": "fingerprint", "seed": -1}).status_code == 400
    name = "model.embed_tokens.weight"
    assert engine.store.padding[name], "tiny vocab 300 is padded to 320"
    whole = engine.store[name].clone()
    whole[engine.spec.vocab_size :] = 1.0
    assert client.post("/pause_generation").status_code == 200
    assert client.post("/begin_weight_update").status_code == 200
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [_direct_entry(name, whole)],
                                                          "load_format": "direct", "weight_version": "padded"})
    assert r.status_code == 200, r.text
    assert client.post("/end_weight_update").status_code == 200
    assert torch.count_nonzero(engine.store[name][engine.spec.vocab_size :]) == 0
    after = client.post("/weights_checker", json={"action": "fingerprint", "seed": 7, "rank": 0}).json()["fingerprints"]
    assert after == want


def test_control_extensions_pause_in_begin_fingerprint_in_end_continue_in_version(
        served: tuple[TestClient, Engine]) -> None:
    """The control extensions: ``begin_weight_update`` with ``pause_generation`` pauses a serving
    engine and begins (without it the same call is refused: sglang's rule); ``end_weight_update``
    with ``fingerprint_seed`` answers the fingerprints of what the session wrote, before anything
    is published, equal to ``/weights_checker`` ``fingerprint`` with that seed; and
    ``update_weight_version`` with ``continue_generation`` publishes and serves again."""
    from tests.test_security_engine import _direct_entry
    from weightsync.fingerprint import fingerprint_tensor, to_hex

    client, engine = served
    assert client.post("/begin_weight_update", json={}).status_code == 409  # serving: sglang's rule stands
    r = client.post("/begin_weight_update", json={"pause_generation": "abort"})
    assert r.status_code == 200, r.text
    assert (r.json()["state"], _state(client)["state"]) == ("updating", "updating")
    name = "model.layers.0.self_attn.o_proj.weight"
    new = torch.full_like(engine.store[name], 0.25)
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [_direct_entry(name, new)],
                                                          "load_format": "direct"})
    assert r.status_code == 200, r.text
    assert client.post("/end_weight_update", json={"fingerprint_seed": -1}).status_code == 400
    r = client.post("/end_weight_update", json={"fingerprint_seed": 11})
    assert r.status_code == 200, r.text
    ended = r.json()
    assert (ended["state"], ended["fingerprints"]["ranks"][0]["seed"]) == ("ended", 11)
    got = ended["fingerprints"]["ranks"][0]["fingerprints"]
    store = engine.session_store()
    assert got[name] == to_hex(fingerprint_tensor(new, seed=11))
    assert got == {n: to_hex(fingerprint_tensor(t, seed=11)) for n, t in store.items()
                   if not store.meta[n].derived and store.meta[n].constant is None}
    assert got == client.post("/weights_checker", json={"action": "fingerprint", "seed": 11,
                                                         "rank": 0}).json()["fingerprints"]
    assert _state(client)["weight_version"] == "v0"  # nothing published yet
    r = client.post("/update_weight_version", json={"new_version": "v1", "continue_generation": True})
    assert r.status_code == 200, r.text
    assert (r.json()["effect"], r.json()["continued"], r.json()["state"]) == ("published", True, "serving")
    answer = _gen(client)
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["weight_version"] == "v1"
    assert "fingerprints" not in client.post("/begin_weight_update", json={"pause_generation": "abort"}).json()
    assert "fingerprints" not in client.post("/end_weight_update", json={}).json()  # sglang's body: sglang's answer
