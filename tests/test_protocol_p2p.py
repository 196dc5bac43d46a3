"""Contract: the trainer writes into an engine that publishes exactly what a real sglang server
publishes -- ``[session_id, {name: [ptr, numel, element_size]}]`` per TP rank over Mooncake
(sglang ``entrypoints/http_server.py`` ``get_remote_instance_transfer_engine_info``, consumed as
miles ``p2p_transfer_utils.query_remote_weight_infos`` does) -- and never writes a derived tensor.

* ``dest_rank_from_info`` on sglang's format: the destination is one Mooncake region per
  published parameter; derived tensors (MLA ``w_kc``/``w_vc``) are not destinations; a published
  ``(numel, element_size)`` that disagrees with the plan is refused naming the tensor.
* A full p2p update over Mooncake tcp (tiny GLM-4.7-Flash, CPU) into ``weightsync serve
  --transport mooncake --transfer-info-format sglang``: sglang's ``--check-weight-update-equal``
  cycle passes, and the derived tensors still hold their reset values after every byte landed
  (nobody wrote them) until ``end_weight_update`` recomputes them.
* ``weightsync run --engine-urls URL --transport mooncake`` against that engine: the run finds
  its layout from ``/server_info``, ``/parallelism_config``, the published table and the model's
  ``config.json`` alone, and every gate passes (check-weight-update-equal, checksums, logprob
  parity); with ``--transport shm`` it is refused before any byte, naming why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.e2e_helpers import assert_run_passed, e2e_ckpt_fixture, run_cli  # noqa: F401 -- the e2e_ckpt fixture
from tests.engine_helpers import one_torch_thread, tiny  # noqa: F401 -- autouse fixture
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models.checkpoint import HFCheckpoint
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.inputs import build_inputs
from weightsync.plan.p2p import plan_p2p_for_rank
from weightsync.sync.p2p_sender import P2PSender, dest_rank_from_info
from weightsync.sync.params import ParamStore, write_global
from weightsync.transport.mooncake import mooncake_available

MODEL = "GLM-4.7-Flash"
PROFILE_FLAGS = ("--enable-dp-lm-head",)
"""The sglang flags of the model's run profile (its engines are started with them)."""


def _sglang_info(layout: list[Any]) -> dict[str, Any]:
    """What a real sglang rank publishes for ``layout``: its parameters only, no descriptor."""
    weights, addr = {}, 1 << 20
    for t in layout:
        if t.derived:
            continue
        esize = getattr(torch, t.dtype).itemsize
        weights[t.name] = [addr, t.numel, esize]
        addr += -(-t.numel * esize // 256) * 256
    return {"session_id": "10.0.0.7:15123", "weights": weights, "descriptor": None}


def test_dest_rank_from_sglang_format() -> None:
    spec = tiny(MODEL)
    layout = engine_layout(spec, RolloutParallel(), 0)
    derived = {t.name for t in layout if t.derived}
    assert derived, "the MLA layout has derived tensors"
    info = _sglang_info(layout)
    dest = dest_rank_from_info(0, info, layout)
    assert dest.descriptor.kind == "mooncake"
    assert dest.descriptor.session_id == "10.0.0.7:15123"
    assert {r.name for r in dest.descriptor.regions} == set(info["weights"])
    assert not derived & set(dest.params), "derived tensors are never destinations"
    # our own engine may list derived tensors too: they are still not destinations
    with_derived = {**info, "weights": {**info["weights"], **{n: [1 << 40, 1, 2] for n in derived}}}
    assert not derived & set(dest_rank_from_info(0, with_derived, layout).params)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    ptr, numel, esize = info["weights"][name]
    bad = {**info, "weights": {**info["weights"], name: [ptr, numel - 1, esize]}}
    with pytest.raises(ValueError, match=f"{name}: published numel={numel - 1} x {esize} B, plan expects {numel}"):
        dest_rank_from_info(0, bad, layout)
    wide = {**info, "weights": {**info["weights"], name: [ptr, numel, 4]}}
    with pytest.raises(ValueError, match=name):
        dest_rank_from_info(0, wide, layout)


# -- the update over Mooncake ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(e2e_ckpt: Path) -> Path:
    """The run's prepared HF checkpoint of the model (shared with the end-to-end tests)."""
    from weightsync.sources.prepare import ensure_prepared

    hf_dir, _ = ensure_prepared(MODEL, scale="tiny", ckpt_dir=e2e_ckpt, progress=False)
    return Path(hf_dir)


@pytest.fixture(scope="module")
def sglang_engine(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``weightsync serve`` publishing only sglang's transfer-engine info, over Mooncake tcp."""
    if not mooncake_available():
        pytest.skip("Mooncake is not installed")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    cmd = [sys.executable, "-m", "weightsync.cli", "serve", MODEL, "--scale", "tiny", "--checkpoint", str(ckpt),
           "--transport", "mooncake", "--mooncake-protocol", "tcp", "--transfer-info-format", "sglang",
           "--compute-dtype", "float32", *PROFILE_FLAGS,
           "--port", str(port), "--log-level", "warning"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, f"serve exited:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/health_generate", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() - t0 < 120, f"engine not healthy:\n{log.read_text()}"
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, f"{path}: {r.status_code} {r.text}"
    return r.json()


def _checksums(url: str) -> dict[str, str]:
    return _post(url, "/weights_checker", {"action": "checksum"})["ranks"][0]["checksums"]


@pytest.mark.timeout(300)
def test_p2p_update_into_an_engine_publishing_only_sglangs_format(sglang_engine: str, ckpt: Path) -> None:
    url = sglang_engine
    spec = tiny(MODEL)
    train, rollout = TrainParallel(world_size=1), RolloutParallel()
    # miles query_remote_weight_infos: GET /get_remote_instance_transfer_engine_info?rank=R ->
    # json()["remote_instance_transfer_engine_info"] unpacked as session_id, weights_info
    answer = httpx.get(f"{url}/get_remote_instance_transfer_engine_info", params={"rank": 0}).json()
    assert set(answer) == {"rank", "remote_instance_transfer_engine_info"}, "nothing beyond sglang's answer"
    session_id, weights_info = answer["remote_instance_transfer_engine_info"]
    layout = engine_layout(spec, rollout, 0)
    derived = sorted(t.name for t in layout if t.derived)
    assert derived
    assert not set(derived) & set(weights_info)

    # the trainer: one rank holding the checkpoint's tensors in the Megatron layout
    inputs = build_inputs(spec, train, rollout, trainer_layout=trainer_layout, engine_layout=engine_layout)
    source = ParamStore(trainer_layout(spec, train, 0), torch.device("cpu"))
    with HFCheckpoint(str(ckpt)) as c:
        for name in source.global_names():
            full = c.get(name)
            write_global(source, spec, name, lambda box, t=full: t[tuple(slice(a, b) for a, b in box)])
    dest = dest_rank_from_info(0, {"session_id": session_id, "weights": weights_info, "descriptor": None}, layout)
    plan = plan_p2p_for_rank(inputs, src_rank=0)
    assert {op.dst_param for op in plan.ops} <= set(dest.params)

    from weightsync.transport import make_transport

    transport = make_transport("mooncake", protocol="tcp", device="", hostname="127.0.0.1")
    sender = P2PSender(plan.ops, dict(source.items()), transport, {0: dest}, bucket_bytes=1 << 20)
    try:
        # sglang --check-weight-update-equal, in miles' order (placement_group.py, mixin.py, train.py)
        _post(url, "/weights_checker", {"action": "snapshot", "allow_quant_error": False, "selector": "all"})
        _post(url, "/weights_checker", {"action": "reset_tensors", "allow_quant_error": False, "selector": "all"})
        reset = _checksums(url)
        _post(url, "/pause_generation", {"mode": "retract"})
        _post(url, "/begin_weight_update", {"selector": "all"})
        stats = sender.send(deadline_s=120)
        written = _checksums(url)
        assert stats.nbytes > 0
        listed = {n for n in weights_info if not n.endswith("_scale_inv")}  # sglang hashes an fp8 weight with its scale
        assert {n for n in reset if reset[n] != written[n]} == listed, "every parameter was written"
        before_end = httpx.post(f"{url}/weights_checker", json={"action": "compare"}, timeout=120).json()
        assert {m["name"] for m in before_end["mismatches"]} == set(derived), (
            "every written parameter is the checkpoint's again; no derived tensor was written (they are recomputed "
            "at the end of the session)")
        _post(url, "/update_weight_version", {"new_version": "1", "abort_all_requests": False})
        _post(url, "/end_weight_update", {})
        _post(url, "/continue_generation", {})
        cmp = _post(url, "/weights_checker", {"action": "compare", "allow_quant_error": False, "selector": "all"})
        assert cmp["success"], cmp
    finally:
        sender.close()


@pytest.mark.timeout(400)
def test_run_updates_an_engine_publishing_only_sglangs_format(sglang_engine: str, e2e_ckpt: Path,
                                                              tmp_path: Path) -> None:
    argv = ["run", MODEL, "--train", "tp=1,ep=1,world=1", "--rollout", "tp=1,ep=1,engines=1", "--mode", "p2p",
            "--num-rollout", "1", "--engine-urls", sglang_engine]
    refused = run_cli([*argv, "--transport", "shm"], ckpt_dir=e2e_ckpt, log_dir=tmp_path / "shm")
    assert refused.returncode == 1, refused.describe()
    assert "only --transport mooncake can write into it" in refused.output
    run = run_cli([*argv, "--transport", "mooncake"], ckpt_dir=e2e_ckpt, log_dir=tmp_path / "mooncake")
    assert_run_passed(run, modes=["p2p", "p2p"])
    assert run.meta["transport"] == "mooncake"
