#!/bin/bash
# GLM-4.5-Air: 8 nodes, 32 train + 32 rollout GPUs
# Usage: bash GLM-4.5-Air.sh [MODE] [NODE_RANK] [HEAD_NODE_IP]
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
    "${PY}" "${SCRIPT_DIR}/run.py" prepare GLM-4.5-Air
else
    "${PY}" "${SCRIPT_DIR}/run.py" prepare GLM-4.5-Air --download-only
fi
"${PY}" "${SCRIPT_DIR}/run.py" run GLM-4.5-Air --mode "${MODE}" --node-rank "${NODE_RANK}" --head-ip "${HEAD_NODE_IP}"
