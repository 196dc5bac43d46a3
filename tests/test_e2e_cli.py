"""End to end through the command line: the documented wrappers, the environment variables, and
bad input.

Contracts:

* ``bash Qwen3-4B.sh p2p`` and ``... broadcast`` (the reference document's commands) prepare when
  the checkpoint is missing, run the embedded default, pass every gate (check-weight-update-equal
  on the first update, so broadcast's first update is checked too; checksums and logprob parity
  on every update), and write ``results.json`` with the bytes each engine rank received; arguments
  after MODE reach ``run`` (the wrappers' usage and argument checks: ``tests/test_e2e_wrappers.py``).
* ``SKIP_VALIDATION=1``: the engines start from dummy weights, the equality check is skipped (and
  step 0's line says so), and checksums pass from the first update on (here over Mooncake tcp,
  forced by the flag).
* Bad input stops the run with a message naming it and without a traceback: unknown model or
  mode or a bad environment value (exit 2, nothing started); an unreachable engine, or an engine
  serving another model or layout (exit 1, before any byte is written: the engine's weights and
  version are unchanged).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e_helpers import (
    PYTHON,
    REPO_ROOT,
    RunOutcome,
    assert_bytes_exact,
    assert_run_passed,
    e2e_ckpt_fixture,  # noqa: F401 -- the e2e_ckpt fixture
    model_bytes,
    run_cli,
    run_command,
    serve_engine,
)
from weightsync.launch.config import RunConfig
from weightsync.proc import free_port

pytestmark = pytest.mark.timeout(600)

EXAMPLES = REPO_ROOT / "examples" / "infra_features" / "p2p_weight_transfer"


def _no_traceback(run: RunOutcome) -> None:
    assert "Traceback" not in run.output, run.describe()


# -- the documented wrappers ----------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "extra", "updates"), [
    pytest.param("p2p", [], 4, id="p2p"),  # the first update, then --num-rollout's default 3
    pytest.param("broadcast", ["--num-rollout", "1"], 2, id="broadcast-extra-args"),  # RUN_ARGS reach run
])
def test_qwen3_4b_wrapper(mode: str, extra: list[str], updates: int, e2e_ckpt: Path, tmp_path: Path):
    run = run_command(["bash", str(EXAMPLES / "Qwen3-4B.sh"), mode, *extra], ckpt_dir=e2e_ckpt, log_dir=tmp_path)
    assert_run_passed(run, modes=[mode] * updates)
    assert "validation passed" in run.output
    assert run.meta["embedded_default"]
    assert (run.meta["train"]["tp"], run.meta["rollout"]["tp"]) == (2, 2)
    assert_bytes_exact(run, model_bytes("Qwen3-4B"))


def test_run_py_list(tmp_path: Path):
    run = run_command([PYTHON, str(EXAMPLES / "run.py"), "list"], ckpt_dir=tmp_path, log_dir=tmp_path, timeout_s=60)
    assert run.returncode == 0, run.describe()
    for model in ("Qwen3-4B", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "GLM-4.5-Air", "GLM-4.7-Flash", "Kimi-K2",
                  "GLM-5", "GLM-5_4layer", "GLM-5_20layer"):
        assert f"\n{model} " in run.output, model


# -- environment variables ------------------------------------------------------------------------


def test_skip_validation_over_mooncake(e2e_ckpt: Path, tmp_path: Path):
    run = run_cli(["run", "GLM-4.7-Flash", "--mode", "p2p", "--num-rollout", "1", "--transport", "mooncake"],
                  ckpt_dir=e2e_ckpt, log_dir=tmp_path, env={"SKIP_VALIDATION": "1"})
    assert_run_passed(run, modes=["p2p", "p2p"], equal_check="skipped")
    step0 = next(line for line in run.output.splitlines() if line.startswith("step 0: "))
    assert "validation skipped (check_weight_update_equal; SKIP_VALIDATION=1)" in step0, step0
    assert run.meta["transport"] == "mooncake"
    assert run.meta["engine_weights"] == ["dummy:GLM-4.7-Flash"]
    assert_bytes_exact(run, model_bytes("GLM-4.7-Flash"))


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        pytest.param(["NoSuchModel"], "unknown model 'NoSuchModel'", id="model"),
        pytest.param(["Qwen3-4B", "--mode", "p3p"], "unknown mode 'p3p'", id="mode"),
    ],
)
def test_bad_input_exits_2_naming_it(argv: list[str], named: str, tmp_path: Path):
    run = run_cli(["run", *argv], ckpt_dir=tmp_path / "ckpt", log_dir=tmp_path / "logs", timeout_s=120)
    assert run.returncode == 2, run.describe()
    assert named in run.output
    _no_traceback(run)
    assert not (tmp_path / "ckpt").exists(), "nothing may be prepared for refused input"


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        pytest.param(["Qwen3-4B"], {"BUCKET_SIZE_GB": "lots"}, "BUCKET_SIZE_GB", id="bucket-size"),
        pytest.param(["Qwen3-4B"], {"SKIP_VALIDATION": "yes"}, "SKIP_VALIDATION", id="skip-validation"),
        pytest.param(["Qwen3-4B", "--rollout", "tp=2,pp=2"], {}, "--rollout: 'pp=2'", id="layout-key"),
    ],
)
def test_bad_values_are_refused_by_resolve(argv: list[str], env: dict[str, str], named: str, tmp_path: Path):
    """The same refusals ``main`` turns into exit 2 (checked once above), without a process each."""
    with pytest.raises(ValueError, match=re.escape(named)):
        _resolve(argv, env, tmp_path)


def test_engine_urls_set_the_engine_count(tmp_path: Path):
    cfg = _resolve(["Qwen3-4B", "--engine-urls", "http://127.0.0.1:1/,http://127.0.0.1:2"], {}, tmp_path)
    assert cfg.engine_urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert cfg.rollout.num_engines == 2


def _resolve(argv: list[str], env: dict[str, str], tmp_path: Path) -> RunConfig:
    from weightsync.cli import build_parser
    from weightsync.cli.run import resolve
    from weightsync.launch.config import env_settings

    cfg = resolve(build_parser().parse_args(["run", *argv]), env_settings({"CKPT_SAVE_DIR": str(tmp_path), **env}))
    assert cfg is not None
    return cfg


@pytest.fixture(scope="module")
def qwen_engine(e2e_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One running engine: Qwen3-4B tiny, TP 1, shm, loaded from the shared prepared checkpoint."""
    from weightsync.sources.prepare import ensure_prepared

    hf_dir, _ = ensure_prepared("Qwen3-4B", scale="tiny", ckpt_dir=e2e_ckpt, progress=False)
    argv = ["Qwen3-4B", "--scale", "tiny", "--tp", "1", "--transport", "shm", "--checkpoint", str(hf_dir)]
    with serve_engine(argv, tmp_path_factory.mktemp("engine") / "engine.log") as url:
        yield url


def _engine_state(url: str) -> tuple[str, dict[str, str]]:
    from weightsync.sync.engine_client import EngineClient

    client = EngineClient(url)
    try:
        return client.get_weight_version(), client.weights_checker("checksum", rank=0)["checksums"]
    finally:
        client.close()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        # the embedded default of Qwen3-4B needs an engine of TP 2
        pytest.param(["Qwen3-4B"], "tp_size=1 (this run needs 2)", id="another-layout"),
        pytest.param(["Qwen3-30B-A3B", "--train", "tp=1,ep=1,world=1", "--rollout", "tp=1,ep=1"],
                     "is a Qwen3ForCausalLM (qwen3 family); Qwen3-30B-A3B serves Qwen3MoeForCausalLM",
                     id="another-model"),
    ],
)
def test_mismatched_engine_is_refused_before_any_byte(argv: list[str], named: str, qwen_engine: str, e2e_ckpt: Path,
                                                      tmp_path: Path):
    before = _engine_state(qwen_engine)
    run = run_cli(["run", *argv, "--num-rollout", "1", "--engine-urls", qwen_engine], ckpt_dir=e2e_ckpt,
                  log_dir=tmp_path)
    assert run.returncode == 1, run.describe()
    assert named in run.output
    assert qwen_engine in run.output
    _no_traceback(run)
    assert _engine_state(qwen_engine) == before, "the refused run changed the engine"


def test_unreachable_engine(e2e_ckpt: Path, tmp_path: Path):
    """Exit 1 naming the engine; the run's log directory holds only the whole error (the message
    points at it), nothing empty is left behind."""
    url = f"http://127.0.0.1:{free_port()}"
    run = run_cli(["run", "Qwen3-4B", "--train", "tp=1,cp=1,world=1", "--rollout", "tp=1", "--num-rollout", "1",
                   "--engine-urls", url], ckpt_dir=e2e_ckpt, log_dir=tmp_path / "logs" / "run")
    assert run.returncode == 1, run.describe()
    assert f"{url}/server_info: engine unreachable" in run.output
    _no_traceback(run)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "logs").rglob("*"))
    assert left in ([], ["logs/run", "logs/run/error.log"]), left
    if left:
        assert f"{tmp_path / 'logs' / 'run' / 'error.log'}" in run.output


def test_run_updates_an_attached_engine(qwen_engine: str, e2e_ckpt: Path, tmp_path: Path):
    """``--engine-urls``: the run updates an engine it did not start, and leaves it serving."""
    run = run_cli(["run", "Qwen3-4B", "--train", "tp=1,cp=1,world=1", "--rollout", "tp=1", "--mode", "both",
                   "--num-rollout", "1", "--engine-urls", qwen_engine], ckpt_dir=e2e_ckpt, log_dir=tmp_path)
    assert_run_passed(run, modes=["p2p", "broadcast"])
    assert_bytes_exact(run, model_bytes("Qwen3-4B"))
    version, _ = _engine_state(qwen_engine)
    assert version == "1"
