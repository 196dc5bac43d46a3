"""Smoke test of the installed environment: the pinned torch and the third-party stacks import."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata

import pytest

PINNED_TORCH = "2.13"


def test_torch_is_the_pinned_cpu_build():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip(f"GPU machine: runs its image's torch {torch.__version__}, not the pinned CPU build")
    assert torch.__version__.startswith(PINNED_TORCH), (
        f"torch {torch.__version__} in the venv, expected {PINNED_TORCH}.x: run scripts/setup.sh "
        "(another torch version downloads a multi-GB CUDA build)"
    )


def test_megatron_core_imports():
    core = importlib.import_module("megatron.core")
    assert metadata.version("megatron-core") == "0.16.1"
    assert hasattr(core, "parallel_state")


def test_mooncake_transfer_engine_imports():
    engine = importlib.import_module("mooncake.engine")  # fails if libibverbs etc. are missing
    te = engine.TransferEngine()
    for method in (
        "initialize",
        "register_memory",
        "unregister_memory",
        "transfer_sync_write",
        "batch_transfer_async_write",
        "get_batch_transfer_status",
        "get_rpc_port",
    ):
        assert callable(getattr(te, method)), method


@pytest.mark.parametrize(
    "module", ["fastapi", "uvicorn", "httpx", "pydantic", "numpy", "safetensors", "xxhash", "tqdm", "matplotlib"]
)
def test_dependency_imports(module):
    importlib.import_module(module)


def test_weightsync_console_script_is_installed():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("weightsync") == "weightsync.cli:main"
    from weightsync import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
