#!/bin/bash
# Kimi-K2: 64 nodes, 256 train + 256 rollout GPUs
# Usage: bash Kimi-K2.sh [MODE] [NODE_RANK] [HEAD_NODE_IP]
#   MODE         : p2p (default) | broadcast
#   NODE_RANK    : 0 (head, default) | 1..N (workers)
#   HEAD_NODE_IP : IP address of the head node
# On a machine without the profile's GPUs this runs the embedded default (tiny, CPU).
set -euo pipefail

MODE="${1:-p2p}"
NODE_RANK="${2:-0}"
HEAD_NODE_IP="${3:-}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"

if [ "${NODE_RANK}" -eq 0 ]; then
    "${PY}" "${SCRIPT_DIR}/run.py" prepare Kimi-K2
else
    "${PY}" "${SCRIPT_DIR}/run.py" prepare Kimi-K2 --download-only
fi
"${PY}" "${SCRIPT_DIR}/run.py" run Kimi-K2 --mode "${MODE}" --node-rank "${NODE_RANK}" --head-ip "${HEAD_NODE_IP}"
