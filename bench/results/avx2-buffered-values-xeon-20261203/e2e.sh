#!/usr/bin/env bash
# reckon bench pp512 @ d4096, --simd avx2, old (762e2c7) vs new, alternating, 3 repetitions per run
cd /work/main
for i in 1 2 3; do
  for arm in old new; do
    for m in smollm2-135m qwen2.5-coder-0.5b; do
      for kv in f16 q8_0; do
        [ $m = qwen2.5-coder-0.5b ] && [ $kv = q8_0 ] && continue
        echo "== $i $arm $m $kv"
        /tmp/i23/reckon_$arm bench -m $m -p 512 -n 0 -d 4096 -r 3 -t 2 --simd avx2 --kv-dtype $kv 2>&1 | grep -E "pp512"
      done
    done
  done
done
