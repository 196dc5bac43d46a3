"""Contract: the engines' token is passed explicitly, never picked up from the environment.

One ``weightsync serve`` engine started with ``--token-file`` (Qwen3-4B tiny, TP 2, shm, dummy
weights) and one trainer rank in this process:

* an updater built without the token is refused at construction, the error naming the engine and
  HTTP 401 -- even with ``WEIGHTSYNC_TOKEN`` set to the right token in this process's environment
  (the library reads no environment variable);
* one built with another token is refused naming HTTP 403;
* one built with ``UpdaterConfig(token=...)`` updates the engine, verified in both modes; the
  token does not appear in the config's repr;
* ``examples/api/update_engines.py --token-file FILE`` updates the same engine (the README's way
  to pass a token from a script).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import test_sync_updater_engine as base
from tests.e2e_helpers import REPO_ROOT, serve_engine
from weightsync import UpdateError, UpdaterConfig, WeightUpdater

group = base.group  # the fixture: a gloo group of this one trainer rank
TOKEN = "tok-" + "7f3a" * 8


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[str]:
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with serve_engine([*base.ENGINE_ARGV, "--token-file", str(token_file)], log) as url:
        yield url


def _updater(url: str, group: object, token: str | None) -> WeightUpdater:
    config = UpdaterConfig(mode="both", bucket_bytes=1 << 18, verify_every=1, token=token)
    return WeightUpdater(base.te_named_params(0), spec=base.SPEC, train=base.TRAIN, engine_urls=[url], group=group,
                         config=config)


@pytest.mark.timeout(240)
def test_an_updater_needs_the_engines_token(engine: str, group: object, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", TOKEN)  # ambient: must not be picked up
    with pytest.raises(UpdateError, match=rf"engine 0 at {engine}: .*HTTP 401"):
        _updater(engine, group, None)
    with pytest.raises(UpdateError, match=rf"engine 0 at {engine}: .*HTTP 403"):
        _updater(engine, group, "tok-" + "0" * 32)
    config = UpdaterConfig(token=TOKEN)
    assert TOKEN not in repr(config)
    params = base.te_named_params(1)
    with WeightUpdater(params, spec=base.SPEC, train=base.TRAIN, engine_urls=[engine], group=group,
                       config=UpdaterConfig(mode="both", bucket_bytes=1 << 18, verify_every=1, token=TOKEN)) as updater:
        for version in (1, 2):  # p2p, then broadcast
            base._step(params, version)
            stats = updater.update(version)
            assert stats.verified, stats
            assert stats.mode == ("p2p" if version == 1 else "broadcast")


@pytest.mark.timeout(240)
def test_the_example_script_passes_a_token_file(engine: str, token_file: Path):
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_TOKEN"}
    argv = [sys.executable, "examples/api/update_engines.py", "--engine-url", engine, "--steps", "2"]
    refused = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert refused.returncode != 0
    assert "HTTP 401" in refused.stderr, refused.stderr[-2000:]
    proc = subprocess.run([*argv, "--token-file", str(token_file)], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=200, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2, proc.stdout
    assert all(line.endswith("verified=True") for line in lines), proc.stdout
