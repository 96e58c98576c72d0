#!/usr/bin/env bash
# The OpenAI-compatible server under load on one GPU (docs/serving.md, "Under load"): random
# Qwen3-0.6B weights served with SmolLM2's tokenizer, 500 ShareGPT-length requests at 8, 32 and 128
# requests/s, then 500 at once (500 concurrent streaming clients). About 5 minutes on an H200.
# Carry .whl/ (fastapi, uvicorn and their dependencies: cp312 wheels) and .smol/ (SmolLM2's
# tokenizer files), both git-ignored, to the GPU host; then:
#   bash benchmarks/serve_gpu.sh OUTDIR stream   # or: whole (answers not streamed: no TTFT/TPOT)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
out=${1:-/tmp/nanovllm-serve}; mode=${2:-stream}; mkdir -p "$out"
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
ulimit -n 65536 2>/dev/null || true  # 500 clients and 500 server sockets
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpus.log"
stream_flag=""; [ "$mode" = whole ] && stream_flag="--no-stream"
server="benchmarks/Qwen3-0.6B --load-format dummy --tokenizer .smol --attn-backend triton"
server="$server --max-model-len 2048 --max-num-seqs 512 --max-waiting-requests 2048"
timeout 540 python3 benchmarks/load_http.py --server "$server" --rate 8 32 128 inf \
  --num-requests 500 --deadline 100 $stream_flag --json "$out/load_$mode.json" \
  > "$out/load_$mode.log" 2>&1
echo "exit status $?" >> "$out/load_$mode.log"
