# Shared by the wrappers: the Python to use (the repo's .venv when it exists).
REPO_ROOT="$(cd "${SCRIPT_DIR}/../../.." && pwd)"
if [ -z "${PY:-}" ]; then
    if [ -x "${REPO_ROOT}/.venv/bin/python" ]; then PY="${REPO_ROOT}/.venv/bin/python"; else PY=python3; fi
fi
