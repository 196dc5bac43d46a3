#!/bin/bash
# Qwen3-30B-A3B: 4 nodes, 16 train + 16 rollout GPUs
# Usage: bash Qwen3-30B-A3B.sh [MODE] [NODE_RANK] [HEAD_NODE_IP]
#   MODE         : p2p (default) | broadcast
#   NODE_RANK    : 0 (head, default) | 1..N (workers)
#   HEAD_NODE_IP : IP address of the head node
# On a machine without the profile's GPUs this runs the embedded default (tiny, CPU).
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"
prepare_and_run Qwen3-30B-A3B "${1:-p2p}" "${2:-0}" "${3:-}"
