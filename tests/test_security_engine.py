"""Contract of the engine's access rules and state machine, over HTTP (one in-process rank of tiny
Qwen3-MoE, one per module):

* with a token, every route but ``/health`` answers 401 without it and 403 with another one;
  ``/docs`` and ``/openapi.json`` exist only when asked for;
* a weight write outside ``begin_weight_update ... end_weight_update`` is refused (sglang
  0.5.23's rule) and changes no byte; ``reset_tensors`` between an ended session and its
  publication is refused and changes no byte; a foreign broadcast group cannot push weights into a
  serving engine; announcements whose dtype or shape is not the parameter's are refused naming
  the tensor (no silent casts);
* dirty weights are never served: ``reset_tensors -> begin -> end`` with nothing written leaves
  the engine paused and dirty (``/generate`` 503, ``/health`` says so); a session that wrote but
  gave no version ends unpublished until ``update_weight_version`` (requests queue meanwhile and
  get the new version); ``abort_weight_update`` leaves it dirty at the old version; a later
  session recovers it; a call naming another session is refused;
* limits: a body over the limit is a 413, a full queue a 429, a request past its deadline a 503
  (and is aborted); sampling parameters the kernels cannot compute are 400s; a fault answer
  carries no traceback;
* ``init_weights_update_group`` to a port nobody listens on fails within the refusal grace (not
  the group deadline), naming the address, while the engine keeps generating; ``backend: nccl``
  on a CPU engine is refused at once.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from tests.engine_helpers import one_torch_thread, start_sessions, tiny, write_tiny_checkpoint  # noqa: F401 -- autouse fixture
from weightsync.engine.control import Driver
from weightsync.engine.engine import Engine
from weightsync.engine.http_api import OPEN_ROUTES, ROUTES, ServerContext, build_app
from weightsync.engine.session import UpdateSessions
from weightsync.engine.tokenizer import ByteTokenizer
from weightsync.engine.tp import EngineGroups
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.checkpoint import HFCheckpoint
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.inputs import build_inputs
from weightsync.proc import free_port
from weightsync.sync.broadcast_receiver import check_update_request
from weightsync.sync.broadcast_sender import announcement
from weightsync.transport.group import new_weight_update_group

MODEL = "Qwen3-30B-A3B"
TOKEN = "s3cret-token-0123456789"
GROUP_TIMEOUT_S = 3.0
EMBED = "model.embed_tokens.weight"
MODELS_TINY = ["Qwen3-4B", "Qwen3-30B-A3B", "GLM-4.5-Air", "Kimi-K2", "GLM-4.7-Flash", "GLM-5"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("security")
    write_tiny_checkpoint(MODEL, path)
    return str(path)


@pytest.fixture(scope="module")
def served(ckpt: str) -> Iterator[tuple[UpdateSessions, Engine, ByteTokenizer]]:
    spec = tiny(MODEL)
    engine = Engine.build(spec, EngineGroups.single(), device=torch.device("cpu"), group_timeout_s=GROUP_TIMEOUT_S)
    engine.load_checkpoint(ckpt)
    tokenizer = ByteTokenizer(spec.vocab_size)
    engine.decode = tokenizer.decode
    driver = Driver(engine)
    sessions = start_sessions(driver, weight_version="v0", group_timeout_s=GROUP_TIMEOUT_S)
    yield sessions, engine, tokenizer
    sessions.scheduler.stop()
    engine.close()


def _app(served: tuple[UpdateSessions, Engine, ByteTokenizer], **ctx: Any) -> TestClient:
    sessions, _, tokenizer = served
    return TestClient(build_app(ServerContext(sessions=sessions, tokenizer=tokenizer, par=RolloutParallel(),
                                              server_info={"model_path": "x"}, **ctx)))


@pytest.fixture(scope="module")
def client(served: tuple[UpdateSessions, Engine, ByteTokenizer]) -> Iterator[TestClient]:
    with _app(served) as c:
        yield c


@pytest.fixture(autouse=True)
def clean(client: TestClient, ckpt: str) -> Iterator[None]:
    """Every test ends with the engine serving the checkpoint's weights at version v0."""
    yield
    if _state(client)["state"] in ("updating", "ended"):
        client.post("/abort_weight_update", json={})
    client.post("/pause_generation", json={"mode": "abort"})
    _ok(client.post("/begin_weight_update", json={}))
    _ok(client.post("/update_weights_from_disk", json={"model_path": ckpt, "weight_version": "v0"}))
    _ok(client.post("/end_weight_update", json={}))
    _ok(client.post("/continue_generation", json={}))


def _ok(r: Any) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def _state(c: TestClient) -> dict[str, Any]:
    return c.get("/server_info").json()["internal_states"][0]


def _gen(c: TestClient, **sampling: Any) -> Any:
    return c.post("/generate", json={"input_ids": [1, 2, 3],
                                     "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, **sampling}})


def _checksums(c: TestClient) -> dict[str, str]:
    return _ok(c.post("/weights_checker", json={"action": "checksum"}))["ranks"][0]["checksums"]


def _message(r: Any) -> str:
    body = r.json()
    return body["error"]["message"] if "error" in body else body["message"]


def _direct_entry(name: str, t: torch.Tensor) -> str:
    """One ``/update_weights_from_tensor`` entry, ``load_format="direct"`` (sglang's serializer)."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump([(name, t)])
    return base64.b64encode(buf.getvalue()).decode()


# -- access --------------------------------------------------------------------------------------


def test_token_guards_every_route_but_health(served: tuple[UpdateSessions, Engine, ByteTokenizer]) -> None:
    with _app(served, token=TOKEN) as c:
        assert c.get("/health").status_code == 200, "liveness needs no token"
        for path in set(ROUTES) - set(OPEN_ROUTES):
            r = c.post(path, json={})
            assert r.status_code == 401, (path, r.status_code, r.text)
            assert "token" in r.json()["message"]
            wrong = c.post(path, json={}, headers={"Authorization": "Bearer not-the-token"})
            assert wrong.status_code == 403, (path, wrong.status_code)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert c.get("/get_remote_instance_transfer_engine_info", params={"rank": 0}, headers=auth).status_code == 200
        assert c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                      headers=auth).status_code == 200
    for path in ("/docs", "/openapi.json", "/redoc"):
        with _app(served) as c:
            assert c.get(path).status_code == 404, path
    with _app(served, api_docs=True) as c:
        assert c.get("/openapi.json").status_code == 200


# -- writes need a session -----------------------------------------------------------------------


def test_writes_outside_a_session_are_refused_and_change_nothing(client: TestClient, ckpt: str,
                                                                  served: tuple[UpdateSessions, Engine, Any]) -> None:
    """sglang 0.5.23: update calls outside begin ... end fail (all but a reload from disk, which
    needs no session there either). Serving and paused alike."""
    before = _checksums(client)
    zeros = torch.zeros_like(served[1].store[EMBED])
    writes = [
        ("/update_weights_from_tensor", {"serialized_named_tensors": [_direct_entry(EMBED, zeros)],
                                         "load_format": "direct"}),
        ("/update_weights_from_distributed", {"names": [EMBED], "dtypes": ["bfloat16"],
                                              "shapes": [list(zeros.shape)], "group_name": "nobody"}),
    ]
    for paused in (False, True):
        if paused:
            _ok(client.post("/pause_generation", json={}))
        for path, body in writes:
            r = client.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert "must run between begin_weight_update() and end_weight_update()" in _message(r)
    assert _checksums(client) == before
    _ok(client.post("/continue_generation", json={}))
    assert _gen(client).status_code == 200


def test_a_foreign_broadcast_group_cannot_write_a_serving_engine(client: TestClient, ckpt: str) -> None:
    """A process hosting its own group gets the engine to join it (the call needs the token when
    one is set), but its broadcast into the serving engine is refused and no byte changes."""
    before_sums, before_out = _checksums(client), _gen(client).json()["output_ids"]
    port = free_port()
    with HFCheckpoint(ckpt) as c:
        shape = list(c.get(EMBED).shape)

    def foreign() -> Any:
        return new_weight_update_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                                       group_name="evil", backend="gloo")

    pool = ThreadPoolExecutor(1)
    joined = pool.submit(foreign)
    _ok(client.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port,
                                                         "rank_offset": 1, "world_size": 2, "group_name": "evil",
                                                         "backend": "gloo"}))
    group = joined.result(timeout=30)  # kept until the end: it would broadcast zeros to the engine
    r = client.post("/update_weights_from_distributed", json={"names": [EMBED], "dtypes": ["bfloat16"],
                                                              "shapes": [shape], "group_name": "evil",
                                                              "weight_version": "evil"})
    assert r.status_code == 400, r.text
    assert _checksums(client) == before_sums
    out = _gen(client).json()
    assert out["output_ids"] == before_out
    assert out["meta_info"]["weight_version"] == "v0"
    _ok(client.post("/destroy_weights_update_group", json={"group_name": "evil"}))
    del group
    pool.shutdown()


def test_announcements_of_another_dtype_or_shape_are_refused_naming_the_tensor(client: TestClient) -> None:
    spec = tiny(MODEL)
    shape = [spec.vocab_size, spec.hidden_size]
    for dtype in ("float32", "int64", "complex64"):
        with pytest.raises(ValueError, match=rf"{EMBED}: dtype {dtype} \(expected bfloat16; updates are not cast\)"):
            check_update_request(spec, [EMBED], [dtype], [shape])
    with pytest.raises(ValueError, match=rf"{EMBED}: shape \[3, 3\]"):
        check_update_request(spec, [EMBED], ["bfloat16"], [[3, 3]])
    check_update_request(spec, [EMBED], ["bfloat16"], [shape])
    _ok(client.post("/pause_generation", json={}))
    _ok(client.post("/begin_weight_update", json={}))
    r = client.post("/update_weights_from_distributed", json={"names": [EMBED], "dtypes": ["float32"],
                                                              "shapes": [shape], "group_name": "g"})
    assert r.status_code == 400
    assert EMBED in _message(r)
    assert not _state(client)["weights_dirty"], "a refused announcement writes nothing"


@pytest.mark.parametrize("model", MODELS_TINY)
def test_every_family_broadcast_announcement_is_accepted(model: str) -> None:
    """What the trainer's broadcast announces (its wire dtypes: the engine's storage dtypes, e.g.
    float32 for GLM-5's indexer ``k_norm`` and the router's ``e_score_correction_bias``, fp8 with
    its scales for Kimi-K2) passes the dtype check of every family."""
    spec = tiny(model)
    inputs = build_inputs(spec, TrainParallel(tp=1, world_size=1), RolloutParallel(tp=1),
                          trainer_layout=trainer_layout, engine_layout=engine_layout)
    names = [n for n, g in inputs.globals.items() if g.quant_of is None]
    check_update_request(spec, *announcement(inputs, names))


def test_checking_announcements_builds_the_model_table_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bucket of every update is checked on every engine rank: the model's table of global
    tensors is built once for all of them (built once per announced tensor, it cost Qwen3-4B's
    colocated update 0.49 s of checks for 398 tensors in 8 buckets)."""
    from weightsync.sync import broadcast_receiver

    spec = get_model("Qwen3-4B", "full")
    table = broadcast_receiver.global_tensors(spec)
    names = list(table)
    built: list[object] = []
    real = broadcast_receiver.global_tensors

    def counted(s: object) -> dict:
        built.append(s)
        return real(s)

    monkeypatch.setattr(broadcast_receiver, "global_tensors", counted)
    broadcast_receiver._global_table.cache_clear()
    broadcast_receiver.accepted_dtypes.cache_clear()
    for k in range(0, len(names), 50):
        bucket = names[k : k + 50]
        check_update_request(spec, bucket, [table[n].dtype for n in bucket], [list(table[n].shape) for n in bucket])
    assert len(built) == 1


# -- dirty weights are never served --------------------------------------------------------------


def test_reset_begin_end_without_writes_is_never_served(client: TestClient) -> None:
    _ok(client.post("/weights_checker", json={"action": "reset_tensors"}))
    _ok(client.post("/begin_weight_update", json={}))
    end = _ok(client.post("/end_weight_update", json={}))
    assert (end["state"], end["weights_dirty"]) == ("paused", True)
    r = _gen(client)
    assert r.status_code == 503
    assert "dirty" in _message(r)
    assert client.post("/continue_generation", json={}).status_code == 409
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "state": "paused", "weights_dirty": True, "weight_version": "v0"}
    assert client.get("/health_generate").status_code == 503
    assert client.post("/update_weight_version", json={"new_version": "v9"}).status_code == 409, \
        "a label cannot clean dirty weights"


def test_an_update_is_published_only_by_its_session(client: TestClient, ckpt: str) -> None:
    """begin, write without a version, end: paused, dirty, "ended"; a queued request waits and
    runs after the publication with the new version; a call naming another session is refused."""
    _ok(client.post("/pause_generation", json={}))
    session = _ok(client.post("/begin_weight_update", json={}))["session_id"]
    _ok(client.post("/update_weights_from_disk", json={"model_path": ckpt}))
    assert _state(client)["weights_dirty"]
    end = _ok(client.post("/end_weight_update", json={}))
    assert (end["state"], end["weights_dirty"]) == ("ended", True)
    pool = ThreadPoolExecutor(1)
    queued = pool.submit(_gen, client)
    time.sleep(0.3)
    assert not queued.done(), "during an update requests queue (they are served after the publication)"
    assert client.post("/continue_generation", json={}).status_code == 409
    other = client.post("/update_weight_version", json={"new_version": "v1"},
                        headers={"X-Weightsync-Session": "someone-else"})
    assert other.status_code == 409
    published = _ok(client.post("/update_weight_version", json={"new_version": "v1", "abort_all_requests": False},
                                headers={"X-Weightsync-Session": session}))
    assert published["effect"] == "published"
    assert _state(client) | {"num_queued": 0} == {**_state(client), "state": "paused", "weights_dirty": False,
                                                  "weight_version": "v1", "session_id": None, "num_queued": 0}
    _ok(client.post("/continue_generation", json={}))
    assert queued.result(timeout=60).json()["meta_info"]["weight_version"] == "v1"
    pool.shutdown()


def test_abort_leaves_dirty_at_the_old_version_and_a_later_session_recovers(client: TestClient, ckpt: str,
                                                                             served: Any) -> None:
    before = _checksums(client)
    _ok(client.post("/pause_generation", json={}))
    _ok(client.post("/begin_weight_update", json={}))
    half = torch.zeros_like(served[1].store[EMBED])
    _ok(client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [_direct_entry(EMBED, half)],
                                                         "load_format": "direct", "weight_version": "half"}))
    aborted = _ok(client.post("/abort_weight_update", json={}))
    assert (aborted["weights_dirty"], aborted["weight_version"]) == (True, "v0")
    assert _gen(client).status_code == 503
    assert client.post("/continue_generation", json={}).status_code == 409
    assert client.post("/end_weight_update", json={}).status_code == 409
    # recovery: a complete update in a new session
    _ok(client.post("/begin_weight_update", json={}))
    _ok(client.post("/update_weights_from_disk", json={"model_path": ckpt, "weight_version": "v2"}))
    end = _ok(client.post("/end_weight_update", json={}))
    assert (end["state"], end["weights_dirty"]) == ("paused", False)
    assert _checksums(client) == before
    _ok(client.post("/continue_generation", json={}))
    assert _gen(client).json()["meta_info"]["weight_version"] == "v2"


def test_a_refusal_for_another_session_does_not_say_the_current_one(client: TestClient) -> None:
    """A call naming another session is refused (409) without echoing the current session's id (which
    would let the caller act in that session's name)."""
    _ok(client.post("/pause_generation", json={}))
    current = _ok(client.post("/begin_weight_update", json={}))["session_id"]
    r = client.post("/end_weight_update", json={}, headers={"X-Weightsync-Session": "0123456789abcdef"})
    assert r.status_code == 409, r.text
    assert "not this engine's current session" in _message(r)
    assert current not in r.text
    _ok(client.post("/abort_weight_update", json={}))


def test_reset_is_refused_between_an_update_and_its_publication(client: TestClient, ckpt: str) -> None:
    """A reset after ``end_weight_update`` would have the holder publish random weights as the
    version it verified: 409, nothing reset, and the publication serves what the session wrote."""
    before, out = _checksums(client), _gen(client).json()["output_ids"]
    _ok(client.post("/pause_generation", json={}))
    _ok(client.post("/begin_weight_update", json={}))
    _ok(client.post("/update_weights_from_disk", json={"model_path": ckpt}))
    assert _ok(client.post("/end_weight_update", json={}))["state"] == "ended"
    r = client.post("/weights_checker", json={"action": "reset_tensors"})
    assert r.status_code == 409, r.text
    assert "publication" in _message(r)
    assert _state(client)["state"] == "ended"
    assert _checksums(client) == before
    _ok(client.post("/update_weight_version", json={"new_version": "v1"}))
    _ok(client.post("/continue_generation", json={}))
    assert _gen(client).json()["output_ids"] == out


# -- limits, input, errors -----------------------------------------------------------------------


def test_size_queue_and_deadline_limits(served: tuple[UpdateSessions, Engine, ByteTokenizer],
                                        client: TestClient) -> None:
    sched = served[0].scheduler
    with _app(served, max_request_bytes=1000, request_timeout_s=1.0) as c:
        big = c.post("/generate", json={"input_ids": list(range(1, 400)), "sampling_params": {"max_new_tokens": 1}})
        assert big.status_code == 413
        assert "1000" in _message(big)
        _ok(c.post("/pause_generation", json={}))
        t0 = time.monotonic()
        late = _gen(c)
        assert late.status_code == 503
        assert 1.0 <= time.monotonic() - t0 < 10
        assert "not answered within 1 s" in _message(late)
        assert _state(c)["num_queued"] == 0, "the request was aborted"
        limit, sched.max_queued_requests = sched.max_queued_requests, 2
        try:
            pool = ThreadPoolExecutor(2)
            waiting = [pool.submit(_gen, c) for _ in range(2)]
            deadline = time.monotonic() + 10
            while _state(c)["num_queued"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            full = _gen(c)
            assert full.status_code == 429
            many = c.post("/generate", json={"input_ids": [[1]] * 3, "sampling_params": {"max_new_tokens": 1}})
            assert many.status_code == 413
            _ok(c.post("/continue_generation", json={}))
            assert [w.result(timeout=60).status_code for w in waiting] in ([200, 200], [503, 503], [200, 503],
                                                                            [503, 200])
            pool.shutdown()
        finally:
            sched.max_queued_requests = limit


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        pytest.param('{"temperature": NaN}', "temperature", id="nan-temperature"),
        pytest.param('{"temperature": Infinity}', "temperature", id="inf-temperature"),
        pytest.param('{"temperature": 1e400}', "temperature", id="overflowing-temperature"),
        pytest.param('{"top_p": 1e-300}', "top_p", id="top-p-below-float32"),
        pytest.param('{"repetition_penalty": 1e-30}', "repetition_penalty", id="tiny-repetition-penalty"),
        pytest.param('{"min_p": NaN}', "min_p", id="nan-min-p"),
        pytest.param('{"logit_bias": {"5": Infinity}}', "logit_bias", id="inf-logit-bias"),
        pytest.param('{"stop_regex": "("}', "stop_regex", id="bad-stop-regex"),
    ],
)
def test_sampling_parameters_the_kernels_cannot_compute_are_400(client: TestClient, raw: str, named: str) -> None:
    body = '{"input_ids": [1, 2, 3], "sampling_params": ' + raw[:-1] + ', "max_new_tokens": 2}}'
    r = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert named in _message(r)
    assert _gen(client).status_code == 200, "the engine keeps serving"


def test_extreme_but_computable_sampling_values_are_served(client: TestClient) -> None:
    """A denormal temperature is greedy (sglang's rule below 1e-6), a float32-tiny top_p keeps the
    top token, a huge logit bias is clamped."""
    greedy = _gen(client).json()["output_ids"]
    assert _gen(client, temperature=1e-320).json()["output_ids"] == greedy
    assert _gen(client, temperature=1.0, top_p=2e-38).json()["output_ids"] == greedy
    biased = _ok(_gen(client, temperature=1.0, logit_bias={"7": 1e300}))
    assert biased["output_ids"] == [7, 7, 7]


def test_a_checkpoint_path_the_filesystem_refuses_is_a_400(client: TestClient) -> None:
    """Found by scripts/fuzz_engine.py: a ``model_path`` too long for the filesystem was a 500
    (``OSError``); it is the caller's input, refused naming the path, and nothing changes."""
    before = _checksums(client)
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    r = client.post("/update_weights_from_disk", json={"model_path": "x" * 5000})
    assert r.status_code == 400, r.text
    assert "cannot read the checkpoint 'xxx" in _message(r)
    assert (_state(client)["weights_dirty"], _checksums(client)) == (False, before)


def test_a_fault_answer_carries_no_traceback(client: TestClient, served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any, **__: Any) -> Any:
        raise RuntimeError("checksum kernel exploded")

    monkeypatch.setattr(served[1].checker, "checksum", boom)
    r = client.post("/weights_checker", json={"action": "checksum"})
    assert r.status_code == 500
    assert "[rank0] RuntimeError: checksum kernel exploded" in r.json()["message"]
    assert "Traceback" not in r.text
    assert 'File "' not in r.text


def test_joining_a_closed_port_is_bounded_and_generation_goes_on(client: TestClient) -> None:
    port = free_port()  # nobody listens there
    pool = ThreadPoolExecutor(1)
    t0 = time.monotonic()
    join = pool.submit(client.post, "/init_weights_update_group",
                       json={"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                             "group_name": "nobody", "backend": "gloo"})
    time.sleep(0.5)
    assert not join.done()
    served_meanwhile = _gen(client)
    assert served_meanwhile.status_code == 200, "the engine generates while a join waits"
    r = join.result(timeout=GROUP_TIMEOUT_S + 30)
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    assert f"127.0.0.1:{port}" in _message(r)
    assert took < GROUP_TIMEOUT_S + 15
    assert _state(client)["fault"] is None
    pool.shutdown()


def test_a_refused_group_join_fails_fast_and_nccl_needs_cuda(client: TestClient,
                                                             served: tuple[UpdateSessions, Engine, Any]) -> None:
    """A master address that refuses connections fails the join after the refusal grace, not at the
    group deadline (600 s here: it took all of it); ``backend: nccl`` on a CPU engine is a 400 at once
    (it waited 600 s)."""
    from weightsync.sync.broadcast_receiver import REFUSED_GRACE_S, BroadcastReceiver

    _, engine, _ = served
    receiver = BroadcastReceiver(engine.store, engine.spec, 0, timeout_s=600.0)
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    receiver.start_init(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
                        group_name="refused", backend="gloo")
    while (status := receiver.init_status("refused")) == "pending":
        time.sleep(0.1)
    took = time.monotonic() - t0
    assert f"nobody listens on 127.0.0.1:{port}" in status, status
    assert REFUSED_GRACE_S <= took < REFUSED_GRACE_S + 10, took
    t0 = time.monotonic()
    r = client.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port,
                                                        "rank_offset": 1, "world_size": 2, "group_name": "n",
                                                        "backend": "nccl"})
    assert r.status_code == 400, r.text
    assert "backend nccl needs CUDA" in _message(r)
    assert time.monotonic() - t0 < 10
    assert _gen(client).status_code == 200
