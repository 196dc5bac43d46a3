# Shared by the wrappers (sourced, with SCRIPT_DIR set): the Python to use, and prepare + run.
REPO_ROOT="$(cd "${SCRIPT_DIR}/../../.." && pwd)"
if [ -z "${PY:-}" ]; then
    if [ -x "${REPO_ROOT}/.venv/bin/python" ]; then PY="${REPO_ROOT}/.venv/bin/python"; else PY=python3; fi
fi

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
