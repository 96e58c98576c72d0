#!/usr/bin/env bash
# Every GPU figure of the README in one run on a 2-GPU machine (each stage under its own time limit):
#   bash benchmarks/run_gpu.sh OUTDIR      (.gpu/ from ../shared/gpu/prepare.sh must be in the repo root)
# GPU 0: teacher-forced logits tests, then bench.py's default workload for flash, triton and sdpa.
# GPU 1: the --table grid and the flash logits tests. Then both GPUs: tensor parallelism.
out=${1:-/tmp/nanovllm-gpu}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FA=/tmp/fa_build/src
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu0.log"
(export MAX_JOBS=24; source .gpu/build_flash_attn.sh > "$out/build.log" 2>&1; touch /tmp/fa_done) &
wait_fa() { while [ ! -f /tmp/fa_done ]; do sleep 2; done; }
(export CUDA_VISIBLE_DEVICES=0
 timeout 150 python3 -m pytest -q tests/test_gpu.py -k "not flash" -p no:cacheprovider
 wait_fa
 PYTHONPATH=$FA:$PYTHONPATH timeout 180 python3 bench.py --attn-backend flash triton sdpa
) >> "$out/gpu0.log" 2>&1 &
gpu0=$!
(export CUDA_VISIBLE_DEVICES=1
 timeout 200 python3 bench.py --table --attn-backend triton sdpa --batches 1 8 64 --lengths 512 1024 2048
 wait_fa
 PYTHONPATH=$FA:$PYTHONPATH timeout 70 python3 -m pytest -q tests/test_gpu.py -k "flash" -p no:cacheprovider
 PYTHONPATH=$FA:$PYTHONPATH timeout 70 python3 bench.py --table --attn-backend flash --batches 1 8 64 --lengths 512 1024 2048
) > "$out/gpu1.log" 2>&1 &
gpu1=$!
wait $gpu0 $gpu1
export PYTHONPATH=$FA:$PYTHONPATH
timeout 70 python3 benchmarks/tp_check.py > "$out/tp.log" 2>&1
timeout 80 python3 bench.py --attn-backend flash --tp 2 >> "$out/tp.log" 2>&1
echo done >> "$out/tp.log"
