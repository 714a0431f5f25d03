#!/usr/bin/env bash
# The model-level benchmarks in one device call (after benchmarks/gpu_session.sh installed the
# wheels, or with TEST_GROUPS= BENCH_ARGS= to only install): the whole block (two Llama-3-8B layers,
# forgeax against plain JAX + cuDNN) and the LLM example's 1B step at growing batch sizes for each
# variant until one no longer fits. Logs and JSON lines under $OUT.
#   BLOCK_ARGS   arguments of benchmarks.llama_block (empty: skip)
#   LLM_VARIANTS space-separated --ops settings (default "plain auto")
#   LLM_BATCHES  space-separated batch sizes, smallest first (default "2 4 8 16")
#   LLM_ARGS     further arguments of examples.llm.train (default "--preset 1b --remat --benchmark-steps 10")
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -n "${BLOCK_ARGS-}" ]; then
  eval timeout ${BLOCK_TIMEOUT:-400} python3 -m benchmarks.llama_block $BLOCK_ARGS --out "$OUT/block.json" > "$OUT/block.log" 2>&1
  tail -8 "$OUT/block.log"
fi
for variant in ${LLM_VARIANTS-plain auto}; do
  for batch in ${LLM_BATCHES-2 4 8 16}; do
    log="$OUT/llm_${variant}_b${batch}.log"
    eval timeout ${LLM_TIMEOUT:-300} python3 -m examples.llm.train ${LLM_ARGS---preset 1b --remat --benchmark-steps 10} \
      --ops "$variant" --batch "$batch" --quiet > "$log" 2>&1
    rc=$?
    grep '^{' "$log" | tail -1 >> "$OUT/llm.jsonl"
    echo "llm $variant batch $batch exit $rc: $(grep -o '"tokens_per_second": [0-9.]*' "$log" | tail -1)"
    [ $rc -ne 0 ] && { tail -3 "$log"; break; }  # out of memory (or worse): larger batches will not fit
  done
done
