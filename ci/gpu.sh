#!/usr/bin/env bash
# Multi-rank NCCL suite for NPROC ranks (default 2) on however many GPUs the machine has: rank r uses
# GPU r mod count, and when ranks outnumber GPUs each gets its own NCCL host id (shared-GPU mode:
# bench.common.rank_device; it proves function, never speed). Run from the repo root on the GPU
# machine; logs go to ${OUT:-functional_tests/results}/gpu_n$NPROC. MIMO=1 also runs ci/gpu_mimo.sh.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
N=${NPROC:-2}
LOG=${OUT:-functional_tests/results}/gpu_n$N
mkdir -p "$LOG"
: > "$LOG/summary.txt"
status=0
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  if timeout -k 10 "${JOB_TIMEOUT:-540}" "$@" > "$LOG/$name.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
  echo "$r n$N $name ($(( $(date +%s) - t0 )) s): $(grep -h RESULT "$LOG/$name.log" | tail -1 | cut -c1-400)" \
    | tee -a "$LOG/summary.txt"
}
TR="torchrun --standalone --nproc-per-node $N"
SUITE="functional_tests/gloo_suite.py --vision-dp 0 --language-dp $N --device cuda --timeout 300"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$LOG/device.txt" 2>&1
# W 1..3 x overlap on/off, half the micro-batches pinned, half pageable: one launch, one set of groups
run nccl_matrix $TR $SUITE --matrix --windows 1 2 3 --input-kinds mixed --micro-batch $((4 * N)) --micro-batches 7 \
    --features 64 --seq-len 512
run nccl_langweight $TR $SUITE --window 2 --language-weight 0.5 --micro-batches 9 --micro-batch $((2 * N))
for case in source_raises bad_input early_end; do
  run "nccl_fault_${case}" $TR $SUITE --case $case --micro-batch $((2 * N))
done
run lifetime $TR functional_tests/lifetime_cuda.py
run bridge_cuda $TR functional_tests/bridge_cuda.py --device cuda --micro-batch $((4 * N)) --seq-len 2048 --features 256
run cdmc1_no_overlap env CUDA_DEVICE_MAX_CONNECTIONS=1 $TR $SUITE --window 2 --no-overlap --micro-batches 40 \
    --micro-batch $((2 * N))
# the exchange benchmark from pinned host batches (its figures mean something only with a GPU per rank)
[ "${BENCH:-1}" = 1 ] && run bench_exchange $TR bench/exchange_gpu.py --per-rank 8 32 --windows 1 4 \
    ${BENCH_ARGS:---seq-len 1024 --features 256 --matmul 2048 --compute-ms 20} --json "$LOG/exchange_gpu.json"
if [ "${MIMO:-0}" = 1 ]; then
  if python3 -c "import megatron.core" 2>/dev/null; then
    run mimo_suite bash ci/gpu_mimo.sh
  else
    echo "FAIL mimo_suite: megatron.core not importable (carry .whl/megatron_core-0.19.2-*.whl)" | tee -a "$LOG/summary.txt"
    status=1
  fi
fi
exit $status
