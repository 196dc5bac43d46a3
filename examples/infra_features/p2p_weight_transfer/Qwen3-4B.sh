#!/bin/bash
# Qwen3-4B: single node, 4 train + 4 rollout GPUs.
# Usage: bash Qwen3-4B.sh [MODE]
#   MODE : p2p (default) | broadcast
# On a machine without the profile's GPUs this runs the embedded default (tiny, CPU).
set -euo pipefail

MODE="${1:-p2p}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"

"${PY}" "${SCRIPT_DIR}/run.py" prepare Qwen3-4B
"${PY}" "${SCRIPT_DIR}/run.py" run Qwen3-4B --mode "${MODE}"
