#!/usr/bin/env bash
# Set up this checkout on a fresh machine: system packages (the libraries Mooncake needs, iproute2),
# a virtual environment in .venv at the repo root, CPU torch, then weightsync (editable) with its test
# tools; where nvidia-smi lists a GPU, Mooncake's CUDA build in place of the non-CUDA one.
# Idempotent: every step checks first and does nothing when already done.
#
#   bash scripts/setup.sh
#
# Environment (all optional):
#   PYTHON           interpreter for the venv (default: python3.11, else python3 if >= 3.11)
#   TORCH_INDEX_URL  pip index for torch (e.g. a CPU wheel index on machines without a local wheel)
#   WEIGHTSYNC_EXTRAS  extras to install (default: test; e.g. "test,dev" for ruff too)
#   SETUP_PROGRESS_S   seconds between the progress lines of the pip installs (default 10)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TORCH_VERSION="2.13.0"
EXTRAS="${WEIGHTSYNC_EXTRAS:-test}"
# Mooncake's transfer engine links the first five; iproute2's `ip` builds the hosts of the multi-node
# test (network namespaces).
APT_PACKAGES=(libibverbs1 librdmacm1 ibverbs-providers libnuma1 libcurl4 iproute2)
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
LOG=""  # made by main
START=$SECONDS

log() { printf '[setup %3ds] %s\n' "$((SECONDS - START))" "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# Run a command with its output in $LOG; on failure show the end of it and stop.
quiet() {
    if ! "$@" >>"$LOG" 2>&1; then
        failed "$*"
    fi
}

failed() {
    printf '[setup] ERROR: command failed: %s\n--- last lines of %s ---\n' "$1" "$LOG" >&2
    tail -n 40 "$LOG" >&2
    exit 1
}

PROGRESS_S="${SETUP_PROGRESS_S:-10}"
# Run a pip command as quiet does, and while it runs print every PROGRESS_S seconds how long it has
# been at it, how many packages it has collected, and its latest step (pip's own line).
with_progress() {
    local what="$1" mark pid start last now
    shift
    mark=$(($(wc -l <"$LOG") + 1))
    "$@" >>"$LOG" 2>&1 &
    pid=$!
    start=$SECONDS
    last=$SECONDS
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if ((SECONDS - last >= PROGRESS_S)) && kill -0 "$pid" 2>/dev/null; then
            last=$SECONDS
            now="$(tail -n "+$mark" "$LOG" | grep -E '^ *(Collecting|Downloading|Processing|Building|Installing|Obtaining|Preparing|Using cached)' | tail -n 1 | sed 's/^ *//' | cut -c1-90 || true)"
            log "$what: $((SECONDS - start)) s, $(tail -n "+$mark" "$LOG" | grep -c '^Collecting' || true) packages collected${now:+; now: $now}"
        fi
    done
    wait "$pid" || failed "$*"
}

# --- 1. system packages (Mooncake's engine.so links libibverbs; tcp works without RDMA hardware) ---
install_system_packages() {
    if ! command -v dpkg-query >/dev/null 2>&1; then
        if ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
            log "system libraries: not a Debian system; libibverbs found"
        else
            log "WARNING: not a Debian system and libibverbs.so.1 not found: install rdma-core (libibverbs, librdmacm) for Mooncake"
        fi
        return
    fi
    local missing=() pkg
    for pkg in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
    done
    if ((${#missing[@]} == 0)); then
        log "system packages: present (${APT_PACKAGES[*]})"
        return
    fi
    local sudo=()
    if [[ "$(id -u)" -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "need root (or sudo) to install: ${missing[*]}"
        sudo=(sudo -n)
    fi
    log "system packages: installing ${missing[*]} (apt-get)"
    quiet "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    quiet "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# --- 2. virtual environment ---
pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    if command -v python3.11 >/dev/null 2>&1; then echo python3.11; return; fi
    echo python3
}

make_venv() {
    if [[ -x "$VPY" ]]; then
        "$VPY" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null \
            || die "$VENV exists but its python does not run or is older than 3.11: remove it and re-run"
        log "venv: $VENV exists ($("$VPY" -c 'import platform; print(platform.python_version())'))"
        return
    fi
    local py
    py="$(pick_python)"
    command -v "$py" >/dev/null 2>&1 || die "no $py on PATH (set PYTHON=/path/to/python3.11)"
    "$py" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null || die "$py is older than Python 3.11"
    log "venv: creating $VENV with $py ($("$py" -c 'import platform; print(platform.python_version())'))"
    quiet "$py" -m venv "$VENV"
}

dist_version() {  # version of an installed distribution in the venv, or empty
    "$VPY" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}

# --- 3. torch, on its own and first, so that nothing else can pull another build ---
install_torch() {
    local have
    have="$(dist_version torch)"
    if [[ "${have%%+*}" == "$TORCH_VERSION" ]]; then
        log "torch: $have present"
        return
    fi
    log "torch: installing torch==$TORCH_VERSION${have:+ (replacing $have)}"
    local extra=()
    [[ -n "${TORCH_INDEX_URL:-}" ]] && extra=(--index-url "$TORCH_INDEX_URL")
    with_progress torch "$VPY" -m pip install --disable-pip-version-check --no-input --progress-bar off "${extra[@]}" \
        "torch==$TORCH_VERSION"
}

# --- 4. weightsync (editable) and its dependencies ---
install_project() {
    local stamp="$VENV/.weightsync-setup" want
    want="$(sha256sum pyproject.toml | cut -d' ' -f1) extras=$EXTRAS root=$ROOT torch=$TORCH_VERSION"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$VPY" -c 'import sys, weightsync
sys.exit(not weightsync.__file__.startswith(sys.argv[1]))' "$ROOT/" 2>/dev/null; then
        log "weightsync: installed, pyproject.toml unchanged since (remove $stamp to force)"
        return
    fi
    rm -f "$stamp"
    log "weightsync: pip install -e '.[$EXTRAS]' (megatron-core, mooncake, fastapi, ...)"
    with_progress weightsync "$VPY" -m pip install --disable-pip-version-check --no-input --progress-bar off \
        -e ".[$EXTRAS]"
    local have
    have="$(dist_version torch)"
    [[ "${have%%+*}" == "$TORCH_VERSION" ]] || die "torch changed to $have during the install (expected $TORCH_VERSION)"
    echo "$want" >"$stamp"
}

# --- 5. on a GPU machine: Mooncake's CUDA build (GPU memory registration), in place of the non-CUDA one ---
MOONCAKE_CUDA="mooncake-transfer-engine-cuda13==0.3.14"
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

install_mooncake_cuda() {
    if ! has_gpu; then
        log "mooncake: the non-CUDA build (no GPU: nvidia-smi absent or lists none)"
        return
    fi
    local cuda non
    cuda="$(dist_version mooncake-transfer-engine-cuda13)"
    non="$(dist_version mooncake-transfer-engine-non-cuda)"
    if [[ "$cuda" == "${MOONCAKE_CUDA##*==}" && -z "$non" ]]; then
        log "mooncake: CUDA build $cuda present"
        return
    fi
    # both builds install the package `mooncake`: remove both, then install the CUDA one alone
    log "mooncake: a GPU is present: installing $MOONCAKE_CUDA in place of the non-CUDA build (needs CUDA 13's runtime)"
    quiet "$VPY" -m pip uninstall -y mooncake-transfer-engine-non-cuda mooncake-transfer-engine-cuda13
    with_progress mooncake "$VPY" -m pip install --disable-pip-version-check --no-input --progress-bar off "$MOONCAKE_CUDA"
}

check_imports() {
    quiet "$VPY" -c 'import weightsync, torch, mooncake.engine, fastapi, safetensors, xxhash, ray'
    log "ready: $("$VPY" -c 'import importlib.metadata as m, platform
have = {d.metadata["Name"]: d.version for d in m.distributions()}
names = ("torch", "megatron-core", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13", "ray")
print(f"Python {platform.python_version()}, " + ", ".join(f"{d} {have[d]}" for d in names if d in have))')"
}

main() {
    LOG="$(mktemp -t weightsync-setup.XXXXXX.log)"
    log "weightsync set-up in $ROOT (log: $LOG)"
    install_system_packages
    make_venv
    install_torch
    install_project
    install_mooncake_cuda
    check_imports
    rm -f "$LOG"
    log "done in $((SECONDS - START)) s; use $VENV/bin/python (or: source .venv/bin/activate)"
}

# sourced (the tests do, for its functions), it only defines them
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
