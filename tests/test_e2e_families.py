"""End to end on CPU: every family at tiny scale, both modes, through ``resolve`` + ``RunSession``.

Contract of every run here (issue 5, "Must show"): the engines start from the prepared
checkpoint; update 0 is p2p and runs check-weight-update-equal (snapshot, reset to random
values, update, compare bit for bit); update 1 is broadcast on the same engines and trainer
ranks; after every update the per-tensor checksums of every engine rank equal the trainer's
weights and the engine's prompt logprobs equal a reference forward of them; ``results.json`` is
written, and in it p2p gives each engine rank exactly its shard's bytes while broadcast gives
each the full model.

Layouts are the embedded defaults (trainer TP 2 / EP 2 for MoE families -> engine TP 2 / EP 2,
DP-attention 2 where the profile uses DP-attention), plus two engines updated in one step and
p2p over Mooncake tcp. Qwen3-4B in each mode on its own is covered by the wrapper tests
(tests/test_e2e_cli.py), broadcast's check-weight-update-equal there too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e_helpers import (
    assert_bytes_exact,
    assert_run_passed,
    e2e_ckpt_fixture,  # noqa: F401 -- the e2e_ckpt fixture
    model_bytes,
    run_in_process,
)

pytestmark = pytest.mark.timeout(600)

FAMILIES = [
    # (model, expected rollout ep, expected DP-attention size, extra environment)
    pytest.param("Qwen3-30B-A3B", 2, 1, {}, id="Qwen3-30B-A3B-moe"),
    pytest.param("GLM-4.5-Air", 2, 1, {}, id="GLM-4.5-Air-moe"),
    pytest.param("GLM-4.7-Flash", 2, 1, {}, id="GLM-4.7-Flash-mla"),
    # fp8 weights: p2p quantizes into staging buckets; a tiny BUCKET_SIZE_GB makes many of them,
    # and many broadcast buckets.
    pytest.param("Kimi-K2", 2, 2, {"BUCKET_SIZE_GB": "0.00001"}, id="Kimi-K2-fp8-dpattn-smallbuckets"),
    pytest.param("GLM-5", 2, 2, {}, id="GLM-5-indexer-dpattn"),
]


@pytest.mark.parametrize(("model", "ep", "dp", "env"), FAMILIES)
def test_family_both_modes(model: str, ep: int, dp: int, env: dict[str, str], e2e_ckpt: Path, tmp_path: Path):
    run = run_in_process([model, "--mode", "both", "--num-rollout", "1"], ckpt_dir=e2e_ckpt, log_dir=tmp_path,
                         env=env)
    assert_run_passed(run, modes=["p2p", "broadcast"])
    meta = run.meta
    assert meta["embedded_default"]
    assert meta["transport"] == "shm"
    assert (meta["train"]["tp"], meta["train"]["ep"]) == (2, ep)
    assert (meta["rollout"]["tp"], meta["rollout"]["ep"], meta["rollout"]["dp"]) == (2, ep, dp)
    assert_bytes_exact(run, model_bytes(model))
    if "BUCKET_SIZE_GB" in env:
        assert meta["bucket_bytes"] == int(float(env["BUCKET_SIZE_GB"]) * (1 << 30))
        p2p, bcast = run.steps
        assert p2p["buckets"] >= 10, p2p["buckets"]  # fp8 quantized in many staging buckets
        assert bcast["buckets"] >= 10, bcast["buckets"]


def test_two_engines_over_mooncake(e2e_ckpt: Path, tmp_path: Path):
    """Two engines of TP 2 updated in one step from trainer TP 2, p2p over Mooncake tcp (forced
    by the flag), then broadcast to all four rollout ranks."""
    run = run_in_process(["Qwen3-4B", "--mode", "both", "--num-rollout", "1", "--train", "tp=2,cp=1,world=2",
                          "--rollout", "tp=2,engines=2", "--transport", "mooncake"],
                         ckpt_dir=e2e_ckpt, log_dir=tmp_path)
    assert_run_passed(run, modes=["p2p", "broadcast"])
    assert run.meta["transport"] == "mooncake"
    assert run.meta["rollout"]["num_engines"] == 2
    assert sorted(run.meta["dest_bytes_per_receiver"]) == ["0", "1", "2", "3"]
    assert_bytes_exact(run, model_bytes("Qwen3-4B"))
