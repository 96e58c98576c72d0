#!/usr/bin/env bash
# Cascade attention's GPU figures in one call (README "Cascade attention (triton)"):
#   bash benchmarks/cascade_gpu.sh OUTDIR [parts]   parts: kernels bench profile default tests
#   (also: fold merge packed, the kernel variants of cascade_fold_merge.py, cascade_merge_variants.py
#   and packed_decode.py)
out=${1:-/tmp/nanovllm-cascade}; parts=${2:-"kernels bench profile default tests"}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.log"
for part in $parts; do
  log=$out/$part.log
  case $part in
    kernels) timeout 150 python3 benchmarks/cascade_kernels.py --sweep > "$log" 2>&1 ;;
    bench) for w in shared-prefix n8; do  # 3 runs each: host-bound runs vary per process
             timeout 400 python3 bench.py --attn-backend triton --workload $w --repeat 3 >> "$log" 2>&1
           done ;;
    profile) timeout 200 python3 benchmarks/cascade_profile.py --workload shared-prefix n8 \
               --cascade on off > "$log" 2>&1 ;;
    default) timeout 200 python3 bench.py --attn-backend triton --cascade off on \
               > "$log" 2>&1 ;;
    tests) timeout 200 python3 -m pytest -q tests/ -k cascade -p no:cacheprovider > "$log" 2>&1 ;;
    fold) timeout 150 python3 benchmarks/cascade_fold_merge.py > "$log" 2>&1 ;;
    merge) timeout 150 python3 benchmarks/cascade_merge_variants.py > "$log" 2>&1 ;;
    packed) timeout 400 python3 benchmarks/packed_decode.py > "$log" 2>&1 ;;
  esac
  grep -v "^$\|[Ww]arn\|^|---\|^| *[0-9.]* | void\|Memcpy\|Memset\|^| *[0-9]\.[0-9] |" "$log" \
    | grep "|\|passed\|failed\|Error\|per step\|median\|: _\|^[A-Za-z0-9 ,-]*, cascade" | tail -70
  echo "== $part done"
done
