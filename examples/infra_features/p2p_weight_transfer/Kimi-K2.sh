#!/bin/bash
# Kimi-K2: 64 nodes, 256 train + 256 rollout GPUs
# Usage: bash Kimi-K2.sh [MODE] [NODE_RANK] [HEAD_NODE_IP] [RUN_ARGS...]
#   MODE         : p2p (default) | broadcast | both (alternating, one run)
#   NODE_RANK    : 0 (head, default) | 1..63 (workers; they need HEAD_NODE_IP)
#   HEAD_NODE_IP : IP address of the head node (as the other nodes reach it); without it node 0
#                  runs alone
#   RUN_ARGS     : further `run.py run` options (e.g. --num-rollout 1); the first argument that
#                  starts with "-" ends MODE / NODE_RANK / HEAD_NODE_IP
# On nodes without the profile's GPUs this runs the embedded default (tiny, CPU): with HEAD_NODE_IP
# the trainer on node 0 and one engine on each other node, else all on this machine.
# Examples:
#   bash Kimi-K2.sh p2p --num-rollout 1                # node 0 alone
#   bash Kimi-K2.sh p2p 0 10.0.0.1                     # the head, at 10.0.0.1
#   bash Kimi-K2.sh p2p 1 10.0.0.1                     # node 1, joining that head
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"
wrapper_main "${BASH_SOURCE[0]}" Kimi-K2 64 "$@"
