#!/usr/bin/env bash
# Every GPU figure of the README, in three stages (each fits a 10-minute slot); .gpu/ from
# ../shared/gpu/prepare.sh must be in the repository root (flash-attn is built once, ~2 minutes, and reused):
#   bash benchmarks/run_gpu.sh OUTDIR one   # 1 GPU: GPU tests, bench.py's default workload, flash and triton grid
#   bash benchmarks/run_gpu.sh OUTDIR sdpa  # 1 GPU: the sdpa row of the grid (eager: about 5 minutes)
#   bash benchmarks/run_gpu.sh OUTDIR two   # 2 GPUs: Qwen3-8B and -0.6B on one GPU, then on two (tensor parallelism)
out=${1:-/tmp/nanovllm-gpu}; stage=${2:-one}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source .gpu/build_flash_attn.sh > "$out/build.log" 2>&1 || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpus.log"
if [ "$stage" = one ]; then
  timeout 150 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider > "$out/tests.log" 2>&1
  timeout 200 python3 bench.py --attn-backend flash triton sdpa > "$out/bench.log" 2>&1
  timeout 150 python3 bench.py --table --batches 1 8 64 --attn-backend flash triton > "$out/grid.log" 2>&1
elif [ "$stage" = sdpa ]; then
  timeout 540 python3 bench.py --table --batches 1 8 64 --attn-backend sdpa > "$out/grid_sdpa.log" 2>&1
else
  (export CUDA_VISIBLE_DEVICES=0
   timeout 150 python3 bench.py --attn-backend flash --arch Qwen3-8B
   timeout 80 python3 bench.py --attn-backend flash) > "$out/tp1.log" 2>&1
  (timeout 90 python3 benchmarks/tp_check.py
   timeout 90 python3 bench.py --attn-backend flash --tp 2
   timeout 150 python3 bench.py --attn-backend flash --arch Qwen3-8B --tp 2) > "$out/tp2.log" 2>&1
fi
echo done >> "$out/gpus.log"
