export TEST_GROUPS=""
export BENCH_ARGS="--op attention --shape 'causal H256 B2 T4096 N16' --shape 'gemma2 soft cap 50 H256 B2 T4096 N16 KV8' --backend pallas_gpu --backend triton --backend default --anchor cudnn --anchor jax_nn_xla --calls 10 --reps 5"
export BENCH_TIMEOUT=420
bash benchmarks/gpu_session.sh
