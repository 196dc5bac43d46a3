#!/bin/bash
# Qwen3-30B-A3B: 4 nodes, 16 train + 16 rollout GPUs
# Usage: bash Qwen3-30B-A3B.sh [MODE] [NODE_RANK] [HEAD_NODE_IP] [RUN_ARGS...]
#   MODE         : p2p (default) | broadcast
#   NODE_RANK    : 0 (head, default) | 1..N (workers)
#   HEAD_NODE_IP : IP address of the head node (as the other nodes reach it); without it node 0
#                  runs alone
#   RUN_ARGS     : further `run.py run` options (e.g. --num-rollout 1)
# On nodes without the profile's GPUs this runs the embedded default (tiny, CPU): with HEAD_NODE_IP
# the trainer on node 0 and one engine on each other node, else all on this machine.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${SCRIPT_DIR}/common.sh"
prepare_and_run Qwen3-30B-A3B "${1:-p2p}" "${2:-0}" "${3:-}" "${@:4}"
