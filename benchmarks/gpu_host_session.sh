#!/usr/bin/env bash
# One device call on a host with one or more GPUs: install the carried wheels, run the GPU
# conformance tests spread over every GPU (pytest-xdist, tests/conftest.py pins each worker to
# one GPU), then a jobs file (benchmarks/gpu_jobs.py: each job on a free GPU, or on all of them);
# logs and JSON under $OUT. Used as
#   device run (carry dist, .whl): TEST_FILES="norms_test.py rope_test.py" JOBS=benchmarks/jobs/x.txt \
#       bash benchmarks/gpu_host_session.sh
# Knobs: TEST_FILES (names under tests/; empty: no tests), TEST_WORKERS (default 3 per GPU),
# TEST_TIMEOUT (seconds for the whole test run, default 300), TEST_ARGS (more pytest arguments),
# JOBS (a jobs file; empty: none), JOBS_DEADLINE (seconds after the jobs start; default 240).
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "${BASH_SOURCE[0]}")/install_wheels.sh"  # REPO, OUT, /tmp/site
export PYTHONPATH=/tmp/site:$REPO
GPUS=$(nvidia-smi -L | grep -c '^GPU ')
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.csv" 2>&1
python3 -c "import forgeax, jax, triton, jax_triton; print(forgeax.__file__, jax.__version__, triton.__version__, jax.devices())" > "$OUT/env.txt" 2>&1
echo "GPUs: $GPUS"

if [ -n "${TEST_FILES-}" ]; then
  files=$(for f in $TEST_FILES; do echo "$REPO/tests/$f"; done)
  # -v: one line per finished test in the log. At the limit pytest gets SIGINT (as from Ctrl-C) and
  # still prints the failures so far and writes the junit file; SIGKILL 45 s later if it hangs.
  (cd /tmp && FORGEAX_TEST_GPUS=$GPUS timeout -s INT -k 45 ${TEST_TIMEOUT:-300} python3 -m pytest -p no:cacheprovider -v -rfE --tb=short \
     -n $((GPUS * ${TEST_WORKERS:-3})) --dist load --junitxml="$OUT/junit.xml" ${TEST_ARGS-} $files > "$OUT/tests.log" 2>&1
   echo "tests exit $?" >> "$OUT/tests.log")
  echo "tests: $(grep -c ' PASSED ' "$OUT/tests.log") passed, $(grep -c ' FAILED ' "$OUT/tests.log") failed, $(grep -c ' SKIPPED ' "$OUT/tests.log") skipped, $(grep -c ' ERROR ' "$OUT/tests.log") errors; $(tail -1 "$OUT/tests.log")"
  grep -E '^FAILED|^ERROR' "$OUT/tests.log" | cut -c1-300 | head -40
fi

if [ -n "${JOBS-}" ]; then
  python3 "$REPO/benchmarks/gpu_jobs.py" --out "$OUT" --deadline-s "${JOBS_DEADLINE:-240}" "$JOBS"
fi
