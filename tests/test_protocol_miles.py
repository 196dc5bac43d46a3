"""Contract: every request body miles (and sglang's own clients) send is accepted by the built-in
engine, and the answer has every field their callers read.

Each fixture below is the body exactly as the cited function builds it (radixark/miles, commit
31f1ca9; sglang 0.5.18 / 0.5.23 wheels for the shapes). The engine is one in-process rank of
tiny Kimi-K2 (fp8 block weights, MLA with derived ``w_kc``/``w_vc``), one per module.

Also pinned here: a field sglang does not have is a 400 naming it (deliberately stricter than
sglang, which drops it); ``retract`` then ``continue_generation`` keeps the tokens generated
before the pause; the checksum answer is read by a reader that expects sglang's shape.
"""

from __future__ import annotations

import base64
import datetime
import io
import sys
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from tests.engine_helpers import (  # noqa: F401 -- one_torch_thread: autouse fixture
    one_torch_thread,
    start_sessions,
    tiny,
    two_tiny_checkpoints,
)
from tests.sglang_fake import join_group_sglang_way
from weightsync.engine.config import ServeConfig
from weightsync.engine.control import Driver
from weightsync.engine.engine import Engine
from weightsync.engine.http_api import ServerContext, build_app
from weightsync.engine.serve import server_info
from weightsync.engine.tokenizer import ByteTokenizer
from weightsync.engine.tp import EngineGroups
from weightsync.models.checkpoint import HFCheckpoint
from weightsync.models.parallel import RolloutParallel

MODEL = "Kimi-K2"
PROMPT = [5, 17, 250, 3, 42, 7]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two checkpoints of the same model with different weights (seeds 1 and 2)."""
    return two_tiny_checkpoints(tmp_path_factory, MODEL)


@pytest.fixture(scope="module")
def served(ckpts: tuple[str, str]) -> Iterator[tuple[TestClient, Engine]]:
    spec = tiny(MODEL)
    engine = Engine.build(spec, EngineGroups.single(), device=torch.device("cpu"))
    engine.load_checkpoint(ckpts[0])
    tokenizer = ByteTokenizer(spec.vocab_size)
    engine.decode = tokenizer.decode
    driver = Driver(engine)
    sessions = start_sessions(driver, weight_version="0")
    cfg = ServeConfig(model=MODEL, scale="tiny", checkpoint=ckpts[0], weight_version="0")
    info = server_info(cfg, spec, RolloutParallel(), model_path=ckpts[0], tokenizer=tokenizer.name)
    app = build_app(ServerContext(sessions=sessions, tokenizer=tokenizer, par=RolloutParallel(), server_info=info))
    with TestClient(app) as c:
        yield c, engine
    sessions.scheduler.stop()
    engine.close()


@pytest.fixture(scope="module")
def client(served: tuple[TestClient, Engine]) -> TestClient:
    return served[0]


def _load(client: TestClient, path: str, version: str | None = None) -> None:
    """One update session on the paused engine: the checkpoint at ``path`` from disk, published
    at ``version`` (None: the session ends unpublished, the weights dirty)."""
    _ok(client.post("/begin_weight_update", json={}))
    _ok(client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": version}))
    _ok(client.post("/end_weight_update", json={}))


@pytest.fixture(autouse=True)
def serving(client: TestClient, ckpts: tuple[str, str]) -> Iterator[None]:
    """Every test starts and ends with the engine serving the first checkpoint's weights."""
    yield
    if client.get("/server_info").json()["internal_states"][0]["state"] in ("updating", "ended"):
        client.post("/abort_weight_update", json={})
    client.post("/pause_generation", json={"mode": "abort"})
    _load(client, ckpts[0], "0")
    _ok(client.post("/continue_generation", json={}))


def _ok(r: Any) -> Any:
    assert r.status_code == 200, r.text
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text


# -- /generate ------------------------------------------------------------------------------------


def miles_rollout_body(input_ids: list[int], max_new_tokens: int = 8) -> dict[str, Any]:
    """miles/rollout/sglang_rollout.py ``generate`` with the sampling params of
    ``GenerateState.__init__`` at miles' argument defaults (temperature 1, top_p 1, top_k -1,
    no stop strings or ids, skip_special_tokens False)."""
    return {
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": max_new_tokens,
            "stop": None,
            "stop_token_ids": None,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        },
        "return_logprob": True,
        "input_ids": input_ids,
    }


def test_miles_rollout_generate_body(client: TestClient) -> None:
    """What miles reads: text, meta_info.output_token_logprobs[i][0|1], finish_reason.type,
    weight_version, prompt/completion/cached tokens (and output_ids, sglang's)."""
    out = _ok(client.post("/generate", json=miles_rollout_body(PROMPT)))
    meta = out["meta_info"]
    assert isinstance(out["text"], str)
    assert len(out["output_ids"]) == 8
    assert [row[1] for row in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(row[0], float) and row[0] <= 0.0 for row in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["weight_version"] == "0"
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (len(PROMPT), 8, 0)
    assert meta["num_retractions"] == 0


def test_miles_generate_variants(client: TestClient) -> None:
    # miles/rollout/generate_utils/generate_endpoint_utils.py ``compute_request_payload``: the
    # replay flags always present (False unless enabled)
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4},
        "return_logprob": True,
        "return_routed_experts": False,
        "return_indexer_topk": False,
    }
    assert len(_ok(client.post("/generate", json=body))["output_ids"]) == 4
    # miles/rollout/sglang_rollout.py ``generate``: OPD top logprobs, multi-LoRA's rid + extra_key
    # (without lora_path: no adapters here), deterministic inference's sampling_seed
    body = {
        **miles_rollout_body(PROMPT, 4),
        "top_logprobs_num": 3,
        "rid": "adapter-a-0001",
        "extra_key": "adapter-a:v3",
    }
    body["sampling_params"]["sampling_seed"] = 1234
    first = _ok(client.post("/generate", json=body))
    assert [len(p) for p in first["meta_info"]["output_top_logprobs"]] == [3] * 4
    assert first["meta_info"]["id"] == "adapter-a-0001"
    again = _ok(client.post("/generate", json=body))
    assert again["output_ids"] == first["output_ids"], "sampling_seed makes the draw reproducible"


def test_stop_string_and_trim(client: TestClient) -> None:
    """sglang's detokenizer trim (``trim_matched_stop``): generation ends at the first token after
    which the output contains a stop string; ``text`` ends before it (after it with
    ``no_stop_trim``); ``output_ids`` keep every generated token."""
    sampling = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 5}
    free = _ok(client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sampling}))
    decode = ByteTokenizer(tiny(MODEL).vocab_size).decode
    text = decode(free["output_ids"])
    stop = next((ch for ch in text[1:] if " " < ch < "\x7f"), None)
    assert stop is not None, f"no ASCII character to stop at in {text!r}"
    for no_trim in (False, True):
        body = {"input_ids": PROMPT, "sampling_params": {**sampling, "stop": [stop], "no_stop_trim": no_trim}}
        out = _ok(client.post("/generate", json=body))
        ids = out["output_ids"]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert ids == free["output_ids"][: len(ids)]
        assert stop in decode(ids)
        assert stop not in decode(ids[:-1])
        pos = decode(ids).index(stop)
        assert out["text"] == decode(ids)[: pos + 1 if no_trim else pos]


@pytest.mark.parametrize(
    ("body", "named"),
    [
        pytest.param({"input_ids": [1, 2], "retrun_logprob": True}, "retrun_logprob", id="typo-top-level"),
        pytest.param({"input_ids": [1, 2], "sampling_params": {"max_tokens": 4}}, "max_tokens", id="typo-sampling"),
        pytest.param({"input_ids": [1, 2], "lora_path": "adapter"}, "lora_path", id="unsupported-lora"),
        pytest.param({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "regex", id="unsupported-grammar"),
    ],
)
def test_unknown_or_unsupported_field_is_400_naming_it(client: TestClient, body: dict[str, Any], named: str) -> None:
    """Deliberately stricter than sglang (which drops unknown keys): a typo is an error."""
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    msg = r.json()["message"] if "message" in r.json() else r.json()["error"]["message"]
    assert named in msg


# -- pause / continue / flush / health ------------------------------------------------------------


def test_retract_then_continue_keeps_the_tokens_generated_before_the_pause(
    client: TestClient, ckpts: tuple[str, str]
) -> None:
    """miles' update order (mixin.py ``_pause_and_prepare_engines`` / ``_finalize_and_resume_engines``,
    pause mode ``retract`` = miles' default) with a long request in flight and different weights
    loaded meanwhile: its one answer starts with the tokens generated before the pause (their
    logprobs as computed then), goes on from them under the new weights, and counts the retraction."""
    n = 150
    greedy = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}, "return_logprob": True}
    old = _ok(client.post("/generate", json=greedy))
    pool = ThreadPoolExecutor(1)
    running = pool.submit(client.post, "/generate", json=greedy)
    t0 = time.monotonic()
    while not client.get("/server_info").json()["internal_states"][0]["batch_running"]:
        assert time.monotonic() - t0 < 30, "the request never started"
        time.sleep(0.005)
    time.sleep(0.2)  # some decode steps
    # SGLangEngine.pause_generation / flush_cache / begin_weight_update (sglang_engine.py)
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    assert _ok(client.get("/flush_cache")).startswith("Cache flushed")
    _ok(client.post("/begin_weight_update", json={"selector": "all"}))
    _ok(client.post("/update_weights_from_disk", json={"model_path": ckpts[1], "weight_version": "1"}))
    # SGLangEngine.update_weight_version / end_weight_update / continue_generation
    _ok(client.post("/update_weight_version", json={"new_version": "1", "abort_all_requests": False}))
    _ok(client.post("/end_weight_update", json={}))
    assert not running.done(), "a retracted request waits for continue_generation"
    _ok(client.post("/continue_generation", json={}))
    out = _ok(running.result(timeout=120))
    pool.shutdown()
    ids, meta = out["output_ids"], out["meta_info"]
    assert len(ids) == n
    assert meta["finish_reason"] == {"type": "length", "length": n}
    assert meta["num_retractions"] == 1
    assert meta["weight_version"] == "1"
    k = next((i for i, (a, b) in enumerate(zip(ids, old["output_ids"])) if a != b), n)
    assert 0 < k < n, f"{k} tokens before the pause: the pause must land mid-generation"
    lps = [row[0] for row in meta["output_token_logprobs"]]
    old_lps = [row[0] for row in old["meta_info"]["output_token_logprobs"]]
    assert lps[:k] == pytest.approx(old_lps[:k], abs=1e-5), "kept tokens keep the logprobs they were sampled with"
    cont = {"input_ids": PROMPT + ids[:k], "sampling_params": {"max_new_tokens": n - k, "temperature": 0.0}}
    assert _ok(client.post("/generate", json=cont))["output_ids"] == ids[k:], "it went on from the kept tokens"
    restart = _ok(client.post("/generate", json=greedy))["output_ids"]
    assert restart[:k] != ids[:k], "restarting from the prompt (the old behaviour) would give other tokens"


def test_pause_modes_flush_and_health(client: TestClient) -> None:
    # miles/backends/sglang_utils/sglang_engine.py: _wait_server_healthy (GET /health_generate,
    # then GET /flush_cache), health_generate, pause_generation({"mode"}), continue_generation({})
    assert client.get("/health_generate").status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/flush_cache").status_code == 200
    for mode in ("abort", "retract", "in_place"):
        r = _ok(client.post("/pause_generation", json={"mode": mode}))
        assert r == {"message": "Generation paused successfully.", "status": "ok"}
        assert _ok(client.post("/continue_generation", json={})) == {
            "message": "Generation continued successfully.",
            "status": "ok",
        }
    # sglang's own clients: {} is pause mode abort; continue's torch_empty_cache; POST flush_cache
    _ok(client.post("/pause_generation", json={}))
    _ok(client.post("/continue_generation", json={"torch_empty_cache": True}))
    assert client.post("/flush_cache", json={"timeout_s": 1.0}).status_code == 200
    # sglang entrypoints/http_server.py abort_request (used by routers)
    assert _ok(client.post("/abort_request", json={"rid": "nothing-in-flight"})) == {"status": "ok"}
    assert _ok(client.post("/abort_request", json={"abort_all": True})) == {"status": "ok"}


# -- information ----------------------------------------------------------------------------------


def test_server_info_is_server_args(client: TestClient, ckpts: tuple[str, str]) -> None:
    """Fields miles reads (``SGLangEngine._init_external`` compares them one by one,
    ``p2p_transfer_utils.query_remote_weight_infos`` rebuilds ServerArgs from them) with true
    values; the deprecated alias answers the same."""
    info = _ok(client.get("/server_info"))
    want = {"model_path": ckpts[0], "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "nnodes": 1,
            "node_rank": 0, "base_gpu_id": 0, "gpu_id_step": 1, "enable_memory_saver": False, "load_format": "auto",
            "dtype": "bfloat16", "enable_return_routed_experts": False, "enable_return_indexer_topk": False}
    assert {k: info[k] for k in want} == want
    for key in ("host", "port", "weight_version", "engine_info_bootstrap_port", "dist_init_addr", "nccl_port",
                "remote_instance_weight_loader_start_seed_via_transfer_engine", "rl_quant_profile", "status",
                "max_total_num_tokens", "max_req_input_len", "version"):
        assert key in info, key
    assert (Path(info["model_path"]) / "config.json").is_file(), "model_path resolves to the model's config"
    alias = _ok(client.get("/get_server_info"))
    assert {k: v for k, v in alias.items() if k != "internal_states"} == {
        k: v for k, v in info.items() if k != "internal_states"
    }


def test_model_info_weight_version(client: TestClient) -> None:
    """miles ``SGLangEngine.get_weight_version``: /model_info first, then /get_weight_version."""
    assert _ok(client.get("/model_info"))["weight_version"] == "0"
    assert _ok(client.get("/get_weight_version"))["weight_version"] == "0"


def test_parallelism_and_transfer_engine_info(client: TestClient) -> None:
    """``SGLangEngine.get_parallelism_info`` (GET /parallelism_config?rank=R, read by
    ``RankParallelismConfig.from_dict``) and ``get_remote_instance_transfer_engine_info``
    (unpacked as ``session_id, weights_info``); a missing or unknown rank is a 400."""
    par = _ok(client.get("/parallelism_config", params={"rank": 0}))
    assert set(par) == {"tp_size", "tp_rank", "pp_size", "pp_rank", "ep_size", "ep_rank", "moe_tp_size",
                        "moe_tp_rank", "attn_tp_size", "attn_tp_rank", "attn_dp_size", "attn_dp_rank", "world_size",
                        "global_rank", "local_rank"}
    for path in ("/get_remote_instance_transfer_engine_info", "/remote_instance_transfer_engine_info"):
        session_id, weights_info = _ok(client.get(path, params={"rank": 0}))["remote_instance_transfer_engine_info"]
        assert isinstance(session_id, str)
        ptr, numel, element_size = weights_info["model.layers.0.self_attn.kv_b_proj.weight"]
        assert ptr > 0
        assert numel > 0
        assert element_size == 1  # fp8
        assert not [n for n in weights_info if n.endswith(("w_kc", "w_vc"))], "derived tensors are not parameters"
        for bad in ({}, {"rank": -1}, {"rank": 1}, {"rank": "x"}):
            r = client.get(path, params=bad)
            assert r.status_code == 400
            assert "rank" in r.json()["error"]["message"]
    assert client.get("/parallelism_config").status_code == 400
    assert client.get("/parallelism_config", params={"rank": 1}).status_code == 400


# -- weight updates -------------------------------------------------------------------------------


def test_broadcast_bodies(client: TestClient, ckpts: tuple[str, str], free_port: int) -> None:
    """``connect_rollout_engines_from_distributed`` -> SGLangEngine.init_weights_update_group,
    ``update_weights_from_distributed`` (broadcast.py; body by SGLangEngine.update_weights_from_distributed:
    dtypes without "torch.", flush_cache False, selector, weight_version), then
    ``destroy_weights_update_group``; the trainer is rank 0 of the group as miles builds it
    (``utils/distributed_utils.py`` ``init_process_group``: torch's rendezvous and group helper)
    and broadcasts every tensor as miles does (``broadcast.py`` ``update_weights_from_distributed``:
    one asynchronous broadcast per tensor, then a wait on all)."""
    with HFCheckpoint(ckpts[1]) as c:
        tensors = {n: c.get(n) for n in c.names()}
    group = "miles-pp_0"

    def trainer() -> None:
        pg = join_group_sglang_way(master_address="127.0.0.1", master_port=free_port, rank=0, world_size=2,
                                   group_name=group, backend="gloo", timeout=datetime.timedelta(seconds=120))
        handles = [torch.distributed.broadcast(t.contiguous(), 0, group=pg, async_op=True) for t in tensors.values()]
        for h in handles:
            h.wait()
        torch.distributed.destroy_process_group(pg)

    pool = ThreadPoolExecutor(1)
    sender = pool.submit(trainer)
    init = {"master_address": "127.0.0.1", "master_port": free_port, "rank_offset": 1, "world_size": 2,
            "group_name": group, "backend": "gloo"}
    assert _ok(client.post("/init_weights_update_group", json=init))["success"]
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    _ok(client.post("/begin_weight_update", json={"selector": "all"}))
    body = {
        "names": list(tensors),
        "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": group,
        "flush_cache": False,
        "selector": "all",
        "weight_version": "7",
    }
    upd = _ok(client.post("/update_weights_from_distributed", json=body))
    sender.result(timeout=60)
    pool.shutdown()
    assert upd["success"]
    assert upd["message"].startswith("Succeeded to update parameter online.")
    _ok(client.post("/end_weight_update", json={}))
    _ok(client.post("/continue_generation", json={}))
    assert _ok(client.get("/model_info"))["weight_version"] == "7"
    assert _ok(client.post("/destroy_weights_update_group", json={"group_name": group}))["success"]
    again = client.post("/destroy_weights_update_group", json={"group_name": group})
    assert again.status_code == 400
    assert again.json() == {"success": False, "message": "The group to be destroyed does not exist."}


def test_update_weights_from_disk_needs_no_session(client: TestClient, ckpts: tuple[str, str]) -> None:
    """``SGLangEngine.update_weights_from_disk`` (miles reloads frozen weights after an offload):
    ``{"model_path", "weight_version"}`` with no session, as sglang 0.5.23 takes it
    (``SchedulerWeightUpdaterManager.update_weights_from_disk`` needs none): paused or idle, the
    weights become the checkpoint's, clean, at the version; after an ended, unpublished session it
    is a roll-back (the session is dropped)."""
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    _load(client, ckpts[1], "2")
    _ok(client.post("/weights_checker", json={"action": "snapshot"}))
    _ok(client.post("/continue_generation", json={}))
    out = _ok(client.post("/update_weights_from_disk", json={"model_path": ckpts[0], "weight_version": "3"}))
    assert out["success"]
    assert out["message"].endswith("Weight version updated to 3."), out
    assert _ok(client.get("/model_info"))["weight_version"] == "3"
    assert _ok(client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}))
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    _ok(client.post("/begin_weight_update", json={}))
    _ok(client.post("/weights_checker", json={"action": "reset_tensors"}))
    assert _ok(client.post("/end_weight_update", json={}))["state"] == "ended"
    _ok(client.post("/update_weights_from_disk", json={"model_path": ckpts[1], "weight_version": "4"}))
    state = client.get("/server_info").json()["internal_states"][0]
    assert (state["state"], state["weights_dirty"], state["session_id"]) == ("paused", False, None)
    assert _ok(client.post("/weights_checker", json={"action": "compare"}))["success"]
    _ok(client.post("/continue_generation", json={}))


def test_miles_offload_cycle_keeps_the_weights(client: TestClient) -> None:
    """miles' colocated offload (``SGLangEngine.release_memory_occupation``: GET /flush_cache, then
    ``{"tags": [...]}``; ``resume_memory_occupation`` ``{"tags": ["weights"]}``, then
    ``["kv_cache", "cuda_graph"]``; an engine (re)start releases ``{"tags": null}``): 200 with a
    ``null`` body (sglang's handlers return nothing), the tags reported until resumed, nothing
    freed -- the same weights answer afterwards; an unknown tag is a 400 in sglang's error body."""
    before = _engine_checksums(_ok(client.post("/weights_checker", json={"action": "checksum"})))
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    assert client.get("/flush_cache").status_code == 200
    for path, tags, released in [
        ("/release_memory_occupation", ["cuda_graph", "kv_cache", "weights"], ["cuda_graph", "kv_cache", "weights"]),
        ("/resume_memory_occupation", ["weights"], ["cuda_graph", "kv_cache"]),
        ("/resume_memory_occupation", ["kv_cache", "cuda_graph"], []),
        ("/release_memory_occupation", None, ["cuda_graph", "kv_cache", "weights"]),
        ("/resume_memory_occupation", None, []),
    ]:
        r = client.post(path, json={"tags": tags})
        assert (r.status_code, r.json()) == (200, None), r.text
        assert client.get("/server_info").json()["internal_states"][0]["memory_released"] == released
    assert client.get("/release_memory_occupation").status_code == 200, "sglang serves GET too"
    assert client.get("/resume_memory_occupation").status_code == 200
    bad = client.post("/release_memory_occupation", json={"tags": ["kv"]})
    assert bad.status_code == 400
    assert "unknown memory tags ['kv']" in bad.json()["error"]["message"]
    _ok(client.post("/continue_generation", json={}))
    assert _engine_checksums(_ok(client.post("/weights_checker", json={"action": "checksum"}))) == before


@dataclass
class _FlattenedTensorMetadata:
    """Stands in for sglang's record when pickling: same fields, same module path (below)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _sglang_flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> str:
    """What sglang's ``FlattenedTensorBucket(named_tensors=...)`` plus
    ``MultiprocessingSerializer.serialize(..., output_str=True)`` produce (weight_sync/tensor_bucket.py,
    utils/common.py): byte offsets into one uint8 tensor, a ForkingPickler dump, base64."""
    module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    _FlattenedTensorMetadata.__module__ = module.__name__
    _FlattenedTensorMetadata.__qualname__ = _FlattenedTensorMetadata.__name__ = "FlattenedTensorMetadata"
    module.FlattenedTensorMetadata = _FlattenedTensorMetadata
    saved = {k: sys.modules.get(k) for k in ("sglang", "sglang.srt", "sglang.srt.weight_sync", module.__name__)}
    sys.modules.update({k: types.ModuleType(k) for k in saved if k != module.__name__})
    sys.modules[module.__name__] = module
    try:
        flats, metadata, offset = [], [], 0
        for name, t in named:
            flat = t.flatten().view(torch.uint8)
            metadata.append(_FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + flat.numel(),
                                                     flat.numel()))
            flats.append(flat)
            offset += flat.numel()
        buf = io.BytesIO()
        ForkingPickler(buf).dump({"flattened_tensor": torch.cat(flats), "metadata": metadata})
        return base64.b64encode(buf.getvalue()).decode("utf-8")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def test_colocated_update_weights_from_tensor(client: TestClient, ckpts: tuple[str, str]) -> None:
    """miles update_weight_from_tensor.py ``_send_to_colocated_engine`` -> SGLangEngine.update_weights_from_tensor:
    one flattened bucket of every dtype per TP rank, load_format flattened_bucket, flush_cache
    False, selector, weight_version; checked with the checker (snapshot of the second checkpoint's
    weights loaded from disk, then the first's, then the bucket of the second's)."""
    with HFCheckpoint(ckpts[1]) as c:
        named = [(n, c.get(n)) for n in c.names()]
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    _load(client, ckpts[1], "2")
    _ok(client.post("/weights_checker", json={"action": "snapshot", "allow_quant_error": False, "selector": "all"}))
    _load(client, ckpts[0], "0")
    _ok(client.post("/begin_weight_update", json={"selector": "all"}))
    body = {"serialized_named_tensors": [_sglang_flattened_bucket(named)], "load_format": "flattened_bucket",
            "flush_cache": False, "selector": "all", "weight_version": "3"}
    out = _ok(client.post("/update_weights_from_tensor", json=body))
    assert out == {**out, "success": True, "message": "Success Weight version updated to 3."}
    _ok(client.post("/end_weight_update", json={}))
    cmp = _ok(client.post("/weights_checker", json={"action": "compare", "allow_quant_error": False,
                                                     "selector": "all"}))
    assert cmp["success"]
    bad = client.post("/update_weights_from_tensor", json={**body, "serialized_named_tensors": ["bm90IGEgcGlja2xl"]})
    assert bad.status_code == 400
    assert bad.json()["success"] is False


# -- weights checker ------------------------------------------------------------------------------


def _engine_checksums(body: dict[str, Any]) -> dict[str, str]:
    """A reader of sglang's checksum answer as miles' audit reads it (checksum_utils
    ``_merge_inference_engine_ranks`` / ``_gpu_rank``): success, non-empty ranks, each rank's
    ``parallelism_info`` a list of per-role dicts agreeing on ``rank``; keys ``rank{r}/{name}``."""
    assert body["success"]
    assert body["ranks"]
    out: dict[str, str] = {}
    for info in body["ranks"]:
        (gpu,) = {role["rank"] for role in info["parallelism_info"]}
        out.update({f"rank{gpu}/{name}": value for name, value in info["checksums"].items()})
    return out


def test_check_weight_update_equal_cycle(client: TestClient, ckpts: tuple[str, str]) -> None:
    """miles ``--check-weight-update-equal``: placement_group.py snapshot then reset_tensors with
    the skip list, train.py compare with allow_quant_error + selector + skip list, group.py
    checksum per rollout; bodies by SGLangEngine.check_weights."""
    skip = ["lm_head"]
    body = {"allow_quant_error": False, "selector": "all"}
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    _ok(client.post("/weights_checker", json={"action": "snapshot", **body}))
    before = _engine_checksums(_ok(client.post("/weights_checker", json={"action": "checksum", **body})))
    _ok(client.post("/weights_checker", json={"action": "reset_tensors", **body, "skip_tensor_list": skip}))
    after_reset = _engine_checksums(_ok(client.post("/weights_checker", json={"action": "checksum", **body})))
    assert after_reset["rank0/lm_head.weight"] == before["rank0/lm_head.weight"], "skipped tensors are not reset"
    assert after_reset["rank0/model.embed_tokens.weight"] != before["rank0/model.embed_tokens.weight"]
    _load(client, ckpts[0])
    cmp = _ok(client.post("/weights_checker", json={"action": "compare", "allow_quant_error": True,
                                                     "selector": "all", "skip_tensor_list": skip}))
    assert cmp["success"]
    body_out = _ok(client.post("/weights_checker", json={"action": "checksum", **body}))
    assert _engine_checksums(body_out) == before
    assert set(body_out) >= {"success", "message", "ranks", "per_engine_checksum"}
    assert body_out["ranks"][0]["parallelism_info"][0] == {"role": "target", "tp_rank": 0, "tp_size": 1,
                                                           "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                                                           "rank": 0, "size": 1}
    # sglang: no body is action checksum (GET works too)
    assert _ok(client.get("/weights_checker"))["ranks"][0]["checksums"] == body_out["ranks"][0]["checksums"]


def test_fp8_compare_within_one_ulp_per_side(served: tuple[TestClient, Engine]) -> None:
    """``allow_quant_error``: a block-fp8 weight one fp8 ULP off passes (sglang's
    ``Fp8BlockComparable`` rule) where the bitwise compare fails; far off fails both."""
    client, engine = served
    _ok(client.post("/pause_generation", json={"mode": "retract"}))
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    _ok(client.post("/weights_checker", json={"action": "snapshot"}))
    w = engine.store[name].view(torch.uint8).reshape(-1)
    original = w[:4].clone()
    w[:4] = torch.where((original & 0x7F) < 0x7E, original + 1, original - 1)  # neighbouring fp8 values
    try:
        bitwise = client.post("/weights_checker", json={"action": "compare"})
        assert bitwise.status_code == 400
        assert name in bitwise.json()["message"]
        tolerant = _ok(client.post("/weights_checker", json={"action": "compare", "allow_quant_error": True}))
        assert tolerant["success"]
        assert name in tolerant["ranks"][0]["within_quant_error"]
        w[:4] = original ^ 0x40  # an exponent bit: many ULPs
        far = client.post("/weights_checker", json={"action": "compare", "allow_quant_error": True})
        assert far.status_code == 400
        assert name in far.json()["message"]
    finally:
        w[:4] = original
