#!/bin/bash
# attn_bench A/B (old = before, new = after), AVX2 kernels (RECKON_SIMD=avx2), interleaved, 2 threads
# usage: ab.sh ROUNDS
R=${1:-5}
for round in $(seq $R); do
  for arm in old new; do
    for cfg in "prefill smollm2|9 3 64 4096 256 10 2" "prefill qwen0.5b|14 2 64 4096 256 6 2" "prefill gemma3|4 1 256 4096 256 10 2" "decode1 smollm2|9 3 64 4096 1 200 2" "decode8 smollm2|9 3 64 4096 8 100 2"; do
      name=${cfg%%|*}; args=${cfg#*|}
      dec=""; case $name in decode*) dec=1;; esac
      out=$(RECKON_SIMD=${SIMD:-avx2} DECODE=$dec /tmp/i23/attn_$arm $args 2>&1 | tail -1)
      echo "round=$round arm=$arm cfg=$name :: $out"
    done
  done
done
