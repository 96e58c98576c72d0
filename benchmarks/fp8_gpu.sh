#!/usr/bin/env bash
# The FP8 KV cache's GPU figures in one run (about 5 minutes on an H100 or H200; no flash-attn):
#   bash benchmarks/fp8_gpu.sh OUTDIR
# fp8_tests.log     tests/test_fp8.py, kernels compiled (the SmolLM2 test needs the Hub: deselected)
# fp8_bench.log     bench.py, nano-vllm's workload: triton with the bf16 cache, then the FP8 cache
# fp8_kernels.log   benchmarks/bench_kernels.py --quick: decode, prefill rows; bf16 and FP8 caches
# fp8_accuracy.log  benchmarks/fp8_accuracy.py: teacher-forced logits of bf16, FP8 caches vs fp32
out=${1:-/tmp/nanovllm-fp8}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/fp8_gpus.log"
timeout 100 python3 -m pytest -q tests/test_fp8.py -k "not real_weights" -p no:cacheprovider \
  > "$out/fp8_tests.log" 2>&1
timeout 170 python3 bench.py --attn-backend triton --kv-cache-dtype auto fp8 \
  > "$out/fp8_bench.log" 2>&1
timeout 100 python3 benchmarks/bench_kernels.py --quick > "$out/fp8_kernels.log" 2>&1
timeout 110 python3 benchmarks/fp8_accuracy.py > "$out/fp8_accuracy.log" 2>&1
echo done >> "$out/fp8_gpus.log"
