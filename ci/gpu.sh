#!/usr/bin/env bash
# GPU suite (2 GPUs, NCCL): run from the repo root on the GPU machine; logs go to ${OUT:-functional_tests/results}.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
LOG=${OUT:-functional_tests/results}
mkdir -p "$LOG"
N=${NPROC:-2}
status=0
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  if "$@" > "$LOG/$name.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
  echo "$r $name ($(( $(date +%s) - t0 )) s): $(grep -h RESULT "$LOG/$name.log" | tail -1)" | tee -a "$LOG/summary.txt"
}
TR="torchrun --standalone --nproc-per-node $N"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$LOG/device.txt" 2>&1
for w in 1 2 3; do
  for ov in --overlap --no-overlap; do
    run "nccl_dp${N}_w${w}${ov}" $TR functional_tests/gloo_suite.py --vision-dp 0 --language-dp $N --device cuda \
        --window $w $ov --micro-batch 8 --micro-batches 7 --features 64 --seq-len 512
  done
done
run nccl_langweight $TR functional_tests/gloo_suite.py --vision-dp 0 --language-dp $N --device cuda --window 2 \
    --language-weight 0.5 --micro-batches 9
for case in source_raises bad_input early_end; do
  run "nccl_fault_${case}" $TR functional_tests/gloo_suite.py --vision-dp 0 --language-dp $N --device cuda --case $case \
      --timeout 60
done
run dp1_cuda python3 functional_tests/dp1_cuda.py --device cuda
run executors_cuda python3 functional_tests/executors_cuda.py
run bridge_cuda $TR functional_tests/bridge_cuda.py --device cuda
run cdmc1_overlap_refused env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 -c "
import torch
from reorder.runtime.buffer import check_overlap_allowed
try:
    check_overlap_allowed(torch.device('cuda', 0)); raise SystemExit('not refused')
except ValueError as e:
    print('RESULT refused:', e)"
run cdmc1_no_overlap env CUDA_DEVICE_MAX_CONNECTIONS=1 $TR functional_tests/gloo_suite.py --vision-dp 0 \
    --language-dp $N --device cuda --window 2 --no-overlap --micro-batches 40
[ "${BENCH:-1}" = 1 ] && run bench_exchange $TR bench/exchange_gpu.py --per-rank 8 32 --windows 1 4 --json "$LOG/exchange_gpu.json"
# Megatron-Core MIMO suite (needs megatron-core 0.19.2 importable, e.g. the carried wheel on PYTHONPATH)
if python3 -c "import megatron.core" 2>/dev/null; then
  run mimo_suite bash ci/gpu_mimo.sh
else
  echo "FAIL mimo_suite: megatron.core not importable (carry .whl/megatron_core-0.19.2-*.whl)" | tee -a "$LOG/summary.txt"
  status=1
fi
cat "$LOG/summary.txt"
exit $status
