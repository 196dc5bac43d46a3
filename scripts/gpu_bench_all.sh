#!/usr/bin/env bash
# One device call of the GPU performance work: GPU tests, scripts/bench_gpu.py, then
# `weightsync bench` colocated on one GPU (p2p beside the colocated baseline) for each model.
# Usage: OUT=<dir> bash scripts/gpu_bench_all.sh [models...]   (default: the three of BENCHMARKS.md)
# Writes into $OUT: gpu.txt, pytest_gpu.txt, bench_gpu.json, bench_gpu.log, bench_<model>.json, bench_e2e.log.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
OUT=${OUT:?set OUT}
STEPS=${STEPS:-tests,micro,e2e}
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv;
  git rev-parse --short HEAD 2>/dev/null; $PY -c 'import torch,triton;print(torch.__version__,triton.__version__)'; } \
  > "$OUT/gpu.txt" 2>&1
if [[ $STEPS == *tests* ]]; then
  timeout ${TEST_TIMEOUT:-150} $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_quant_fused.py \
    tests/test_transport_cuda_batch.py tests/test_transport_gpu.py > "$OUT/pytest_gpu.txt" 2>&1
  tail -4 "$OUT/pytest_gpu.txt"
fi
if [[ $STEPS == *micro* ]]; then
  timeout ${MICRO_TIMEOUT:-240} $PY scripts/bench_gpu.py --out "$OUT/bench_gpu.json" ${MICRO_ARGS:-} \
    > "$OUT/bench_gpu.log" 2>&1
  grep -v "^\[bench_gpu\]" "$OUT/bench_gpu.log" | tail -45
fi
if [[ $STEPS == *e2e* ]]; then
  one="--train tp=1,pp=1,cp=1,ep=1,etp=1,world=1 --rollout tp=1,ep=1,dp=1,engines=1"
  for m in ${MODELS:-Qwen3-4B:full Qwen3-30B-A3B:layers=32 Kimi-K2:layers=2}; do
    name=${m%%:*}; scale=${m#*:}
    echo "== $name $scale" >> "$OUT/bench_e2e.log"
    timeout ${E2E_TIMEOUT:-150} $PY -m weightsync.cli bench "$name" --scale "$scale" $one --device cuda \
      --placement colocated --mode both --repeats ${REPEATS:-5} --out "$OUT/bench_$name.json" >> "$OUT/bench_e2e.log" 2>&1
    echo "== exit $?" >> "$OUT/bench_e2e.log"
  done
  grep -v "^BENCH_JSON" "$OUT/bench_e2e.log" | grep -v "^\s*$" | tail -60
fi
