#!/usr/bin/env bash
# The self-check's cost table of the README, on one GPU: bench/verify_cost.py once per setting (micro-batches
# on the GPU, in pinned host memory copied early, or read in place; W 1, 4, 8), each in its own process, the
# rows of a setting alternating window by window, then the table (bench/verify_cost_table.py). Each setting
# also profiles BUSY windows a row (default 30; 0: none) for the GPU's busy time (--device-busy).
# Run from the repo root on the GPU machine; JSON, logs and table.md go to ${OUT:-functional_tests/results}/selfcheck_cost.
# Knobs: WINDOWS (timed windows a row, 150), SETTING_TIMEOUT (s, 120), WINDOW_SIZES ("1 4 8"), PATHS (the
# checksum paths, "kernel"; "kernel,torch" times the torch ops in the same processes: a table per path).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
LOG=${OUT:-functional_tests/results}/selfcheck_cost
mkdir -p "$LOG"
status=0
for inputs in device early pinned; do
  for w in ${WINDOW_SIZES:-1 4 8}; do
    name=cost_${inputs}_w$w
    args=(--paths "${PATHS:-kernel}" --windows "${WINDOWS:-150}" --window "$w" --device-busy "${BUSY:-30}" --json "$LOG/$name.json")
    if [ "$inputs" = early ]; then args+=(--inputs pinned --early-copy); else args+=(--inputs "$inputs"); fi
    if ! timeout -k 10 "${SETTING_TIMEOUT:-120}" python3 bench/verify_cost.py "${args[@]}" > "$LOG/$name.log" 2>&1; then
      echo "FAIL $name (log: $LOG/$name.log)"; status=1
    fi
  done
done
paths=${PATHS:-kernel}
if [ "$paths" = "${paths/,/}" ]; then
  python3 bench/verify_cost_table.py "$LOG" | tee "$LOG/table.md" || status=1
else
  for p in ${paths//,/ }; do
    python3 bench/verify_cost_table.py "$LOG" --path "$p" | tee "$LOG/table_$p.md" || status=1
  done
fi
exit $status
