#!/usr/bin/env bash
# Mutation score of the pure core: mutmut 3.8.1 (pyproject.toml [tool.mutmut]: the mutated files and
# the fast tests), then ci/mutation/summary.md and summary.json (per file: the run that judged it,
# killed, survived, timeout, the reviewed survivors by category (ci/mutation/equivalent.txt,
# another_plan.txt, rounding.txt, cuda_only.txt), and the score).
#
#   ci/mutation.sh                           every mutant, from scratch (mutants/ is removed first)
#   ci/mutation.sh 'reorder.plan.grid.*'     only these mutants (mutmut name globs), keeping the
#                                            verdicts of the others in mutants/; summary over all (a
#                                            file whose mutants the globs leave out keeps the row of
#                                            the run that judged it, with the mutants judged again)
#   MUTATION_JOBS=16 ci/mutation.sh          parallel workers (default 1: one core)
#   MUTATION_RESUME=1 ci/mutation.sh         go on with the mutants that have no verdict yet (after an
#                                            interrupted run)
#   MUTATION_COMMIT=abc1234 ...              the commit named in the summary (default: git rev-parse HEAD)
#   MUTATION_TIME_LIMIT=840 ...              stop mutmut after that many seconds (SIGINT: verdicts so far
#                                            are kept), then write the summary: long runs in chunks
#
# Needs mutmut: .venv/bin/pip install mutmut==3.8.1 (or from wheels: pip install --no-index -f .wheels mutmut==3.8.1).
# CI=1 makes hypothesis derandomized and database-free, so the verdicts do not depend on the run.
# A glob run keeps mutants/mutmut-stats.json, whose map of tests to functions mutmut updates only for
# tests it has not seen: after a function is replaced (a new one that old tests reach through a caller),
# remove that file first, or the new function's mutants run against the new tests alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MUTMUT=${MUTMUT:-$(dirname "$PY")/mutmut}
export CI=1 HYPOTHESIS_PROFILE=ci OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONHASHSEED=0
[ $# -eq 0 ] && [ -z "${MUTATION_RESUME:-}" ] && rm -rf mutants
"$PY" ci/mutation_sample.py prepare  # a file added to only_mutate since mutants/ was made gets mutated too
start=$(date +%s)
log=${MUTATION_LOG:-/tmp/mutmut-run.log}
rc=0
limit=()
[ -n "${MUTATION_TIME_LIMIT:-}" ] && limit=(timeout -s INT -k 60 "$MUTATION_TIME_LIMIT")
"${limit[@]}" "$MUTMUT" run --max-children "${MUTATION_JOBS:-1}" "$@" >"$log" 2>&1 || rc=$?
if [ $rc -eq 124 ]; then
    echo "mutmut run stopped at MUTATION_TIME_LIMIT=$MUTATION_TIME_LIMIT s; MUTATION_RESUME=1 goes on"
elif [ $rc -ne 0 ]; then
    tail -c 4000 "$log" | tr '\r' '\n' | tail -40; echo "mutmut run failed (exit $rc, log: $log)"
fi
grep -a 'mutations/second' "$log" || true
"$PY" ci/mutation_sample.py summary --seconds $(( $(date +%s) - start )) --jobs "${MUTATION_JOBS:-1}" -- "$@"
exit $rc
