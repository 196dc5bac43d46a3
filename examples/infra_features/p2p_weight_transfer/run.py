#!/usr/bin/env python3
"""Prepare and run the p2p weight transfer examples (the reference system's ``run.py``).

Usage:
    python run.py list
    python run.py prepare <MODEL> [--download-only] [--ckpt-dir DIR] [--hf-checkpoint DIR]
    python run.py run     <MODEL> [--mode p2p|broadcast|both] [--node-rank 0] [--head-ip IP]
    python run.py <command> --help

Environment: CKPT_SAVE_DIR (default /root/multinode), SKIP_VALIDATION (1 skips
--check-weight-update-equal), BUCKET_SIZE_GB (default 1), MILES_LOG_DIR (logs, results.json,
plots). On a machine without the GPUs a profile needs, ``prepare`` and ``run`` use the embedded
default: the same family at tiny scale on CPU.

Any Python will do: one that lacks weightsync's dependencies runs this script again with the
repository's ``.venv`` (made by ``scripts/setup.sh``), or, without one, says what to do.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
VENV = REPO_ROOT / ".venv"
NEEDED = ("torch", "numpy", "safetensors", "xxhash", "tqdm", "pydantic", "fastapi", "uvicorn", "httpx", "matplotlib")
"""Import names of the dependencies every command may reach (pyproject.toml's, less the ones
imported only by some commands: megatron-core, Mooncake, Ray, huggingface-hub)."""


def _missing() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def _in_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def _reexec_or_explain() -> None:
    """Return when this Python has the dependencies; else run the script with the repository's
    ``.venv`` Python, or, when there is none (or this is it), print one line and exit 2."""
    missing = _missing()
    if not missing:
        return
    python = VENV / "bin" / "python"
    if python.is_file() and not _in_venv():
        os.execv(python, [str(python), __file__, *sys.argv[1:]])
    script = Path(__file__).resolve().relative_to(REPO_ROOT)
    print(f"run.py: this Python ({sys.executable}) lacks {', '.join(missing)}: run `bash scripts/setup.sh` in "
          f"{REPO_ROOT}, then `.venv/bin/python {script} ...` (or `source .venv/bin/activate` first)",
          file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    _reexec_or_explain()
    sys.path.insert(0, str(REPO_ROOT))
    from weightsync.cli import main

    sys.exit(main(sys.argv[1:]))
