"""The command's help, as a user reads it (contract):

* ``weightsync --help`` says what weightsync is and what each command does, in a user's words
  (no developer notes), and how to start;
* ``weightsync COMMAND --help`` has a description, every option's help with its choices and its
  default, the environment variables the command reads (or that it reads none) and examples of
  that command;
* every variable a command's help names is in README.md's environment section.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from weightsync.cli import SUBCOMMANDS, build_parser, main
from weightsync.cli.usage import ENVIRONMENT, USAGE

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_top_level_help_is_for_users(capsys: pytest.CaptureFixture[str]):
    out = _help([], capsys)
    assert "moves updated model weights from a Megatron training job into live rollout engines" in _flat(out)
    assert "weightsync run Qwen3-4B" in out
    assert "weightsync COMMAND --help" in out
    for name in SUBCOMMANDS:
        assert re.search(rf"^\s+{name}\s+{re.escape(USAGE[name].summary.split()[0])}", out, re.M), (name, out)
    assert not any(dev in out for dev in ("argparse", "``", "sub-command modules")), out


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_each_command_says_what_it_does_reads_and_an_example(name: str, capsys: pytest.CaptureFixture[str]):
    out = _help([name], capsys)
    u = USAGE[name]
    assert _flat(u.description) in _flat(out)
    env = out.split("environment variables:")[1].split("examples:")[0]
    if u.environment:
        assert all(re.search(rf"^\s+{v}\s+\S", env, re.M) for v in u.environment), env
    else:
        assert env.strip() == "none"
    examples = [line.strip() for line in out.split("examples:")[1].splitlines() if line.strip()]
    assert examples, out
    assert all(re.match(rf"^(\w+=\S+ )*weightsync {name}\b", e) for e in examples), examples


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_option_has_help_and_shows_its_default(name: str):
    parser = _subparsers()[name]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        assert action.help, f"{name} {action.option_strings[0]} has no help"
        text = formatter._get_help_string(action) or ""
        if action.default not in (None, False, ""):
            assert "default" in text.lower(), f"{name} {action.option_strings[0]}: {text!r}"


def test_run_help_shows_modes_defaults_and_variables(capsys: pytest.CaptureFixture[str]):
    out = _flat(_help(["run"], capsys))
    assert "--mode {p2p,broadcast,both}" in out
    assert "training steps, each followed by an update (default: 3)" in out
    assert "tokens generated per sample (default: 8)" in out
    assert "--placement {split,colocated}" in out
    for var in ("CKPT_SAVE_DIR", "SKIP_VALIDATION", "BUCKET_SIZE_GB", "MILES_LOG_DIR", "WEIGHTSYNC_TOKEN"):
        assert f"{var} {ENVIRONMENT[var]}" in out, var
    assert "embedded default" in out


def test_every_variable_the_help_names_is_in_the_readme():
    named = {v for u in USAGE.values() for v in u.environment}
    assert named <= set(ENVIRONMENT)
    section = README.split("## Environment variables")[1].split("\n## ")[0]
    assert all(f"`{v}`" in section for v in sorted(named)), sorted(v for v in named if f"`{v}`" not in section)
