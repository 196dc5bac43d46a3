#!/bin/bash
# Qwen3-4B: single node, 4 train + 4 rollout GPUs.
# Usage: bash Qwen3-4B.sh [MODE] [RUN_ARGS...]
#   MODE     : p2p (default) | broadcast | both (alternating, one run)
#   RUN_ARGS : further `run.py run` options (e.g. --num-rollout 1)
# On a machine without the profile's GPUs this runs the embedded default (tiny, CPU).
# Examples:
#   bash Qwen3-4B.sh p2p
#   bash Qwen3-4B.sh broadcast --num-rollout 1
#   SKIP_VALIDATION=1 MILES_LOG_DIR=/tmp/qwen bash Qwen3-4B.sh both
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"
wrapper_main "${BASH_SOURCE[0]}" Qwen3-4B 1 "$@"
