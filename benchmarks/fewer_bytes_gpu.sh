#!/usr/bin/env bash
# Reading fewer bytes, end to end, in one call (about 7 minutes on an H100; no flash-attn):
#   bash benchmarks/fewer_bytes_gpu.sh OUTDIR
# bench.log   bench.py, triton: nano-vllm's workload with the bf16 and the FP8 cache; shared-prefix,
#             n8 and nano-vllm's workload (no sharing) with cascade attention off and on
# host.log    benchmarks/host_parts.py: the host's time per decode step by part (batch 256 with
#             each cache; n8 with cascade on), to tell a GPU-bound step from a host-bound one
out=${1:-/tmp/nanovllm-fewer-bytes}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/bench.log"
b() { timeout 170 python3 bench.py --attn-backend triton "$@" 2>&1 | grep "^| triton\|Error" | awk '!seen[$0]++'; }
b --kv-cache-dtype auto fp8 | tee -a "$out/bench.log"
for workload in shared-prefix n8 nano-vllm; do
  b --workload $workload --cascade off on | tee -a "$out/bench.log"
done
for args in "" "--kv-cache-dtype fp8" "--sharing n8"; do
  timeout 120 python3 benchmarks/host_parts.py $args 2>&1 \
    | grep "^NVIDIA\|^| \(LLM\|Sched\|Model\|CUDA\|Cascade\)\|audit" | tee -a "$out/host.log"
done
