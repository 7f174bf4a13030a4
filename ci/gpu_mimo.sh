#!/usr/bin/env bash
# Real-model MIMO suite on the GPU machine: run from the repo root with megatron-core >= 0.17
# importable (e.g. the carried 0.19.2 wheel installed into /tmp/site). Every job names its rank count
# (colocated jobs 2; noncoloc 1 encoder + 1 language rank; hetero 2 + 4 = 6 and 1 + 2 = 3); ranks
# beyond the GPU count share the GPUs (bench/common.py's shared-GPU mode: one H200 is enough).
# Jobs run concurrently (the model is tiny: each job is launch-bound, not GPU-bound); each has a hard
# timeout. Output under ${OUT:-functional_tests/results}: mimo_summary.txt, and the jobs' logs and JSON
# results in mimo_logs/, packed into mimo_logs.tar.gz unless TAR_LOGS=0 (two files in all: the device
# machine returns only a few).
# Every job runs reorder on with the runtime self-check every VERIFY-th window (--verify; default 1:
# every window; 0 off): a mismatch raises on every rank and fails the job.
# Knobs: SOAK_ITERS (1000), SOAK_SECONDS (per-combo cap, s), PARITY_ITERS (30), HETERO_ITERS (10: noncoloc
# and hetero, each followed by a resume of as many iterations), HETERO_SOAK_ITERS (300), JOB_TIMEOUT (s).
# MIMO_SET picks the batch: base (default: the jobs above), tp_pp (tensor and pipeline parallelism:
# reorder off vs on with loss parity, image-embedding checksums across the bridge, TP peers
# byte-identical, PP stages in one order, bit-identical resume), tp_pp_soak (their soaks, overlap on
# and off as separate jobs soak_<layout>_on / _off, TP_PP_SOAK_ITERS iterations each, 300 by default; two CUDA_DEVICE_MAX_CONNECTIONS=1 soaks,
# TP and PP, where overlap must be refused), or all. The TP/PP layouts (ranks):
#   coloc_tp2   colocated tp 2 x dp 2, the encoder on the same grid                      4
#   tp2         encoder dp 2 + language tp 2 x dp 2                                      2 + 4 = 6
#   pp2         encoder dp 2 + language pp 2 x dp 2 (1F1B, P2P between the stages)        2 + 4 = 6
#   enctp2      encoder tp 2 x dp 2 + language dp 4 (fan-out 2)                          4 + 4 = 8
#   combo       encoder tp 2 x dp 1 + language pp 3 x dp 2 (fan-out 2, a middle stage)   2 + 6 = 8
#   tp2pp2      encoder dp 2 + language tp 2 x pp 2 x dp 2 (only with TP_PP_WIDE=1)     2 + 8 = 10
# MAX_RANKS holds a job back until the running jobs' ranks leave room for it (default 24 a GPU: the whole
# set at once, 31 jobs, put over 150 ranks on one H200 and most of them ran out of memory; 0: no limit); ONLY (an
# extended regex) runs the jobs whose names match, e.g. ONLY='soak_(pp2|combo)'. DEADLINE (s, from the
# start) cuts every job's timeout so that all end by then and the summary and the tar are still
# written (a machine lent for a fixed time returns only what is written); a job that would start
# with under 60 s left is skipped and said so in rc.txt. A soak prints its progress every 50
# iterations, so a job stopped by its timeout still shows how far it got.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export CUBLAS_WORKSPACE_CONFIG=:4096:8
LOG=${OUT:-functional_tests/results}
mkdir -p "$LOG/mimo_logs"
SOAK_ITERS=${SOAK_ITERS:-1000}
SOAK_SECONDS=${SOAK_SECONDS:-140}
PARITY_ITERS=${PARITY_ITERS:-30}
HETERO_ITERS=${HETERO_ITERS:-10}
HETERO_SOAK_ITERS=${HETERO_SOAK_ITERS:-300}
JOB_TIMEOUT=${JOB_TIMEOUT:-480}
VERIFY=${VERIFY:-1}
DEV=${DEVICE:-cuda}  # DEVICE=cpu: rehearse on Gloo with CPU shims (debugging; no CDMC refusal check)
SUITE=functional_tests/mimo_suite.py
${PYTHON:-python3} -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())" \
  > "$LOG/mimo_logs/versions.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG/mimo_logs/versions.txt" 2>/dev/null
MIMO_SET=${MIMO_SET:-base}
GPUS=$(${PYTHON:-python3} -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
MAX_RANKS=${MAX_RANKS:-$(( 24 * (GPUS > 0 ? GPUS : 1) ))}
TP_PP_SOAK_ITERS=${TP_PP_SOAK_ITERS:-300}
case "$MIMO_SET" in base|tp_pp|tp_pp_soak|all) ;; *) echo "MIMO_SET=$MIMO_SET: base, tp_pp, tp_pp_soak or all" >&2; exit 2 ;; esac
declare -A RUNNING=()  # pid -> ranks of the jobs started
running_ranks() {
  local used=0 pid
  for pid in "${!RUNNING[@]}"; do kill -0 "$pid" 2>/dev/null && used=$(( used + RUNNING[$pid] )); done
  echo $used
}
START=$(date +%s)
job() {  # name, ranks, suite arguments... ; runs in the background (JOB_ENV: extra VAR=value settings)
  local name=$1 nproc=$2 limit=$JOB_TIMEOUT left; shift 2
  if [ -n "${ONLY:-}" ] && ! [[ $name =~ ^($ONLY)$ ]]; then return; fi
  if [ "$MAX_RANKS" -gt 0 ]; then
    while used=$(running_ranks) && [ "$used" -gt 0 ] && [ $(( used + nproc )) -gt "$MAX_RANKS" ]; do sleep 2; done
  fi
  if [ -n "${DEADLINE:-}" ]; then
    left=$(( START + DEADLINE - $(date +%s) ))
    if [ "$left" -lt 60 ]; then echo "$name rc=skipped ${left}s left before DEADLINE" >> "$LOG/mimo_logs/rc.txt"; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  ( t0=$(date +%s)
    env ${JOB_ENV:-} timeout -k 10 "$limit" torchrun --standalone --nproc-per-node "$nproc" $SUITE "$@" \
      --device "$DEV" --verify "$VERIFY" --json "$LOG/mimo_logs/$name.json" > "$LOG/mimo_logs/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(( $(date +%s) - t0 ))s ranks=$nproc" >> "$LOG/mimo_logs/rc.txt" ) &
  RUNNING[$!]=$nproc
}
if [ "$MIMO_SET" = base ] || [ "$MIMO_SET" = all ]; then
job parity     2 parity --iters "$PARITY_ITERS"
job resume     2 resume --resume-at 5 --iters 5 --windows 2 --overlaps on --dataset 48
job noncoloc   2 noncoloc --iters "$HETERO_ITERS"
job hetero_2x4 6 hetero --encoder-dp 2 --language-dp 4 --iters "$HETERO_ITERS"
job hetero_1x2 3 hetero --encoder-dp 1 --language-dp 2 --iters "$HETERO_ITERS"
for w in 0 0.5; do  # 12 combos in 6 jobs of 2 (overlap on, then off)
  for win in 1 2 4; do
    job "soak_w${w}_W${win}" 2 soak --micro-batches 1 --iters "$SOAK_ITERS" --windows $win --overlaps on off \
        --weights $w --combo-seconds "$SOAK_SECONDS"
  done
done
JOB_ENV=CUDA_DEVICE_MAX_CONNECTIONS=1 job soak_cdmc1 2 soak --micro-batches 1 --iters "$SOAK_ITERS" --windows 2 \
    --overlaps off --weights 0.5 --combo-seconds $(( SOAK_SECONDS * 2 ))
job soak_hetero_2x4 6 soak --encoder-dp 2 --language-dp 4 --iters "$HETERO_SOAK_ITERS" --windows 2 --overlaps on off \
    --weights 0.5 --combo-seconds "$SOAK_SECONDS"
fi
# the TP/PP layouts: name, ranks, layout arguments
TP_PP_LAYOUTS=(
  "coloc_tp2 4 --language-tp 2"
  "tp2 6 --encoder-dp 2 --language-tp 2 --language-dp 2"
  "pp2 6 --encoder-dp 2 --language-pp 2 --language-dp 2"
  "enctp2 8 --encoder-tp 2 --encoder-dp 2 --language-dp 4"
  "combo 8 --encoder-tp 2 --encoder-dp 1 --language-pp 3 --language-dp 2"
)
if [ "${TP_PP_WIDE:-0}" = 1 ]; then  # language TP and PP with DP 2 needs more than 8 ranks
  TP_PP_LAYOUTS+=("tp2pp2 10 --encoder-dp 2 --language-tp 2 --language-pp 2 --language-dp 2")
fi
if [ "$MIMO_SET" = tp_pp ] || [ "$MIMO_SET" = all ]; then
  for spec in "${TP_PP_LAYOUTS[@]}"; do
    read -r name nproc layout <<< "$spec"
    if [ "$name" = coloc_tp2 ]; then  # colocated: parity and resume are separate tests
      job "parity_$name" "$nproc" parity $layout --iters "$PARITY_ITERS"
      job "resume_$name" "$nproc" resume $layout --resume-at 5 --iters 5 --windows 2 --overlaps on --dataset 48
    else  # non-colocated: off vs on, checksums, the misaligned control, then a resume
      job "hetero_$name" "$nproc" hetero $layout --iters "$HETERO_ITERS"
    fi
  done
fi
if [ "$MIMO_SET" = tp_pp_soak ] || [ "$MIMO_SET" = all ]; then
  for spec in "${TP_PP_LAYOUTS[@]}"; do
    read -r name nproc layout <<< "$spec"
    for ov in on off; do  # one job each: a 300-iteration soak of a wide layout fills a launcher's slot
      job "soak_${name}_$ov" "$nproc" soak $layout --iters "$TP_PP_SOAK_ITERS" --windows 2 --overlaps $ov \
          --weights 0.5 --combo-seconds "$SOAK_SECONDS"
    done
  done
  # overlap refused under CUDA_DEVICE_MAX_CONNECTIONS=1 (what megatron recommends with TP), then the
  # synchronous exchange next to the TP collectives, and next to the 1F1B schedule's P2P
  JOB_ENV=CUDA_DEVICE_MAX_CONNECTIONS=1 job soak_tp2_cdmc1 6 soak --encoder-dp 2 --language-tp 2 --language-dp 2 \
      --iters "$TP_PP_SOAK_ITERS" --windows 2 --overlaps off --weights 0.5 --combo-seconds $(( SOAK_SECONDS * 2 ))
  JOB_ENV=CUDA_DEVICE_MAX_CONNECTIONS=1 job soak_pp2_cdmc1 6 soak --encoder-dp 2 --language-pp 2 --language-dp 2 \
      --iters "$TP_PP_SOAK_ITERS" --windows 2 --overlaps off --weights 0.5 --combo-seconds $(( SOAK_SECONDS * 2 ))
fi
wait
${PYTHON:-python3} functional_tests/mimo_suite.py --summarize "$LOG/mimo_logs" > "$LOG/mimo_summary.txt" 2>&1
status=$?
cat "$LOG/mimo_summary.txt"
if [ "${TAR_LOGS:-1}" = 1 ]; then
  tar -czf "$LOG/mimo_logs.tar.gz" -C "$LOG" mimo_logs && rm -rf "$LOG/mimo_logs"
fi
exit $status
