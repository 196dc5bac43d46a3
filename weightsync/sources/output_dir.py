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

A marker is trusted only once the files agree with it (:func:`damage`): the marker lists every
file with its size (and the SHA-256 of the small ones: ``config.json``, metadata), and every
``.safetensors`` file must be whole (its header parses, each tensor's bytes fit its dtype and
shape, the data ends where the file ends). A damaged output -- a truncated or replaced file -- is
redone, never skipped as complete.

Do not run two ``prepare`` commands on the same output at the same time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import shutil
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = ".weightsync-complete.json"
HASHED_BYTES = 1 << 20
"""Files up to this size are recorded with their SHA-256 (config.json, metadata), larger ones by size."""
_MAX_HEADER = 100 << 20
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of a finished output directory (None when absent or unreadable)."""
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: Path, request: dict[str, Any]) -> bool:
    """Whether ``path`` holds a finished, undamaged output for exactly ``request`` (a damaged one
    is logged with the reason, and is not complete)."""
    marker = read_marker(path)
    if marker is None or marker.get("request") != request:
        return False
    why = damage(path, marker)
    if why:
        logger.warning("%s is damaged (%s): redoing it", path, why)
        return False
    return True


def manifest(path: Path) -> dict[str, dict[str, Any]]:
    """Every file under ``path`` but the marker: relative path -> ``{"size"}`` (and ``"sha256"``
    for files of at most :data:`HASHED_BYTES`)."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(path.rglob("*")):
        if not f.is_file() or f.name == MARKER:
            continue
        entry: dict[str, Any] = {"size": f.stat().st_size}
        if entry["size"] <= HASHED_BYTES:
            entry["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
        out[str(f.relative_to(path))] = entry
    return out


def damage(path: Path, marker: dict[str, Any] | None = None) -> str:
    """Why the output at ``path`` does not match its marker ("" when it does): a listed file
    missing, of another size or content, or a ``.safetensors`` file that is not whole
    (:func:`safetensors_damage`). Markers written before files were listed are checked by the
    safetensors rule alone."""
    marker = marker if marker is not None else read_marker(path)
    if marker is None:
        return "no marker"
    for rel, want in sorted((marker.get("files") or {}).items()):
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size != want.get("size"):
            return f"{rel} has {size} bytes, {want.get('size')} were written"
        if "sha256" in want and hashlib.sha256(f.read_bytes()).hexdigest() != want["sha256"]:
            return f"{rel} was changed since it was written"
    for f in sorted(path.rglob("*.safetensors")):
        why = safetensors_damage(f)
        if why:
            return why
    return ""


def safetensors_damage(path: Path) -> str:
    """Why a ``.safetensors`` file is not whole ("" when it is): its 8-byte header length, its
    JSON header, every tensor's ``data_offsets`` against its dtype and shape, and the data
    ending exactly at the end of the file (a truncated copy fails the last)."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{name}: {size} bytes, shorter than a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                return f"{name}: header of {n} bytes in a file of {size} bytes (truncated or not safetensors)"
            header = json.loads(f.read(n))
    except OSError as exc:
        return f"{name}: unreadable ({exc.strerror or exc})"
    except ValueError:
        return f"{name}: its header is not JSON (truncated or not safetensors)"
    if not isinstance(header, dict):
        return f"{name}: its header is not a JSON object"
    end = 0
    for tensor, meta in header.items():
        if tensor == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in meta["data_offsets"])
            item = _ITEM_BYTES.get(str(meta["dtype"]))  # a dtype not listed: its offsets alone
            want = stop - begin if item is None else math.prod(int(d) for d in meta["shape"]) * item
        except (KeyError, TypeError, ValueError):
            return f"{name}: {tensor}: a header entry without a dtype, shape and data_offsets"
        if not 0 <= begin <= stop or stop - begin != want:
            return f"{name}: {tensor}: {stop - begin} bytes for a {meta['dtype']} tensor of shape {meta['shape']} " \
                   f"({want} expected)"
        end = max(end, stop)
    if 8 + n + end != size:
        return f"{name}: {size} bytes, its header describes {8 + n + end} (truncated or padded)"
    return ""


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
        marker = {"request": request, "info": info() if info is not None else {}, "files": manifest(tmp)}
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
