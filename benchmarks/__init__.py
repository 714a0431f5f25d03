"""GPU benchmark tools for forgeax (not part of the wheel).

Run from the repository root as modules, against an installed forgeax wheel:

    python -m benchmarks.tune_attention --backend pallas_gpu --variant default
    python -m benchmarks.attention_in_program --mode fwd+bwd --layers 4
    python -m benchmarks.attention_kernel_times --backend pallas_gpu
    python -m benchmarks.vocab_parallel --out results.json
    python -m benchmarks.tune_triton_norms --out tune.json
    python -m benchmarks.backward_determinism

`benchmarks.common` holds what they share: random inputs, jitted steps, timing in
interleaved rounds, CUPTI kernel times, result file names. `tools/bench.py` (the side-by-side
table of every backend) uses the same timing. Results go to `benchmarks/results/`, indexed in
`benchmarks/results/INDEX.md`; the method is in `docs/performance.md`.
"""
