"""Bad input is refused before any process starts: one line naming the value and what to do, exit 2
(``run`` and ``serve``);
``prepare`` verifies a checkpoint's files before it trusts its own marker.

The run cases call the CLI's ``main`` in this process (what ``weightsync run`` runs) and check
that it started nothing (no child process, no log directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weightsync.cli import main
from weightsync.sources.prepare import ensure_prepared


def _children() -> set[int]:
    out: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        out |= {int(x) for x in (task / "children").read_text().split()}
    return out


@pytest.mark.parametrize(("argv", "env", "named"), [
    pytest.param([], {"BUCKET_SIZE_GB": "inf"}, "BUCKET_SIZE_GB must be a positive number of GiB", id="bucket-inf"),
    pytest.param([], {"BUCKET_SIZE_GB": "1e-12"}, "got '1e-12'", id="bucket-below-a-byte"),
    pytest.param([], {"BUCKET_SIZE_GB": "1e300"}, "BUCKET_SIZE_GB must be at most 1024 GiB", id="bucket-1e300"),
    pytest.param(["--transport", "cuda_ipc"], {}, "--transport cuda_ipc moves GPU memory", id="cuda-ipc-on-cpu"),
    pytest.param(["--prompts-per-step", "0"], {}, "--prompts-per-step must be >= 1", id="prompts-0"),
    pytest.param(["--max-new-tokens", "-1"], {}, "--max-new-tokens must be >= 1", id="max-new-tokens-negative"),
    pytest.param(["--rollout", "tp=3"], {}, "--rollout: Qwen3-4B: 4 attention heads are not divisible by "
                 "attention-TP 3", id="rollout-tp3"),
    pytest.param(["--update-retries", "-1"], {}, "--update-retries must be >= 0", id="retries-negative"),
    pytest.param(["--deadlines", "write=0"], {}, "deadline write must be a positive number of seconds",
                 id="deadline-zero"),
    pytest.param(["--deadlines", "wirte=5"], {}, "'wirte=5' is not KEY=SECONDS with KEY one of engine_start",
                 id="deadline-unknown"),
    pytest.param([], {"MILES_LOG_DIR": "{file}"}, "MILES_LOG_DIR {file} is a file; point it at a directory",
                 id="log-dir-is-a-file"),
    pytest.param([], {"MILES_LOG_DIR": "{file}/logs"}, "cannot be created: {file} is a file",
                 id="log-dir-under-a-file"),
    pytest.param([], {"CKPT_SAVE_DIR": "{file}"}, "CKPT_SAVE_DIR {file} is a file, not a directory",
                 id="ckpt-dir-is-a-file"),
])
def test_bad_run_input_is_one_line_and_exit_2(argv: list[str], env: dict[str, str], named: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    monkeypatch.chdir(tmp_path)  # the default log directory would be created here
    monkeypatch.setenv("CKPT_SAVE_DIR", str(tmp_path / "ckpt"))
    monkeypatch.delenv("MILES_LOG_DIR", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(file=a_file))
    before = _children()
    assert main(["run", "Qwen3-4B", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("weightsync run: "), err
    assert "\n" not in err, err
    assert named.format(file=a_file) in err, err
    assert _children() == before, "a process was started"
    assert not (tmp_path / "logs").exists()
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(("argv", "env", "named"), [
    pytest.param([], {"CKPT_SAVE_DIR": "{file}"}, "CKPT_SAVE_DIR {file} is a file; point it at a directory",
                 id="env-is-a-file"),
    pytest.param([], {"CKPT_SAVE_DIR": "{file}/sub"}, "CKPT_SAVE_DIR {file}/sub cannot be created: {file} is a file",
                 id="env-under-a-file"),
    pytest.param(["--ckpt-dir", "{file}/sub/deeper"], {}, "--ckpt-dir {file}/sub/deeper cannot be created: {file} is "
                 "a file", id="flag-under-a-file"),
    # /proc takes no new files, even from root: a directory that exists and cannot be written
    pytest.param([], {"CKPT_SAVE_DIR": "/proc/weightsync-ckpt"}, "CKPT_SAVE_DIR /proc/weightsync-ckpt: cannot write "
                 "into /proc", id="unwritable-parent"),
])
def test_prepare_refuses_a_checkpoint_dir_it_cannot_write_in_one_line(
        argv: list[str], env: dict[str, str], named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]):
    """``prepare`` refuses as ``run`` does: one line naming the directory, exit 2, nothing written."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(file=a_file))
    assert main(["prepare", "Qwen3-4B", "--no-progress", *(a.format(file=a_file) for a in argv)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("weightsync prepare: "), err
    assert "\n" not in err.strip(), err
    assert named.format(file=a_file) in err, err
    assert out == "", "refused before anything is decided or written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_run_that_fails_leaves_no_empty_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]):
    """The log directory is made before the run prepares its checkpoint; when the run fails (here:
    no checkpoint at full scale, and a run never downloads), it and the parents it made are gone."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPT_SAVE_DIR", str(tmp_path / "ckpt"))
    monkeypatch.delenv("MILES_LOG_DIR", raising=False)
    assert main(["run", "Qwen3-4B", "--scale", "full"]) == 2
    assert "no checkpoint of Qwen3-4B" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()
    monkeypatch.setenv("MILES_LOG_DIR", str(tmp_path / "kept" / "a" / "b"))
    (tmp_path / "kept").mkdir()
    assert main(["run", "Qwen3-4B", "--scale", "full"]) == 2
    assert list((tmp_path / "kept").iterdir()) == [], "the directories the run made are removed, not the others"


SERVE = ["serve", "Qwen3-4B", "--scale", "tiny", "--load-format", "dummy"]


@pytest.mark.parametrize(("argv", "named"), [
    pytest.param(["--compute-dtype", "foo"], "invalid choice: 'foo'", id="compute-dtype-foo"),
    pytest.param(["--compute-dtype", "Tensor"], "invalid choice: 'Tensor'", id="compute-dtype-Tensor"),
    pytest.param(["--port", "99999"], "port must be in 1..65535, got 99999", id="port-99999"),
    pytest.param(["--group-timeout-s", "inf"], "group_timeout_s must be a positive finite number, got inf",
                 id="group-timeout-inf"),
    pytest.param(["--live-check-interval-s", "nan"], "live_check_interval_s must be >= 0", id="live-check-nan"),
])
def test_bad_serve_input_is_refused_before_anything_starts(argv: list[str], named: str,
                                                          capsys: pytest.CaptureFixture[str]):
    """Values that gave a traceback (``--compute-dtype foo``, ``--port 99999``) or started an engine
    that cannot work (``--compute-dtype Tensor``, ``--group-timeout-s inf``): exit 2, the value named,
    no traceback, no process."""
    before = _children()
    try:
        code = main([*SERVE, *argv])
    except SystemExit as exc:  # argparse's own refusal (a bad choice): usage and one error line
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert named in err, err
    assert "Traceback" not in err
    assert _children() == before, "a process was started"


def _truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def test_prepare_redoes_a_truncated_output_instead_of_trusting_its_marker(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]):
    hf, _ = ensure_prepared("Qwen3-4B", scale="tiny", ckpt_dir=tmp_path, progress=False)
    capsys.readouterr()
    files = sorted(hf.glob("*.safetensors"))
    whole = files[0].read_bytes()
    _truncate(files[0], len(whole) - 100)
    ensure_prepared("Qwen3-4B", scale="tiny", ckpt_dir=tmp_path, progress=False)
    out = capsys.readouterr().out
    assert "HF checkpoint" in out
    assert "complete, skipped" not in out.split("HF checkpoint")[1].splitlines()[0], out
    assert files[0].read_bytes() == whole  # written again, the same seeded weights


def test_a_truncated_given_checkpoint_is_refused_naming_the_file(tmp_path: Path):
    hf, _ = ensure_prepared("Qwen3-4B", scale="tiny", ckpt_dir=tmp_path / "a", progress=False)
    given = tmp_path / "given"
    given.mkdir()
    for f in hf.iterdir():
        if f.is_file() and not f.name.startswith("."):
            (given / f.name).write_bytes(f.read_bytes())
    victim = sorted(given.glob("*.safetensors"))[0]
    _truncate(victim, victim.stat().st_size // 2)
    with pytest.raises(ValueError, match=rf"{victim.name}: .*(truncated|header)"):
        ensure_prepared("Qwen3-4B", scale="tiny", ckpt_dir=tmp_path / "b", progress=False, hf_checkpoint=given)


def test_a_config_json_of_another_model_is_refused(tmp_path: Path):
    hf, _ = ensure_prepared("Qwen3-4B", scale="tiny", ckpt_dir=tmp_path / "a", progress=False)
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM"):
        ensure_prepared("Qwen3-30B-A3B", scale="tiny", ckpt_dir=tmp_path / "b", progress=False, hf_checkpoint=hf)
