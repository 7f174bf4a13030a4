#!/usr/bin/env bash
# Everything that needs several NCCL ranks, on the GPUs this machine has (one is enough): ranks beyond
# the GPU count share them (bench.common.rank_device: one NCCL host id per rank; function, not speed).
# Run from the repo root on the GPU machine; logs go to ${OUT:-functional_tests/results}/shared/, the
# summary to shared/summary.txt, and with TAR_LOGS=1 the logs are packed into shared_logs.tar.gz.
#   PHASES="lifetime gpu hetero"  (default: all three; mimo needs megatron-core: PHASES=mimo)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
ROOT=${OUT:-functional_tests/results}
LOG=$ROOT/shared
mkdir -p "$LOG"
SUMMARY=$LOG/summary.txt
job() {  # name, command... ; in the background, one summary line when it ends
  local name=$1; shift
  ( t0=$(date +%s)
    if timeout -k 10 "${JOB_TIMEOUT:-540}" "$@" > "$LOG/$name.log" 2>&1; then r=PASS; else r=FAIL; fi
    echo "$r $name ($(( $(date +%s) - t0 )) s): $(grep -h RESULT "$LOG/$name.log" | tail -1 | cut -c1-400)" >> "$SUMMARY" ) &
}
GLOO="functional_tests/gloo_suite.py --device cuda --timeout 300 --matrix --windows 1 2 3 4 --input-kinds device pinned pageable"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$LOG/device.txt" 2>&1
for phase in ${PHASES:-lifetime gpu hetero}; do
  case $phase in
    lifetime)  # fresh pinned batches behind a delayed stream: dp 1 and shared-GPU dp 2, 4, 8
      job lifetime_dp1 python3 functional_tests/lifetime_cuda.py
      for n in 2 4 8; do job "lifetime_dp$n" torchrun --standalone --nproc-per-node $n functional_tests/lifetime_cuda.py; done
      job selfcheck_defect_dp1 python3 functional_tests/lifetime_cuda.py --defect  # the self-check catches it
      job selfcheck_defect_dp4 torchrun --standalone --nproc-per-node 4 functional_tests/lifetime_cuda.py --defect
      # the overlap thread next to a loop that synchronizes the device, consumed in a chain (pipeline-like)
      for n in 2 4; do job "overlap_sync_n$n" torchrun --standalone --nproc-per-node $n functional_tests/overlap_sync_cuda.py; done
      job cdmc1_overlap_refused env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 -c "
import torch
from reorder.runtime.buffer import check_overlap_allowed
try:
    check_overlap_allowed(torch.device('cuda', 0)); raise SystemExit('not refused')
except ValueError as e:
    print('RESULT refused:', e)" ;;
    gpu)  # ci/gpu.sh at 2, 4 and 8 ranks
      for n in 2 4 8; do job "gpu_n$n" env NPROC=$n OUT="$LOG" bash ci/gpu.sh; done ;;
    hetero)  # vision + language worlds: W 1..4 x overlap x inputs on the device, pinned, pageable; two with
      # the runtime self-check (every window, every 2nd), and a corrupted exchange every rank of its module reports
      job hetero_1_2 torchrun --standalone --nproc-per-node 3 $GLOO --vision-dp 1 --language-dp 2 --micro-batch 8
      job hetero_2_4_verify1 torchrun --standalone --nproc-per-node 6 $GLOO --vision-dp 2 --language-dp 4 --micro-batch 8 --verify 1
      job hetero_2_6 torchrun --standalone --nproc-per-node 8 $GLOO --vision-dp 2 --language-dp 6 --micro-batch 12
      job hetero_4_4_verify2 torchrun --standalone --nproc-per-node 8 $GLOO --vision-dp 4 --language-dp 4 --micro-batch 8 --verify 2
      job corrupt_2_4 torchrun --standalone --nproc-per-node 6 functional_tests/gloo_suite.py --device cuda --timeout 120 \
          --vision-dp 2 --language-dp 4 --micro-batch 8 --case corrupt --verify 1 ;;
    mimo)
      job mimo env OUT="$LOG" TAR_LOGS=1 bash ci/gpu_mimo.sh ;;
  esac
  wait
done
sort "$SUMMARY" -o "$SUMMARY"
cat "$LOG"/gpu_n*/summary.txt >> "$SUMMARY" 2>/dev/null
cat "$SUMMARY"
if [ "${TAR_LOGS:-0}" = 1 ]; then
  cp "$SUMMARY" "$ROOT/shared_summary.txt" && tar -czf "$ROOT/shared_logs.tar.gz" -C "$ROOT" shared && rm -rf "$LOG"
  SUMMARY=$ROOT/shared_summary.txt
fi
! grep -q "^FAIL" "$SUMMARY"
