"""``weightsync plan``: its surface, its JSON report, its refusals, and every registry model at
full size with its reference profile, in both modes (verified, and for p2p bytes_total ==
dest_bytes)."""

from __future__ import annotations

import json

import pytest

from weightsync.cli import build_parser, main
from weightsync.models import list_models

REQUIRED_KEYS = {"model", "mode", "scale", "train", "rollout", "ops", "bytes_total", "dest_bytes", "max_sender_bytes",
                 "max_receiver_bytes", "verified", "plan_seconds"}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_cli_surface_is_pinned():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    plan = sub.choices["plan"]
    options = sorted(s for a in plan._actions for s in a.option_strings)
    assert options == sorted(["-h", "--help", "--mode", "--scale", "--train", "--rollout", "--verify", "--json",
                              "--bucket-gb", "--cache-dir", "--save", "--simulate"])


@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
def test_json_report_has_the_documented_keys(capsys, mode):
    rc, out, _ = _run(capsys, "Qwen3-4B", "--mode", mode, "--scale", "tiny", "--train", "tp=2,cp=1,world=2",
                      "--rollout", "tp=4,engines=1", "--verify", "--json")
    assert rc == 0
    report = json.loads(out)
    assert set(report) >= REQUIRED_KEYS
    assert report["verified"] is True
    assert report["train"]["tp"] == 2
    assert report["rollout"]["tp"] == 4
    if mode == "p2p":
        assert report["bytes_total"] == report["dest_bytes"]
    else:
        assert report["bytes_total"] == report["max_receiver_bytes"] * report["rollout"]["world_size"]


def test_table_output_and_cache(capsys, tmp_path):
    argv = ["Qwen3-4B", "--scale", "tiny", "--train", "tp=2,cp=1,world=2", "--rollout", "tp=2",
            "--cache-dir", str(tmp_path), "--save", str(tmp_path / "plan.npz")]
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0
    for row in ("ops", "bytes on links", "destination bytes", "max per sender", "verified", "plan time"):
        assert row in out
    assert (tmp_path / "plan.npz").exists()
    rc, out, _ = _run(capsys, *argv, "--json")
    assert json.loads(out)["cache_hit"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["Nope"], "unknown model", id="unknown-model"),
        pytest.param(["Qwen3-4B", "--train", "tq=2"], "--train: 'tq=2' is not one of", id="bad-key"),
        pytest.param(["Qwen3-4B", "--train", "tp=3"], "not divisible", id="gpu-count"),
        pytest.param(["Qwen3-4B", "--scale", "tiny", "--train", "tp=1,cp=1,world=1", "--rollout", "tp=8"],
                     "heads", id="heads-not-divisible"),
        pytest.param(["Qwen3-30B-A3B", "--scale", "tiny", "--train", "tp=1,ep=3,world=3"], "experts",
                     id="experts-not-divisible"),
    ],
)
def test_impossible_configurations_are_refused(capsys, argv, message):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2
    assert message in err


KIMI_TINY = ["Kimi-K2", "--scale", "tiny", "--rollout", "tp=2,ep=2,dp=2,engines=1", "--verify", "--json"]


def test_mla_rep_key_keeps_fp8_blocks_whole(capsys):
    """``--train mla_rep=0|1``: Kimi-K2 tiny at train TP 2 cuts fp8 blocks with the local spec's
    split down projections and verifies with the TE spec's duplicated ones (the profile's)."""
    rc, out, err = _run(capsys, *KIMI_TINY, "--train", "tp=2,ep=2,pp=1,cp=1,world=2,mla_rep=0")
    assert rc != 0
    assert "kv_a_proj_with_mqa" in err
    rc, out, err = _run(capsys, *KIMI_TINY, "--train", "tp=2,ep=2,pp=1,cp=1,world=2,mla_rep=1")
    assert rc == 0, err
    report = json.loads(out)
    assert report["train"]["mla_down_proj_replicated"] is True
    assert report["verified"] is True
    assert report["bytes_total"] == report["dest_bytes"]
    rc, out, err = _run(capsys, *KIMI_TINY, "--train", "tp=2,ep=2,pp=1,cp=1,world=2")  # the profile's setting
    assert rc == 0, err
    assert json.loads(out)["train"]["mla_down_proj_replicated"] is True
    rc, _, err = _run(capsys, *KIMI_TINY, "--train", "mla_rep=2")
    assert rc == 2
    assert "mla_rep must be 0 or 1" in err


FULL = [m for m in list_models() if m != "Kimi-K2"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
@pytest.mark.parametrize("model", FULL)
def test_every_registry_model_verifies_at_full_size(capsys, model, mode):
    rc, out, err = _run(capsys, model, "--mode", mode, "--verify", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["verified"] is True
    if mode == "p2p":
        assert report["bytes_total"] == report["dest_bytes"]
        assert report["senders"] == report["train"]["world_size"]  # every trainer rank sends


@pytest.mark.timeout(900)
def test_kimi_k2_broadcast_verifies_at_full_size(capsys):
    rc, out, err = _run(capsys, "Kimi-K2", "--mode", "broadcast", "--verify", "--json")
    assert rc == 0, err
    assert json.loads(out)["verified"] is True


@pytest.mark.timeout(900)
def test_kimi_k2_p2p_verifies_at_full_size(capsys):
    """The profile keeps the MLA down projections whole on every TP rank (the reference's TE spec),
    so TP 8 cuts no [64, 64] fp8 block of kv_a_proj_with_mqa (576 rows)."""
    rc, out, err = _run(capsys, "Kimi-K2", "--mode", "p2p", "--verify", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["train"]["mla_down_proj_replicated"] is True
    assert report["verified"] is True
    assert report["bytes_total"] == report["dest_bytes"]
    assert report["senders"] == 256
