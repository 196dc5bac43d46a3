#!/usr/bin/env bash
# One device call on one GPU: a real sglang 0.5.16 server updated by weightsync (p2p over Mooncake
# and the colocated tensor path, verified by sglang's own checksums), beside the same updates into
# weightsync's own engine (scripts/gpu_sglang_real.py says what it does).
#
# Usage: OUT=<dir> [SITE=/tmp/site] [PY=python3] [WHEELS="<dir> ..."] [TOTAL_S=590] \
#          bash scripts/gpu_sglang_real.sh [extra gpu_sglang_real.py arguments]
#   OUT      where everything goes (required): env.txt, imports.txt, run.log, results.json,
#            sglang.log, weightsync.log, model/config.json.
#   SITE     the folder sglang's wheels are installed in (pip --target); first on PYTHONPATH for
#            sglang and for the trainer (Mooncake's CUDA build, sglang's transformers/tokenizers).
#   PY       the interpreter (the image's python3: torch 2.11 + CUDA 13).
#   WHEELS   folders of wheels installed into SITE first (pip --no-index --no-deps --target),
#            only when SITE has no sglang yet; empty: nothing installed.
#   TOTAL_S  the call's limit; the script's watchdog fires 50 s before it (results still written).
# Extra arguments go to the script, e.g. --scale full, --updates 5, --skip-weightsync.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
TOTAL_S=${TOTAL_S:-590}
mkdir -p "$OUT" "$SITE"
if [[ -n ${WHEELS:-} && ! -d $SITE/sglang ]]; then
  whls=(); for d in $WHEELS; do whls+=("$d"/*.whl); done
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${whls[@]}" \
    > "$OUT/install.txt" 2>&1 || { echo "wheel install failed:"; tail -5 "$OUT/install.txt"; }
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  git rev-parse --short HEAD 2>/dev/null
  echo "== OS libraries Mooncake's engine.so needs"; ldconfig -p | grep -E 'ibverbs|mlx5|numa|curl' || echo none
  ls /dev/infiniband 2>&1; } > "$OUT/env.txt" 2>&1
$PY - > "$OUT/imports.txt" 2>&1 <<'EOF'
import importlib
for name in ("torch", "sglang", "sgl_kernel", "transformers", "tokenizers", "mooncake.engine", "fastapi", "uvicorn"):
    try:
        m = importlib.import_module(name)
        print(f"{name}: {getattr(m, '__version__', '?')} {getattr(m, '__file__', '')}")
    except Exception as exc:
        print(f"{name}: IMPORT FAILED {type(exc).__name__}: {exc}")
EOF
cat "$OUT/env.txt" "$OUT/imports.txt"
timeout -k 10 "$TOTAL_S" $PY scripts/gpu_sglang_real.py --site "$SITE" --sglang-python "$PY" --out "$OUT" \
  --total-timeout-s $((TOTAL_S - 50)) "$@" > "$OUT/run.log" 2>&1
rc=$?
echo "== gpu_sglang_real.py exit $rc (run.log without Mooncake's own log lines)"
grep -vE '^[IWE][0-9]{4} |InitGoogleLogging' "$OUT/run.log" | tail -60
exit $rc
