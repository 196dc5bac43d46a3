#!/bin/bash
# GLM-4.7-Flash: 2 nodes, 8 train + 8 rollout GPUs
# Usage: bash GLM-4.7-Flash.sh [MODE] [NODE_RANK] [HEAD_NODE_IP]
#   MODE         : p2p (default) | broadcast
#   NODE_RANK    : 0 (head, default) | 1..N (workers)
#   HEAD_NODE_IP : IP address of the head node
# On a machine without the profile's GPUs this runs the embedded default (tiny, CPU).
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"
prepare_and_run GLM-4.7-Flash "${1:-p2p}" "${2:-0}" "${3:-}"
