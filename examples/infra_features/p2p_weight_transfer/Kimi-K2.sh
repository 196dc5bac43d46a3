#!/bin/bash
# Kimi-K2: 64 nodes, 256 train + 256 rollout GPUs
# Usage: bash Kimi-K2.sh [MODE] [NODE_RANK] [HEAD_NODE_IP]
#   MODE         : p2p (default) | broadcast
#   NODE_RANK    : 0 (head, default) | 1..N (workers)
#   HEAD_NODE_IP : IP address of the head node
# On a machine without the profile's GPUs this runs the embedded default (tiny, CPU).
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"
prepare_and_run Kimi-K2 "${1:-p2p}" "${2:-0}" "${3:-}"
