#!/usr/bin/env bash
# Nsight Compute on the decode kernel, bf16 then FP8 cache (batch 256, context 1024, Qwen3-0.6B's
# heads), on a GPU host that has ncu (the H200 hosts do; ncu locks the clocks near 1.35 GHz):
#   bash benchmarks/ncu_decode.sh > OUT.log
export PYTHONPATH=$PWD
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -z "$NCU" ] && { echo "no ncu on this host"; exit 1; }
prog=$(mktemp --suffix .py)
cat > "$prog" <<'PY'
import sys
import torch
sys.path.insert(0, "benchmarks")
from bench_kernels import make_pool
from nanovllm.attention.fp8 import quantize
from nanovllm.kernels.decode import decode_attention
B, ctx, Hq, Hk, D = 256, 1024, 16, 8, 128
kc, vc, tables = make_pool(1, B, ctx, Hk, D, 256)
lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda")
for k, v in ((kc, vc), (quantize(kc, 1.0), quantize(vc, 1.0))):  # launches 0-2, then 3-5
    for _ in range(3):
        decode_attention(q, k, v, cu, lens, tables[0], D ** -0.5)
torch.cuda.synchronize()
PY
for skip in 2 5; do  # the third launch of each cache
  "$NCU" --kernel-name regex:_decode_split_kernel --launch-skip $skip --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section Occupancy --section MemoryWorkloadAnalysis python3 "$prog" 2>&1 | grep -v "^==PROF=="
done
rm -f "$prog"
