"""Idempotent, atomic output directories for ``prepare``.

An output is written into a temporary sibling directory ``.<name>.tmp-<pid>-<token>``; a marker
file naming the *request* (what was asked for: model, scale, source, seed, parallel config) is
written into it last, and the directory is renamed into place. So:

* a directory with a marker for the same request is complete: it is skipped;
* a temporary directory is an interrupted attempt: it is removed and the work redone;
* a directory with a marker for another request was written by weightsync for something else:
  it is replaced (new one renamed in first, old one removed after);
* a directory without a marker is not ours (e.g. a downloaded HF checkpoint): it is never
  deleted; the caller decides whether it can be used.

Do not run two ``prepare`` commands on the same output at the same time.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = ".weightsync-complete.json"


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of a finished output directory (None when absent or unreadable)."""
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: Path, request: dict[str, Any]) -> bool:
    """Whether ``path`` holds a finished output for exactly ``request``."""
    marker = read_marker(path)
    return marker is not None and marker.get("request") == request


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete interrupted attempts (``.<name>.tmp-*`` siblings of ``path``); return them."""
    removed = []
    if path.parent.is_dir():
        for tmp in path.parent.glob(f".{path.name}.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


@contextmanager
def atomic_output(path: Path, request: dict[str, Any], info: Callable[[], dict[str, Any]] | None = None
                  ) -> Iterator[Path]:
    """Yield a temporary directory to fill; on success mark it and move it to ``path``.

    On an exception the temporary directory is deleted and nothing at ``path`` changes.

    Args:
        path: the final output directory.
        request: what is being produced (stored in the marker, compared by :func:`is_complete`).
        info: called after the body succeeded; its dict is stored in the marker as ``"info"``.

    Raises:
        FileExistsError: ``path`` exists and is not a weightsync output (no marker): it is
            never replaced.
    """
    if path.exists() and read_marker(path) is None:
        raise FileExistsError(f"{path} exists and was not written by weightsync prepare; move it away or "
                              f"choose another --ckpt-dir")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        marker = {"request": request, "info": info() if info is not None else {}}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.tmp-{os.getpid()}-old-{secrets.token_hex(4)}"
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
