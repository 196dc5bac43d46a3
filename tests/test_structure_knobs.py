"""Contract: one parser per knob, one meaning, in every command.

* ``--train`` / ``--rollout``: ``run``, ``prepare``, ``plan`` and ``bench`` resolve the same string
  on the same model to the same :class:`TrainParallel` / :class:`RolloutParallel`, each through its
  own resolution function: the model's run profile with the keys given replaced, keys not given
  keep the profile's value, the world size too unless ``world=`` or ``dp=`` is given
  (:func:`weightsync.models.parallel.override_train`). The two measured cases of the old parsers
  are in the table: ``tp=2`` on Qwen3-30B-A3B was world 2 / EP 1 in ``run`` and world 16 / EP 8 in
  ``plan``; ``tp=1,ep=4`` was refused by ``run`` and world 4 in ``prepare``.
* Bad input is refused by every command with the same message, naming the key.
* The bucket size is GiB (2**30 bytes) everywhere: ``BUCKET_SIZE_GB`` of ``run`` and
  ``--bucket-gb`` of ``plan`` and ``bench`` give the same bytes and the same number of broadcast
  buckets (``plan`` multiplied by 1e9: 62 buckets for Qwen3-30B-A3B where ``run`` used 57).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from weightsync.cli import build_parser
from weightsync.models import get_profile
from weightsync.models.parallel import (
    RolloutParallel,
    TrainParallel,
    override_rollout,
    override_train,
    rollout_text,
    train_text,
)


def _args(command: str, *argv: str):
    return build_parser().parse_args([command, *argv])


def _run(model: str, argv: list[str], env: dict[str, str], tmp_path: Path):
    """``run``'s config (its own :func:`~weightsync.cli.run.resolve`)."""
    from weightsync.cli.run import resolve
    from weightsync.launch.config import env_settings

    cfg = resolve(_args("run", model, "--device", "cpu", *argv), env_settings({"CKPT_SAVE_DIR": str(tmp_path), **env}))
    assert cfg is not None
    return cfg


def _bench(model: str, argv: list[str]):
    """``bench``'s config (its own :func:`~weightsync.launch.bench.config.build_config`)."""
    from weightsync.launch.bench.config import build_config

    cfg, _ = build_config(_args("bench", model, *argv))
    return cfg


def _sizes_of_every_command(model: str, scale: str, train: str, rollout: str, tmp_path: Path
                            ) -> dict[str, tuple[TrainParallel, RolloutParallel | None]]:
    from weightsync.cli.plan import resolve_parallel
    from weightsync.cli.prepare import resolve as resolve_prepare

    flags = ["--train", train, "--rollout", rollout]
    run = _run(model, ["--scale", scale, *flags], {}, tmp_path)
    prep = resolve_prepare(_args("prepare", model, "--scale", scale, "--ckpt-dir", str(tmp_path), "--train", train))
    bench = _bench(model, ["--scale", scale, *flags])
    return {
        "run": (run.train, run.rollout),
        "prepare": (prep.train, None),  # prepare writes trainer shards only: no --rollout
        "plan": resolve_parallel(_args("plan", model, "--scale", scale, *flags)),
        "bench": (bench.train, bench.rollout),
    }


SIZE_CASES = [
    # model, scale (the bench builds layouts at it), --train, --rollout, expected train / rollout fields
    pytest.param("Qwen3-30B-A3B", "layers=4", "tp=2", "",
                 {"world_size": 16, "tp": 2, "ep": 8, "dp": 8, "edp": 2}, {"tp": 8, "ep": 8, "num_engines": 2},
                 id="measured-tp2-keeps-world-and-ep"),
    pytest.param("Qwen3-30B-A3B", "layers=4", "tp=1,ep=4", "tp=4,ep=4",
                 {"world_size": 16, "tp": 1, "ep": 4, "dp": 16, "edp": 4}, {"tp": 4, "ep": 4, "num_engines": 2},
                 id="measured-tp1-ep4"),
    pytest.param("Qwen3-4B", "tiny", "tp=1,cp=1,world=1", "tp=1,engines=1",
                 {"world_size": 1, "tp": 1, "cp": 1, "dp": 1}, {"tp": 1, "num_engines": 1}, id="one-rank"),
    pytest.param("Qwen3-4B", "layers=4", "dp=2", "dp=2",
                 {"world_size": 8, "tp": 2, "cp": 2, "dp": 2}, {"tp": 2, "dp": 2, "attn_tp": 1, "num_engines": 2},
                 id="dp-sets-the-world"),
    pytest.param("GLM-4.5-Air", "layers=4", "pp=2", "engines=1",
                 {"world_size": 32, "pp": 2, "pp_last_stage_layers": None, "dp": 16},
                 {"tp": 8, "num_engines": 1}, id="new-pp-drops-the-uneven-split"),
    pytest.param("GLM-4.7-Flash", "layers=4", "tp=2,mla_rep=0", "dp=2",
                 {"world_size": 8, "tp": 2, "ep": 8, "mla_down_proj_replicated": False},
                 {"tp": 4, "dp": 2, "ep": 4, "dp_lm_head": True}, id="mla-rep-and-dp-attention"),
    pytest.param("Kimi-K2", "layers=12", "etp=2,ep=16", "",
                 {"world_size": 256, "tp": 8, "pp": 8, "etp": 2, "ep": 16, "edp": 1, "pp_last_stage_layers": 5,
                  "mla_down_proj_replicated": True}, {"tp": 32, "dp": 8, "ep": 32, "num_engines": 8},
                 id="etp-keeps-pp-and-last"),
]


@pytest.mark.parametrize(("model", "scale", "train", "rollout", "want_train", "want_rollout"), SIZE_CASES)
def test_every_command_resolves_the_same_sizes(model, scale, train, rollout, want_train, want_rollout, tmp_path):
    sizes = _sizes_of_every_command(model, scale, train, rollout, tmp_path)
    trains = {cmd: t for cmd, (t, _) in sizes.items()}
    rollouts = {cmd: r for cmd, (_, r) in sizes.items() if r is not None}
    assert len(set(trains.values())) == 1, trains
    assert len(set(rollouts.values())) == 1, rollouts
    t, r = trains["run"], rollouts["run"]
    assert {k: getattr(t, k) for k in want_train} == want_train
    assert {k: getattr(r, k) for k in want_rollout} == want_rollout
    profile = get_profile(model)
    # keys not given keep the profile's value
    given = {item.split("=")[0] for item in train.split(",") if item}
    kept = {"tp", "pp", "cp", "ep", "etp"} - given
    assert {k: getattr(t, k) for k in kept} == {k: getattr(profile.train, k) for k in kept}
    if not given & {"world", "dp"}:
        assert t.world_size == profile.train.world_size
    assert t.sequence_parallel == profile.train.sequence_parallel
    assert (r.moe_dense_tp, r.dp_lm_head) == (profile.rollout.moe_dense_tp, profile.rollout.dp_lm_head)


@pytest.mark.parametrize(
    ("train", "rollout", "named"),
    [
        pytest.param("tq=2", "", "--train: 'tq=2' is not one of tp=N", id="unknown-key"),
        pytest.param("tp=x", "", "--train: tp must be an integer, got 'x'", id="not-an-integer"),
        pytest.param("tp=2,tp=4", "", "--train: tp is given twice", id="twice"),
        pytest.param("mla_rep=2", "", "--train: mla_rep must be 0 or 1, got 2", id="mla-rep"),
        pytest.param("world=16,dp=2", "", "--train: world=16 disagrees with dp=2 (tp*pp*cp*dp = 8", id="world-vs-dp"),
        pytest.param("tp=3", "", "train world size 16 is not divisible by tp*pp*cp = 3", id="world-not-divisible"),
        pytest.param("", "pp=2", "--rollout: 'pp=2' is not one of tp=N", id="rollout-key"),
        pytest.param("", "tp=2", "rollout tp=2 is not divisible by ep=8", id="rollout-ep-kept"),
    ],
)
def test_every_command_refuses_the_same_way(train, rollout, named, tmp_path):
    """The message names the key; a size error also quotes the layout the keys make (what would run)
    and the profile the keys not given came from."""
    from weightsync.cli.plan import resolve_parallel
    from weightsync.cli.prepare import resolve as resolve_prepare

    model = "Qwen3-30B-A3B"
    flags = ["--train", train, "--rollout", rollout]
    calls = {
        "run": lambda: _run(model, ["--scale", "tiny", *flags], {}, tmp_path),
        "plan": lambda: resolve_parallel(_args("plan", model, *flags)),
        "bench": lambda: _bench(model, flags),
    }
    if train:
        calls["prepare"] = lambda: resolve_prepare(_args("prepare", model, "--scale", "tiny", "--ckpt-dir",
                                                         str(tmp_path), "--train", train))
    for cmd, call in calls.items():
        with pytest.raises(ValueError, match=re.escape(named)) as exc:
            call()
        if "divisible" in named:
            msg = str(exc.value)
            made = "makes the trainer tp=3,pp=" if train else "makes the engines tp=2,ep=8,"
            assert made in msg, (cmd, msg)
            assert "(Qwen3-30B-A3B's run profile tp=" in msg, (cmd, msg)


BASE = TrainParallel(world_size=32, tp=2, pp=4, cp=1, ep=2, etp=1, pp_last_stage_layers=5)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        pytest.param("", BASE, id="empty-is-the-base"),
        pytest.param("tp=4", dataclasses.replace(BASE, tp=4), id="world-kept"),
        pytest.param("pp=4", BASE, id="same-pp-keeps-last"),
        pytest.param("pp=2", dataclasses.replace(BASE, pp=2, pp_last_stage_layers=None), id="new-pp-even-split"),
        pytest.param("pp=2,last=3", dataclasses.replace(BASE, pp=2, pp_last_stage_layers=3), id="new-pp-last"),
        pytest.param("dp=2", dataclasses.replace(BASE, world_size=16), id="dp"),
        pytest.param("tp=1,dp=8,world=32", dataclasses.replace(BASE, tp=1), id="world-and-dp-agree"),
        pytest.param(" etp = 2 , mla_rep=1 ", dataclasses.replace(BASE, etp=2, mla_down_proj_replicated=True),
                     id="spaces"),
    ],
)
def test_override_train_field_by_field(text, want):
    assert override_train(BASE, text) == want


def test_expert_tp_can_follow_tp():
    """Megatron's default (expert TP = TP unless given) is expressible; it is not the default here."""
    assert override_train(BASE, "tp=4").etp == 1
    assert override_train(BASE, "tp=4", etp_follows_tp=True).etp == 4
    assert override_train(BASE, "tp=4,etp=1", etp_follows_tp=True).etp == 1


def test_text_round_trips():
    other = TrainParallel(world_size=1)
    for model in ("Qwen3-4B", "GLM-5", "Kimi-K2"):
        p = get_profile(model)
        assert override_train(other, train_text(p.train)) == p.train
        assert override_rollout(dataclasses.replace(RolloutParallel(), moe_dense_tp=p.rollout.moe_dense_tp,
                                                    dp_lm_head=p.rollout.dp_lm_head),
                                rollout_text(p.rollout)) == p.rollout


BUCKET_MODEL = "Qwen3-30B-A3B"


def _broadcast_buckets(model: str, scale: str, train: TrainParallel, rollout: RolloutParallel, nbytes: int) -> int:
    """Buckets of the broadcast plan the run and the bench build (``RunSession``, the bench's worker)."""
    from weightsync.layout.megatron import trainer_layout
    from weightsync.layout.sglang import engine_layout
    from weightsync.models import get_model
    from weightsync.plan.broadcast import plan_broadcast
    from weightsync.plan.inputs import build_inputs

    inputs = build_inputs(get_model(model, scale), train, rollout, trainer_layout=trainer_layout,
                          engine_layout=engine_layout)
    return len(plan_broadcast(inputs, bucket_bytes=nbytes, dst_rank=0).buckets)


@pytest.mark.parametrize("gb", [None, "0.25"], ids=["default", "quarter"])
def test_bucket_size_is_gib_in_every_command(gb, tmp_path):
    """The measured case: the profile's layout at full scale, where 1e9 and 2**30 bytes differ in
    bucket count."""
    from weightsync.cli.plan import plan_report

    flag = ["--bucket-gb", gb] if gb else []
    report = plan_report(_args("plan", BUCKET_MODEL, "--mode", "broadcast", *flag))
    run = _run(BUCKET_MODEL, ["--scale", "full", "--mode", "broadcast"], {"BUCKET_SIZE_GB": gb} if gb else {},
               tmp_path)
    bench = _bench(BUCKET_MODEL, ["--scale", "full", "--train", "", "--rollout", "", "--mode", "broadcast", *flag])
    want = int(float(gb or 1) * 2**30)
    assert report["bucket_bytes"] == run.bucket_bytes == bench.bucket_bytes == want
    assert (run.train, run.rollout) == (bench.train, bench.rollout) == (get_profile(BUCKET_MODEL).train,
                                                                         get_profile(BUCKET_MODEL).rollout)
    run_buckets = _broadcast_buckets(BUCKET_MODEL, run.scale, run.train, run.rollout, run.bucket_bytes)
    bench_buckets = _broadcast_buckets(BUCKET_MODEL, bench.scale, bench.train, bench.rollout, bench.bucket_bytes)
    assert report["buckets"] == run_buckets == bench_buckets
    decimal = _broadcast_buckets(BUCKET_MODEL, "full", run.train, run.rollout, int(float(gb or 1) * 1e9))
    assert decimal != run_buckets, "the case must tell the two units apart"


@pytest.mark.parametrize("value", ["lots", "0", "-1", "nan", "1e-12"])
def test_bad_bucket_sizes_are_refused_naming_the_knob(value, tmp_path):
    from weightsync.cli.plan import plan_report

    with pytest.raises(ValueError, match=r"BUCKET_SIZE_GB must be a .*number of GiB"):
        _run("Qwen3-4B", [], {"BUCKET_SIZE_GB": value}, tmp_path)
    if value != "lots":  # argparse refuses a non-number flag itself
        with pytest.raises(ValueError, match="--bucket-gb must be a positive number of GiB"):
            plan_report(_args("plan", "Qwen3-4B", "--mode", "broadcast", "--scale", "tiny", "--train",
                              "tp=1,cp=1,world=1", "--rollout", "tp=1", "--bucket-gb", value))
        with pytest.raises(ValueError, match="--bucket-gb must be a positive number of GiB"):
            _bench("Qwen3-4B", ["--bucket-gb", value])


def test_mode_strings_are_the_cli_strings():
    """``--mode`` takes Mode's own strings in every command (``plan``: the transfer modes only)."""
    from weightsync.plan.records import Mode

    def choices(command: str) -> list[str] | None:
        sub = next(a for a in build_parser()._subparsers._group_actions if command in a.choices)
        return next(a.choices for a in sub.choices[command]._actions if "--mode" in a.option_strings)

    assert list(choices("bench")) == [m.value for m in Mode]
    assert list(choices("plan")) == [m.value for m in Mode.BOTH.transfers]
    assert Mode.parse(_args("run", "Qwen3-4B", "--mode", "both").mode) is Mode.BOTH
    with pytest.raises(ValueError, match="unknown mode 'p3p': use p2p, broadcast, both"):
        Mode.parse("p3p")
