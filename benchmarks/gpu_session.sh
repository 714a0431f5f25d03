#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU conformance suites,
# then the benchmarks; logs and JSON under $OUT. Used as
#   device run: bash benchmarks/gpu_session.sh   (carry: dist, .whl)
# Needs: dist/forgeax-*.whl (bazel run //tools:wheel) and .whl/jax_triton-0.3.1-*.whl.
#
# Knobs (environment):
#   TEST_GROUPS  ';'-separated pytest argument lists; each group runs as its own process, all
#                groups in parallel (kernel compilation is CPU-bound: this uses the host's cores),
#                each JAX process limited to a slice of GPU memory. Empty: no tests.
#   BENCH_ARGS   arguments of tools/bench.py, shell-quoted (named shapes have spaces:
#                BENCH_ARGS="--op attention --shape 'causal B4 T4000 N32 H128'"). Empty: none.
#   TEST_MEM_FRACTION  GPU memory per JAX process (default 0.9 / number of groups); set it
#                when a group runs pytest-xdist workers (-n W): about 0.9 / (groups * W).
#   TEST_TIMEOUT / BENCH_TIMEOUT  seconds.
# The other tools run from the repository root the same way, after this script installed the
# wheels: PYTHONPATH=/tmp/site python3 -m benchmarks.tune_attention ... (benchmarks/__init__.py).
# Results: benchmarks/results/<op>_<device>_<date>_<what>.json, one line each in its INDEX.md.
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "${BASH_SOURCE[0]}")/install_wheels.sh"  # REPO, OUT, /tmp/site
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.csv" 2>&1
python3 -c "import forgeax, jax, triton, jax_triton; print(forgeax.__file__, jax.__version__, triton.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"

# 1. Conformance on the GPU: every backend natively (no interpreters).
DEFAULT_GROUPS="$REPO/tests/interface_test.py $REPO/tests/norms_test.py;$REPO/tests/cross_entropy_test.py;$REPO/tests/linear_cross_entropy_test.py"
IFS=';' read -ra GROUPS_ <<< "${TEST_GROUPS-$DEFAULT_GROUPS}"
n=${#GROUPS_[@]}
i=0
for group in "${GROUPS_[@]}"; do
  [ -z "${group// }" ] && continue
  i=$((i + 1))
  (cd /tmp && XLA_PYTHON_CLIENT_MEM_FRACTION=${TEST_MEM_FRACTION:-$(python3 -c "print(round(0.9 / $n, 3))")} \
     eval timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/junit$i.xml" "$group" \
     > "$OUT/tests$i.log" 2>&1; echo "group $i exit $?" >> "$OUT/tests$i.log") &
done
wait
for f in "$OUT"/tests*.log; do echo "== $f"; grep -E "passed|failed|^FAILED|^ERROR|exit" "$f" | tail -15; done

# 2. Benchmarks, side by side with XLA and the anchors, JSON to $OUT.
BENCH=${BENCH_ARGS---op rms_norm --op layer_norm --op cross_entropy --op linear_cross_entropy}
if [ -n "$BENCH" ]; then
  eval timeout ${BENCH_TIMEOUT:-300} python3 tools/bench.py $BENCH --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^  skip" | tail -60
fi
