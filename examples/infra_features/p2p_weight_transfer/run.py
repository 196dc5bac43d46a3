#!/usr/bin/env python3
"""Prepare and run the p2p weight transfer examples (the reference system's ``run.py``).

Usage:
    python run.py list
    python run.py prepare <MODEL> [--download-only] [--ckpt-dir DIR] [--hf-checkpoint DIR]
    python run.py run     <MODEL> [--mode p2p|broadcast] [--node-rank 0] [--head-ip IP]

Environment: CKPT_SAVE_DIR (default /root/multinode), SKIP_VALIDATION (1 skips
--check-weight-update-equal), BUCKET_SIZE_GB (default 1), MILES_LOG_DIR (logs, results.json,
plots). On a machine without the GPUs a profile needs, ``prepare`` and ``run`` use the embedded
default: the same family at tiny scale on CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from weightsync.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
