#!/bin/bash
# GLM-5 variants: GLM-5_4layer (2 nodes) | GLM-5_20layer (12 nodes) | GLM-5 (32 nodes)
# Usage: bash GLM-5.sh <VARIANT> [MODE] [NODE_RANK] [HEAD_NODE_IP] [RUN_ARGS...]
#   VARIANT      : GLM-5_4layer | GLM-5_20layer | GLM-5
#   MODE         : p2p (default) | broadcast
#   NODE_RANK    : 0 (head, default) | 1..N (workers)
#   HEAD_NODE_IP : IP address of the head node (as the other nodes reach it); without it node 0
#                  runs alone
#   RUN_ARGS     : further `run.py run` options (e.g. --num-rollout 1)
# On nodes without the profile's GPUs this runs the embedded default (tiny, CPU): with HEAD_NODE_IP
# the trainer on node 0 and one engine on each other node, else all on this machine.
set -euo pipefail

VARIANT="${1:?Usage: $0 <VARIANT> [MODE] [NODE_RANK] [HEAD_NODE_IP]}"
MODE="${2:-p2p}"
NODE_RANK="${3:-0}"
HEAD_NODE_IP="${4:-}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"

case "${VARIANT}" in
    GLM-5_4layer|GLM-5_20layer|GLM-5) ;;
    *) echo "ERROR: unknown variant '${VARIANT}'. Use GLM-5_4layer, GLM-5_20layer, or GLM-5." >&2; exit 1 ;;
esac

prepare_and_run "${VARIANT}" "${MODE}" "${NODE_RANK}" "${HEAD_NODE_IP}" "${@:5}"
