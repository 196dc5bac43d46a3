"""Contract: weightsync's trainer (:class:`WeightUpdater`) drives a server that behaves as a real
sglang does -- release 0.5.23, release 0.5.16 and miles' build (tests/sglang_fake.py: sglang's
routes, bodies, answers and refusals, its weight-update group joined sglang's way, its checksums).

* Broadcast: the engines join the trainer's group as sglang's ``init_custom_process_group`` does
  (``srt/utils/common.py``), each engine at its rank offset (1, then 1 + the TP of the engines
  before it); the trainer posts ``/init_weights_update_group`` to all of them at once before its
  store waits for them (one at a time the first post would wait for a group that cannot form),
  then broadcasts every tensor from rank 0 in the announced order; what the engines hold is then
  the trainer's weights, by sglang's own checksum.

One trainer rank (a gloo group of one, in this process); fake engines are processes of their own.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import torch

from tests.sglang_fake import expected_checksums, serve_fake
from weightsync import UpdateError, UpdaterConfig, WeightUpdater
from weightsync.layout.box import box_slices
from weightsync.layout.megatron import trainer_layout
from weightsync.models import get_model
from weightsync.models.parallel import RolloutParallel, TrainParallel

SPEC = get_model("Qwen3-4B", "tiny")
TRAIN = TrainParallel(world_size=1)


def trainer_params(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype))
            for t in trainer_layout(SPEC, TRAIN, 0)}


def global_tensors_of(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors a one-rank trainer's parameters hold (every piece of every global tensor)."""
    from weightsync.models.hf import global_tensors

    table = global_tensors(SPEC)
    out: dict[str, torch.Tensor] = {}
    for t in trainer_layout(SPEC, TRAIN, 0):
        for p in t.pieces:
            g = table[p.global_name]
            dst = out.setdefault(p.global_name, torch.zeros(g.shape, dtype=getattr(torch, g.dtype)))
            dst[box_slices(p.global_box)] = params[t.name][box_slices(p.local_box)].reshape(
                tuple(b - a for a, b in p.global_box))
    return out


def checksums_of(url: str) -> list[dict[str, str]]:
    """Each rank's checksums, from sglang's answer (``ranks[i].checksums``)."""
    body = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=60).json()
    assert body["success"], body
    return [r["checksums"] for r in body["ranks"]]


@pytest.mark.timeout(300)
def test_broadcast_group_with_engines_that_join_sglangs_way(trainer_group: object, tmp_path: Path) -> None:
    params = trainer_params(1)
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_fake(tmp_path / f"engine{e}.log", flavor="miles", seed=e))
                for e in range(2)]
        before = [checksums_of(u) for u in urls]
        config = UpdaterConfig(mode="broadcast", verify_every=1, group_timeout_s=60, http_timeout_s=60)
        with WeightUpdater(params, spec=SPEC, train=TRAIN, engine_urls=urls, group=trainer_group,
                           config=config) as updater:
            stats = updater.update(1)
            assert stats.mode == "broadcast"
            assert stats.verified
            expected = expected_checksums(SPEC, RolloutParallel(), 0, global_tensors_of(params), gpu=True)
            for url, old in zip(urls, before):
                (got,) = checksums_of(url)
                assert got == expected
                assert got != old[0]
                calls = httpx.get(f"{url}/fake_calls").json()
                session = calls[calls.index("/begin_weight_update"):calls.index("/end_weight_update")]
                assert "/update_weights_from_distributed" in session
                assert httpx.get(f"{url}/model_info").json()["weight_version"] == "1"
        for url in urls:  # closing the updater took the engines off its group
            assert "/destroy_weights_update_group" in httpx.get(f"{url}/fake_calls").json()


def _calls_since(url: str, start: int) -> list[str]:
    return httpx.get(f"{url}/fake_calls").json()[start:]


def _num_calls(url: str) -> int:
    return len(httpx.get(f"{url}/fake_calls").json())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavor", ["0.5.23", "0.5.16"])
def test_a_failed_update_leaves_sglang_paused_and_able_to_take_the_next(
        trainer_group: object, tmp_path: Path, flavor: str, caplog: pytest.LogCaptureFixture) -> None:
    """sglang has no ``/abort_weight_update``: a failed update ends the session with
    ``/end_weight_update`` (0.5.23; 0.5.16 has no sessions: nothing to end, said once), publishes
    nothing and does not resume generation; the next update begins and lands. A session left open
    by a trainer that died is ended before the next begin."""
    params = trainer_params(2)
    config = UpdaterConfig(mode="broadcast", verify_every=0, group_timeout_s=60, http_timeout_s=60)
    with serve_fake(tmp_path / "engine.log", flavor=flavor) as url, WeightUpdater(
            params, spec=SPEC, train=TRAIN, engine_urls=[url], group=trainer_group, config=config) as updater:
        write = updater.write

        def broken(mode: object, **kw: object) -> dict:
            raise RuntimeError("the trainer's write broke")

        updater.write = broken  # type: ignore[method-assign]
        start = _num_calls(url)
        with pytest.raises(UpdateError, match=r"sglang engines .* have no abort.*the trainer's write broke"):
            updater.update(1)
        calls = _calls_since(url, start)
        assert "/abort_weight_update" not in calls
        assert "/update_weight_version" not in calls
        assert "/continue_generation" not in calls
        if flavor == "0.5.23":
            assert calls[-1] == "/end_weight_update", calls
        else:
            assert calls.count("/begin_weight_update") == 1, "404 once, then no session routes"
            assert "/end_weight_update" not in calls
        assert httpx.get(f"{url}/model_info").json()["weight_version"] == "default"

        updater.write = write  # type: ignore[method-assign]
        if flavor == "0.5.23":  # a session a dead trainer left open
            assert httpx.post(f"{url}/begin_weight_update", json={}).status_code == 200
        start = _num_calls(url)
        updater.update(2)
        calls = _calls_since(url, start)
        assert calls[-2:] == ["/update_weight_version", "/continue_generation"], calls
        if flavor == "0.5.23":
            begin = calls.index("/pause_generation") + 1  # after the rebuild the failure asks for
            assert calls[begin:begin + 3] == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update"]
        else:
            assert "/begin_weight_update" not in calls
        expected = expected_checksums(SPEC, RolloutParallel(), 0, global_tensors_of(params), gpu=True)
        assert checksums_of(url) == [expected]
        assert httpx.get(f"{url}/model_info").json()["weight_version"] == "2"
    said = [r for r in caplog.records if "no weight-update sessions" in r.getMessage()]
    assert len(said) == (1 if flavor == "0.5.16" else 0)


# -- discovery --------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavor", ["0.5.23", "0.5.16", "miles"])
def test_p2p_into_the_parameters_sglang_publishes(trainer_group: object, tmp_path: Path, flavor: str) -> None:
    """Release sglang has no ``/parallelism_config`` (404): the ranks' coordinates come from
    ``/server_info``; miles' build has it and it is checked. The p2p writes land (Mooncake, into
    the table sglang publishes, two ranks of one engine), inside the session where there is one,
    and the update verifies by sglang's own checksums (each release's answer shape)."""
    params = trainer_params(3)
    config = UpdaterConfig(mode="p2p", verify_every=1, http_timeout_s=60)
    with serve_fake(tmp_path / "engine.log", flavor=flavor, tp=2, transport="mooncake") as url:
        with WeightUpdater(params, spec=SPEC, train=TRAIN, engine_urls=[url], group=trainer_group,
                           config=config) as updater:
            stats = updater.update(1)
            assert stats.mode == "p2p"
            assert stats.verified, "sglang's own checksums of every rank equal the plan shares' sums"
        full = global_tensors_of(params)
        got = checksums_of(url)
        for r in range(2):
            assert got[r] == expected_checksums(SPEC, RolloutParallel(tp=2), r, full, gpu=True), f"rank {r}"


@pytest.mark.timeout(300)
def test_p2p_without_sglangs_transfer_engine_is_refused_naming_the_flag(trainer_group: object,
                                                                        tmp_path: Path) -> None:
    with serve_fake(tmp_path / "engine.log", flavor="0.5.23") as url, pytest.raises(
            ValueError, match=r"rank 0 publishes no parameter table.*--remote-instance-weight-loader-start-seed-via-"
                              r"transfer-engine"):
        WeightUpdater(trainer_params(0), spec=SPEC, train=TRAIN, engine_urls=[url], group=trainer_group,
                      config=UpdaterConfig(mode="p2p", verify_every=0))


@pytest.mark.timeout(300)
def test_a_published_table_of_another_model_is_refused_at_connect(trainer_group: object, tmp_path: Path) -> None:
    """Broadcast needs no table, but one that is published is checked against the derived layout."""
    other = get_model("Qwen3-30B-A3B", "tiny")
    params = {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in trainer_layout(other, TRAIN, 0)}
    with serve_fake(tmp_path / "engine.log", flavor="0.5.23", transport="mooncake") as url, pytest.raises(
            ValueError, match=r"engine 0 at .*, rank 0: rollout rank 0 does not have the layout the plan expects"):
        WeightUpdater(params, spec=other, train=TRAIN, engine_urls=[url], group=trainer_group,
                      config=UpdaterConfig(mode="broadcast", verify_every=0))


# -- verification ------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_write_that_did_not_happen_is_named_by_sglangs_checksums(trainer_group: object, tmp_path: Path) -> None:
    """A p2p write that did not happen: sglang's checksums (from the plan shares) name the
    tensors; the engine's session is ended and nothing is published; the next update repairs it."""
    from weightsync.sync.p2p_sender import SendStats

    params = trainer_params(4)
    config = UpdaterConfig(mode="p2p", verify_every=1, http_timeout_s=60)
    with serve_fake(tmp_path / "engine.log", flavor="0.5.23", transport="mooncake") as url, \
            WeightUpdater(params, spec=SPEC, train=TRAIN, engine_urls=[url], group=trainer_group,
                          config=config) as updater:
        sender = updater.p2p_sender
        assert sender is not None
        real = sender.send
        sender.send = lambda **kw: SendStats(total_s=0.0, pack_s=0.0, wire_s=0.0, bytes_direct=0,  # type: ignore
                                             bytes_staged=0, bytes_by_dest={})
        start = _num_calls(url)
        with pytest.raises(UpdateError, match=rf"checksums differ: engine 0 at {url}, rank 0: \d+ of \d+ tensors "
                                              r"differ: .*model\.embed_tokens\.weight"):
            updater.update(1)
        calls = _calls_since(url, start)
        assert calls[calls.index("/weights_checker") + 1:] == ["/end_weight_update"], "no version, no resume"
        assert httpx.get(f"{url}/model_info").json()["weight_version"] == "default"
        sender.send = real  # type: ignore[method-assign]
        assert updater.update(2).verified


@pytest.mark.timeout(300)
def test_verifying_a_cpu_sglang_is_refused_at_set_up(trainer_group: object, tmp_path: Path) -> None:
    """sglang on the CPU reports sha256 checksums, which do not add up over the writers."""
    with serve_fake(tmp_path / "engine.log", flavor="0.5.23", device="cpu", transport="mooncake") as url, \
            pytest.raises(ValueError, match=r"a real sglang on the CPU .*verify_every=0"):
        WeightUpdater(trainer_params(5), spec=SPEC, train=TRAIN, engine_urls=[url], group=trainer_group,
                      config=UpdaterConfig(mode="p2p", verify_every=1))
