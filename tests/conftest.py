"""Suite-wide pytest set-up: markers, hypothesis profiles and a few shared fixtures.

Markers (declared in pyproject.toml, ``--strict-markers`` is on):

* ``gpu``  -- needs CUDA; skipped unless ``torch.cuda.is_available()``.
* ``slow`` -- more than ~30 s on the 2-core CI machine; ``-m "not slow"`` deselects them.

The default per-test timeout (pytest-timeout) is set in pyproject.toml; override it per test with
``@pytest.mark.timeout(N)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from weightsync import proc

REPO_ROOT = Path(__file__).resolve().parent.parent

# Hypothesis: the CI machine has 2 slow cores and runs several processes at once, so wall-clock
# deadlines only produce flakes. In CI (CI=true) also derandomize, so a red run reproduces.
settings.register_profile("dev", deadline=None)
settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


NETWORK_TESTS = ("test_multinode_namespaces.py", "test_security_run.py", "test_security_processes.py")
"""Files whose tests build network namespaces with fixed 198.18.0.0/15 addresses: under pytest-xdist
(``scripts/test.sh``) they run on one worker, one at a time."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in NETWORK_TESTS:
            item.add_marker(pytest.mark.xdist_group("network"))
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or _cuda_available():  # import torch only when some test asks for a GPU
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in gpu_items:
        item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the folder holding pyproject.toml)."""
    return REPO_ROOT


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (:func:`weightsync.proc.free_port`)."""
    return proc.free_port()


@pytest.fixture(scope="module")
def trainer_group() -> Iterator[object]:
    """A gloo group of this one trainer rank (the default group too, created here when absent)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{proc.free_port()}", rank=0, world_size=1)
    yield dist.new_group(ranks=[0], backend="gloo")
    if created:
        dist.destroy_process_group()
