#!/bin/bash
# Qwen3-4B: single node, 4 train + 4 rollout GPUs.
# Usage: bash Qwen3-4B.sh [MODE]
#   MODE : p2p (default) | broadcast
# On a machine without the profile's GPUs this runs the embedded default (tiny, CPU).
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"
prepare_and_run Qwen3-4B "${1:-p2p}" 0 ""
