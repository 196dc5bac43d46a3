"""Contract: :class:`WeightUpdater` updates a TP 2 engine pause-free while clients generate the
whole time -- p2p and broadcast alternating, published by a swap or by a copy:

* every update is verified and pause-free (its stats say so, and how it flipped);
* no client request is refused (no non-200) or cut short (no ``abort``);
* answers spanning a flip say so (``weight_version_spans``), and the answers of one version that
  span none are all the same (greedy: none was computed partly with other weights);
* after the updates the served weights equal the trainer's, bit for bit (every served parameter's
  checksum against the trainer's weights laid out by the engine's own loading rule);
* one byte of the shadow corrupted after the write (by another process of the engine's user, in
  the engine's shm segment) is caught by the verification: the update is refused, the engine keeps
  serving the old version, no answer ever carries the refused version, and the next update
  publishes.

One trainer rank (a gloo group of one, in this process); ``weightsync serve`` engines of tiny
Qwen3-4B at TP 2: over Mooncake (both copies published: swap or copy) and over shm (the inbox is
the shadow: copies). Answers are compared by their tokens and their logprobs (within 1e-4).
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import test_sync_updater_engine as base
from tests.e2e_helpers import serve_engine
from weightsync import UpdateError, UpdaterConfig, WeightUpdater
from weightsync.launch.validate import compare_checksums, expected_checksums
from weightsync.layout.megatron import trainer_layout
from weightsync.models import get_model
from weightsync.models.parallel import TrainParallel
from weightsync.sync.engine_client import EngineClient, EngineError
from weightsync.transport.mooncake import mooncake_available

SPEC = get_model("Qwen3-4B", "tiny")
TRAIN = TrainParallel(world_size=1)
ENGINE = ["Qwen3-4B", "--scale", "tiny", "--tp", "2", "--load-format", "dummy"]
BODY = {"input_ids": [7, 3, 99, 41, 5], "sampling_params": {"max_new_tokens": 24, "temperature": 0.0,
                                                           "ignore_eos": True}, "return_logprob": True}
group = base.group  # the fixture: a gloo group of this one trainer rank


def _params(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {t.name: (torch.randn(t.shape, generator=gen) * 0.05).to(getattr(torch, t.dtype))
            for t in trainer_layout(SPEC, TRAIN, 0)}


def _step(params: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in params.values():
        t.add_((torch.randn(t.shape, generator=gen) * 0.05).to(t.dtype))


class Clients:
    """Threads sending :data:`BODY` back to back, recording every answer or refusal."""

    def __init__(self, url: str, n: int = 3) -> None:
        self.answers: list[dict[str, Any]] = []
        self.refused: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(url,), daemon=True) for _ in range(n)]

    def _loop(self, url: str) -> None:
        c = EngineClient(url, timeout_s=120)
        while not self._stop.is_set():
            try:
                self.answers.append(c.generate(BODY))
            except EngineError as exc:
                self.refused.append(str(exc))
        c.close()

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def _mixed(answers: list[dict[str, Any]]) -> list[str]:
    """Versions whose answers that span no flip differ -- in a token or by more than 1e-4 in a
    logprob (one would have read other weights)."""
    first: dict[str, tuple[list[int], list[float]]] = {}
    mixed = set()
    for a in answers:
        meta = a["meta_info"]
        if "weight_version_spans" in meta:
            continue
        seen = (a["output_ids"], [row[0] for row in meta["output_token_logprobs"]])
        ids, lps = first.setdefault(meta["weight_version"], seen)
        if seen[0] != ids or max(abs(x - y) for x, y in zip(seen[1], lps, strict=True)) > 1e-4:
            mixed.add(meta["weight_version"])
    return sorted(mixed)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flip", ["swap", "copy"])
def test_pause_free_updates_under_load_bit_exact(group: object, tmp_path: Path, flip: str) -> None:
    if not mooncake_available():
        pytest.skip("Mooncake's transfer engine is not installed")
    params = _params(0)
    config = UpdaterConfig(mode="both", bucket_bytes=1 << 18, verify_every=1, flip=flip)
    argv = [*ENGINE, "--transport", "mooncake", "--mooncake-protocol", "tcp"]
    with serve_engine(argv, tmp_path / "engine.log") as url, \
            WeightUpdater(params, spec=SPEC, train=TRAIN, engine_urls=[url], group=group, config=config) as updater:
        with Clients(url) as clients:
            for version in range(1, 5):  # p2p, broadcast, p2p, broadcast
                _step(params, version)
                stats = updater.update(version)
                assert (stats.verified, stats.pause_free, stats.flip) == (True, True, flip), stats
                assert stats.engine_idle_s < stats.update_s
        full: dict[str, torch.Tensor] = {}
        for bucket in updater.full_tensors():
            full.update(bucket)
        client = EngineClient(url)
        try:
            gpu = client.server_info()["device"] != "cpu"  # sglang's checksum hashes per device
            for rank in range(updater.inputs.rollout.tp):
                want = expected_checksums(SPEC, updater.inputs.rollout, rank, full.__getitem__, gpu=gpu)
                got = client.weights_checker("checksum", rank=rank)["checksums"]
                assert compare_checksums(got, want) == [], "the served copy is the trainer's weights, bit for bit"
        finally:
            client.close()
    assert clients.refused == []
    assert [a for a in clients.answers if a["meta_info"]["finish_reason"]["type"] != "length"] == []
    spanning = [a["meta_info"]["weight_version_spans"] for a in clients.answers
                if "weight_version_spans" in a["meta_info"]]
    assert spanning, "no answer spanned a flip"
    order = ["default", "1", "2", "3", "4"]  # the versions in the order they were published
    for spans in spanning:
        assert spans[0][0] == 0
        assert [i for i, _ in spans] == sorted({i for i, _ in spans}), spans
        assert [order.index(v) for _, v in spans] == sorted({order.index(v) for _, v in spans}), spans
    assert _mixed(clients.answers) == []


def _corrupt_shadow(url: str, name: str) -> None:
    """Flip one byte of parameter ``name`` in the shadow engine rank 0's update session writes (a
    shm engine's inbox, copy 0), through the segment its descriptor names."""
    c = EngineClient(url)
    try:
        info = c.transfer_engine_info(0)
    finally:
        c.close()
    ptr = info["weight_copies"][0][name][0]
    region = next(r for r in info["transport_descriptor"]["regions"] if r["addr"] <= ptr < r["addr"] + r["nbytes"])
    with open(f"/dev/shm/{region['handle']}", "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        at = region["handle_offset"] + ptr - region["addr"]
        m[at] ^= 0x01


def _served_digest(url: str) -> str:
    c = EngineClient(url)
    try:
        return c.weights_checker("checksum")["per_engine_checksum"]
    finally:
        c.close()


@pytest.mark.timeout(600)
def test_a_corrupted_shadow_is_refused_and_never_served(group: object, tmp_path: Path) -> None:
    params = _params(1)
    config = UpdaterConfig(mode="p2p", bucket_bytes=1 << 18, verify_every=1)
    name = "model.layers.1.self_attn.o_proj.weight"
    with serve_engine([*ENGINE, "--transport", "shm"], tmp_path / "engine.log") as url, \
            WeightUpdater(params, spec=SPEC, train=TRAIN, engine_urls=[url], group=group, config=config) as updater:
        assert updater.update(1).verified
        served = _served_digest(url)
        real = updater.write

        def write_then_corrupt(mode: Any = "p2p", **kwargs: Any) -> Any:
            out = real(mode, **kwargs)
            _corrupt_shadow(url, name)
            return out

        with Clients(url) as clients:
            _step(params, 2)
            updater.write = write_then_corrupt
            with pytest.raises(UpdateError, match=rf"keep serving their old version.*fingerprints differ: .*rank 0: "
                                                  rf"1 of \d+ tensors differ: {name}"):
                updater.update(2)
            updater.write = real
            state = EngineClient(url).engine_state()
            assert (state["state"], state["weight_version"], state["weights_dirty"]) == ("serving", "1", False)
            assert _served_digest(url) == served, "the served copy is untouched"
            assert updater.update(2).verified, "the next update rewrites the shadow and publishes"
    assert clients.refused == []
    assert {a["meta_info"]["weight_version"] for a in clients.answers} <= {"1", "2"}
    assert _mixed(clients.answers) == [], "no answer was computed with the corrupted byte"
