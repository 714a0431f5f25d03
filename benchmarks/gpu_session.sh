#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU conformance suites,
# then the benchmarks; logs and JSON under $OUT. Used as
#   device run: bash benchmarks/gpu_session.sh   (carry: dist, .whl)
# Needs: dist/forgeax-*.whl (bazel run //tools:wheel) and .whl/jax_triton-0.3.1-*.whl.
set -uo pipefail
export PYTHONUNBUFFERED=1
REPO=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl dist/*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.csv" 2>&1
python3 -c "import forgeax, jax, triton, jax_triton; print(forgeax.__file__, jax.__version__, triton.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"

# 1. Conformance on the GPU: every backend natively (no interpreters).
(cd /tmp && timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs -x --junitxml="$OUT/junit.xml" \
    "$REPO/tests/interface_test.py" ${TESTS:-$REPO/tests/norms_test.py $REPO/tests/cross_entropy_test.py $REPO/tests/linear_cross_entropy_test.py}) 2>&1 | tee "$OUT/tests.log" | tail -25

# 2. Benchmarks, side by side with XLA, JSON to $OUT.
timeout ${BENCH_TIMEOUT:-300} python3 tools/bench.py ${BENCH_ARGS:---op rms_norm --op layer_norm --op cross_entropy --op linear_cross_entropy} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -40
