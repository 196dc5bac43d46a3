#!/usr/bin/env bash
# One device call: `weightsync run` colocated on one GPU with megatron-core training, both modes.
# Usage: OUT=<dir> bash scripts/gpu_run_colocated.sh [scale:lr ...]   (default: tiny:1e-4 layers=2:2e-4)
# Packages the GPU image lacks (fastapi, uvicorn, pydantic, megatron-core, ...) come as wheels in
# .whl/ when it exists. Writes into $OUT, per scale: <scale>_run.log and <scale>_results.json (and
# gpu.txt); the last scale also its engine log and update_phases.png.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:?set OUT}
if [[ -d .whl ]]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv;
  git rev-parse --short HEAD 2>/dev/null; $PY -c 'import torch;print(torch.__version__)'; } > "$OUT/gpu.txt" 2>&1
one="--train tp=1,pp=1,cp=1,ep=1,etp=1,world=1 --rollout tp=1,ep=1,dp=1,engines=1"
runs=("${@:-tiny:1e-4 layers=2:2e-4}")
for item in ${runs[@]}; do
  scale=${item%%:*}; lr=${item#*:}; tag=${scale//=/}
  log=/tmp/run_$tag
  rm -rf "$log"
  echo "== $scale lr $lr"
  CKPT_SAVE_DIR=/tmp/ckpt MILES_LOG_DIR=$log timeout ${RUN_TIMEOUT:-330} $PY -m weightsync.cli run Qwen3-4B \
    --device cuda --scale "$scale" $one --synthetic --placement colocated --mode both --num-rollout ${STEPS:-6} \
    --lr "$lr" > "$OUT/${tag}_run.log" 2>&1
  echo "== exit $?"
  grep -v "^\[trainer\|Warning\|warnings.warn\|^  warn" "$OUT/${tag}_run.log" | grep -E "^(step|memory|trainer|summary|placement|model| +[0-9]| *step|---)" | tail -40
  cp "$log/results.json" "$OUT/${tag}_results.json" 2>/dev/null
done
cp "$log/engine0.log" "$OUT/${tag}_engine0.log" 2>/dev/null
cp "$log/update_phases.png" "$OUT/${tag}_update_phases.png" 2>/dev/null
