#!/usr/bin/env bash
# One-GPU suite: what a single GPU can prove and measure (both executors byte-exact, the self-check's
# checksum kernel bit for bit against the torch ops, dp-1 windows, timed_step's CUDA events, the
# calibration's fitted gain on the benchmark ViT,
# the Megatron-Bridge drop-in at dp 1, host time and ops of a window and of its parts, executor
# bandwidth, planning at dp 64 and 1024, which host calls wait for the whole device). Run from the repo
# root on the GPU machine; logs and JSON go to ${OUT:-functional_tests/results}. The two-GPU suite is ci/gpu.sh.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
LOG=${OUT:-functional_tests/results}
mkdir -p "$LOG"
status=0
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  if "$@" > "$LOG/$name.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
  echo "$r $name ($(( $(date +%s) - t0 )) s): $(grep -h "RESULT\|'ok'" "$LOG/$name.log" | tail -1)" | tee -a "$LOG/summary_single_gpu.txt"
}
nvidia-smi --query-gpu=name,memory.total --format=csv > "$LOG/device.txt" 2>&1
run executors_cuda python3 functional_tests/executors_cuda.py
run dp1_cuda python3 functional_tests/dp1_cuda.py --device cuda
run batch_cuda python3 functional_tests/batch_cuda.py
run bridge_cuda python3 functional_tests/bridge_cuda.py --device cuda
run single_gpu python3 bench/single_gpu.py --out "$LOG/single_gpu.json"
run host_parts python3 bench/host_parts.py --out "$LOG/host_parts.json"
run executors_bench python3 bench/executors.py --out "$LOG/executors.json"
run checksum_cuda python3 functional_tests/checksum_cuda.py
run device_waits python3 functional_tests/device_waits_cuda.py
run verify_cost python3 bench/verify_cost.py --json "$LOG/verify_cost.json"
run calibrate_cuda python3 functional_tests/calibrate_cuda.py
run calibrate_vit python3 bench/calibrate_vit.py --json "$LOG/calibrate_vit.json"
cat "$LOG/summary_single_gpu.txt"
exit $status
