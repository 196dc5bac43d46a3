#!/bin/bash
# GLM-5 variants: GLM-5_4layer (2 nodes) | GLM-5_20layer (12 nodes) | GLM-5 (32 nodes)
# Usage: bash GLM-5.sh <VARIANT> [MODE] [NODE_RANK] [HEAD_NODE_IP] [RUN_ARGS...]
#   VARIANT      : GLM-5_4layer | GLM-5_20layer | GLM-5
#   MODE         : p2p (default) | broadcast | both (alternating, one run)
#   NODE_RANK    : 0 (head, default) | 1..N-1 (workers; they need HEAD_NODE_IP)
#   HEAD_NODE_IP : IP address of the head node (as the other nodes reach it); without it node 0
#                  runs alone
#   RUN_ARGS     : further `run.py run` options (e.g. --num-rollout 1); the first argument that
#                  starts with "-" ends MODE / NODE_RANK / HEAD_NODE_IP
# On nodes without the profile's GPUs this runs the embedded default (tiny, CPU): with HEAD_NODE_IP
# the trainer on node 0 and one engine on each other node, else all on this machine.
# Examples:
#   bash GLM-5.sh GLM-5_4layer p2p --num-rollout 1     # node 0 alone
#   bash GLM-5.sh GLM-5_4layer p2p 0 10.0.0.1          # the head, at 10.0.0.1
#   bash GLM-5.sh GLM-5_4layer p2p 1 10.0.0.1          # node 1, joining that head
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"

for a in "$@"; do
    if [ "${a}" = "-h" ] || [ "${a}" = "--help" ]; then wrapper_usage "${BASH_SOURCE[0]}"; exit 0; fi
done
if [ $# -eq 0 ]; then
    echo "Usage: bash GLM-5.sh <VARIANT> [MODE] [NODE_RANK] [HEAD_NODE_IP] [RUN_ARGS...] (--help for more)" >&2
    exit 2
fi
VARIANT="$1"
shift
case "${VARIANT}" in
    GLM-5_4layer) NODES=2 ;;
    GLM-5_20layer) NODES=12 ;;
    GLM-5) NODES=32 ;;
    *) echo "GLM-5.sh: unknown variant '${VARIANT}': use GLM-5_4layer, GLM-5_20layer or GLM-5" >&2; exit 2 ;;
esac
wrapper_main "${BASH_SOURCE[0]}" "${VARIANT}" "${NODES}" "$@"
