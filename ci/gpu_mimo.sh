#!/usr/bin/env bash
# Real-model MIMO suite on 2 GPUs: run from the repo root on the GPU machine, with
# megatron-core >= 0.17 importable (e.g. the carried 0.19.2 wheel installed into /tmp/site).
# Jobs run concurrently (the model is tiny: each job is launch-bound, not GPU-bound); each has a hard
# timeout. Logs and JSON results go to ${OUT:-functional_tests/results}; the summary to mimo_summary.txt.
# Knobs: SOAK_ITERS (1000), SOAK_SECONDS (per-combo cap, s), PARITY_ITERS (30), JOB_TIMEOUT (s).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export CUBLAS_WORKSPACE_CONFIG=:4096:8
LOG=${OUT:-functional_tests/results}
mkdir -p "$LOG/mimo_logs"
SOAK_ITERS=${SOAK_ITERS:-1000}
SOAK_SECONDS=${SOAK_SECONDS:-140}
PARITY_ITERS=${PARITY_ITERS:-30}
JOB_TIMEOUT=${JOB_TIMEOUT:-480}
DEV=${DEVICE:-cuda}  # DEVICE=cpu: rehearse on Gloo with CPU shims (debugging; no CDMC refusal check)
SUITE=functional_tests/mimo_suite.py
TR="torchrun --standalone --nproc-per-node 2"
${PYTHON:-python3} -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())" \
  > "$LOG/mimo_logs/versions.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG/mimo_logs/versions.txt" 2>/dev/null
job() {  # name, env/command... ; runs in the background
  local name=$1; shift
  ( t0=$(date +%s)
    timeout -k 10 "$JOB_TIMEOUT" "$@" --device "$DEV" --json "$LOG/mimo_logs/$name.json" > "$LOG/mimo_logs/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(( $(date +%s) - t0 ))s" >> "$LOG/mimo_logs/rc.txt" ) &
}
job parity     $TR $SUITE parity --iters "$PARITY_ITERS"
job resume     $TR $SUITE resume --resume-at 5 --iters 5 --windows 2 --overlaps on --dataset 48
job noncoloc   $TR $SUITE noncoloc --iters 10
for w in 0 0.5; do  # 12 combos in 6 jobs of 2 (overlap on, then off)
  for win in 1 2 4; do
    job "soak_w${w}_W${win}" $TR $SUITE soak --micro-batches 1 --iters "$SOAK_ITERS" --windows $win --overlaps on off \
        --weights $w --combo-seconds "$SOAK_SECONDS"
  done
done
job soak_cdmc1 env CUDA_DEVICE_MAX_CONNECTIONS=1 $TR $SUITE soak --micro-batches 1 --iters "$SOAK_ITERS" --windows 2 \
    --overlaps off --weights 0.5 --combo-seconds $(( SOAK_SECONDS * 2 ))
wait
${PYTHON:-python3} functional_tests/mimo_suite.py --summarize "$LOG/mimo_logs" > "$LOG/mimo_summary.txt" 2>&1
status=$?
cat "$LOG/mimo_summary.txt"
if [ "${TAR_LOGS:-0}" = 1 ]; then  # few files come back from the device machine: pack the logs
  tar -czf "$LOG/mimo_logs.tar.gz" -C "$LOG" mimo_logs && rm -rf "$LOG/mimo_logs"
fi
exit $status
