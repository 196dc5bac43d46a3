#!/usr/bin/env bash
# Lint (ruff) and run the test suite in .venv (made by scripts/setup.sh), in parallel (TEST_WORKERS,
# default 2). Extra arguments go to pytest instead of the defaults, e.g.
#   bash scripts/test.sh -m "not slow"      bash scripts/test.sh tests/test_setup_imports.py -x
# pytest's exit code 5 ("no tests collected") is turned into a failure: a run that tests nothing
# must not pass.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[[ -x .venv/bin/python ]] || { echo "[test] no .venv: run 'bash scripts/setup.sh' first" >&2; exit 1; }

# Lint first (ruff, pinned in the test extras): a lint error fails the run as a test would.
.venv/bin/python -m ruff check --quiet weightsync tests scripts examples || {
    echo "[test] ERROR: ruff found lint errors (above); fix them or run: .venv/bin/ruff check --fix ..." >&2
    exit 1
}

# With no arguments (what CI runs) the whole suite runs in TEST_WORKERS processes (pytest-xdist,
# default 2): most tests wait on engines and trainer ranks of their own, so two workers keep a
# 2-core machine busy. The tests that build network namespaces share one worker (conftest.py).
# With arguments, pytest gets exactly those (add -n N yourself to spread them).
if [[ $# -eq 0 ]]; then
    set -- -n "${TEST_WORKERS:-2}" --dist loadgroup tests
fi
.venv/bin/python -m pytest -q "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
    echo "[test] ERROR: pytest collected no tests (exit 5); treating as failure" >&2
    exit 1
fi
exit $rc
