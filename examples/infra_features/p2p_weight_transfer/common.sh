# Shared by the wrappers (sourced, with SCRIPT_DIR set): the Python to use, the usage, the argument
# checks, and prepare + run.
REPO_ROOT="$(cd "${SCRIPT_DIR}/../../.." && pwd)"
if [ -z "${PY:-}" ]; then
    if [ -x "${REPO_ROOT}/.venv/bin/python" ]; then PY="${REPO_ROOT}/.venv/bin/python"; else PY=python3; fi
fi

# wrapper_usage SCRIPT: the wrapper's own header (its comment lines after the shebang), then what
# every wrapper reads from the environment.
wrapper_usage() {
    sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "$1"
    cat <<'EOF'

Environment:
  CKPT_SAVE_DIR    where checkpoints are written and read (default /root/multinode)
  SKIP_VALIDATION  1: skip check-weight-update-equal at the first update (engines start from
                   dummy weights; checksums and logprob parity still run every step)
  BUCKET_SIZE_GB   bucket size in GiB of the broadcast and of p2p staging (default 1)
  MILES_LOG_DIR    logs, results.json and the plot (default logs/<model>_<mode>_<time>)
  PY               the Python to run (default: the repo's .venv/bin/python, else python3)
The wrapper prepares the checkpoint (idempotent: a complete one is skipped), then runs.
RUN_ARGS are options of `run`: see `python run.py run --help`.
EOF
}

# wrapper_main SCRIPT MODEL NODES [ARGS...]: the whole wrapper. ARGS are [MODE] [NODE_RANK]
# [HEAD_NODE_IP] (only MODE for a one-node profile) and then RUN_ARGS, the first argument starting
# with "-" ending the positional ones. -h/--help anywhere prints the usage and does nothing else.
# The arguments are checked before anything is prepared.
wrapper_main() {
    local script="$1" model="$2" nodes="$3"
    shift 3
    local a
    for a in "$@"; do
        if [ "${a}" = "-h" ] || [ "${a}" = "--help" ]; then wrapper_usage "${script}"; exit 0; fi
    done
    local positional=(MODE) mode="p2p" node_rank="0" head_ip=""
    [ "${nodes}" -gt 1 ] && positional=(MODE NODE_RANK HEAD_NODE_IP)
    local name
    for name in "${positional[@]}"; do
        if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then break; fi
        case "${name}" in
            MODE) mode="$1" ;;
            NODE_RANK) node_rank="$1" ;;
            HEAD_NODE_IP) head_ip="$1" ;;
        esac
        shift
    done
    check_wrapper_args "${script}" "${model}" "${nodes}" "${mode}" "${node_rank}" "${head_ip}"
    prepare_and_run "${model}" "${mode}" "${node_rank}" "${head_ip}" "$@"
}

# check_wrapper_args SCRIPT MODEL NODES MODE NODE_RANK HEAD_NODE_IP: one line and exit 2 on the
# first bad argument (as `run` does), before anything is prepared.
check_wrapper_args() {
    local script="$1" model="$2" nodes="$3" mode="$4" node_rank="$5" head_ip="$6"
    local me
    me="$(basename "${script}")"
    case "${mode}" in
        p2p|broadcast|both) ;;
        *) echo "${me}: unknown mode '${mode}': use p2p, broadcast or both (--help for the usage)" >&2; exit 2 ;;
    esac
    if ! [[ "${node_rank}" =~ ^[0-9]+$ ]]; then
        echo "${me}: NODE_RANK '${node_rank}' is not a node rank: 0 (the head) .. $((nodes - 1))" >&2; exit 2
    fi
    if [ "${node_rank}" -ge "${nodes}" ]; then
        echo "${me}: NODE_RANK ${node_rank}: ${model}'s profile runs on ${nodes} nodes, ranks 0 .. $((nodes - 1))" >&2
        exit 2
    fi
    if [ "${node_rank}" -gt 0 ] && [ -z "${head_ip}" ]; then
        echo "${me}: NODE_RANK ${node_rank} needs HEAD_NODE_IP, the address of node rank 0 (the head)," \
             "e.g. bash ${me} ${mode} ${node_rank} 10.0.0.1" >&2
        exit 2
    fi
}

# prepare_and_run MODEL MODE NODE_RANK HEAD_NODE_IP [RUN_ARGS...]: the head prepares the checkpoint
# (idempotent: a complete one is skipped), workers only fetch the HF checkpoint and data; then every
# node runs: with HEAD_NODE_IP, node 0 starts the Ray head and runs the job, the others join it and
# leave when it ends; without, node 0 runs alone. Arguments after HEAD_NODE_IP go to `run.py run`.
prepare_and_run() {
    local model="$1" mode="$2" node_rank="$3" head_ip="$4"
    shift 4
    local multi=()
    [ -n "${head_ip}" ] && multi=(--head-ip "${head_ip}")
    if [ "${node_rank}" -eq 0 ]; then
        "${PY}" "${SCRIPT_DIR}/run.py" prepare "${model}" "${multi[@]}"
    else
        "${PY}" "${SCRIPT_DIR}/run.py" prepare "${model}" --download-only "${multi[@]}"
    fi
    "${PY}" "${SCRIPT_DIR}/run.py" run "${model}" --mode "${mode}" --node-rank "${node_rank}" --head-ip "${head_ip}" "$@"
}
