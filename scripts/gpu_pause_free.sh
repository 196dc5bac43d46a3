#!/usr/bin/env bash
# One device call on one GPU: what the engines wait for per verified update (paused vs pause-free),
# the fingerprint's speed, and the colocated broadcast path.
# Usage: OUT=<dir> bash scripts/gpu_pause_free.sh
# Packages the GPU image lacks (fastapi, uvicorn, pydantic, ...) come as wheels in .whl/ws when it
# exists. Writes into $OUT: gpu.txt, pytest_gpu.txt, verify.json/.log, pf_<model>_<mode>.json/.log.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:?set OUT}
if [[ -d .whl/ws ]]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/ws/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv;
  git rev-parse --short HEAD 2>/dev/null; $PY -c 'import torch,triton;print(torch.__version__,triton.__version__)'; } \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

echo "== gpu tests (fingerprint kernel against the definition)"
timeout 180 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_fingerprint_hash.py > "$OUT/pytest_gpu.txt" 2>&1
tail -3 "$OUT/pytest_gpu.txt"

echo "== fingerprint speed (Qwen3-4B full)"
timeout 240 $PY scripts/bench_verify.py --device cuda --scale full --out "$OUT/verify.json" > "$OUT/verify.log" 2>&1
echo "exit $?"; tail -25 "$OUT/verify.log"

for item in ${RUNS:-Qwen3-4B:full:p2p Qwen3-4B:full:broadcast Qwen3-30B-A3B:layers=32:p2p}; do
  IFS=: read -r model scale mode <<<"$item"
  tag="${model}_${scale//=/}_${mode}"
  echo "== engines' idle time: $model $scale $mode"
  timeout ${PF_TIMEOUT:-420} $PY scripts/bench_pause_free.py --model "$model" --scale "$scale" --device cuda \
    --mode "$mode" --updates ${UPDATES:-5} --out "$OUT/pf_$tag.json" > "$OUT/pf_$tag.log" 2>&1
  echo "exit $?"; tail -6 "$OUT/pf_$tag.log"
done
