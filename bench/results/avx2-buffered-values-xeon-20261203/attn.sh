#!/usr/bin/env bash
# attention alone, AVX2 kernels, old (762e2c7) vs new (buffered value pass), 5 alternations
cd /tmp/i23
for i in 1 2 3 4 5; do
  for arm in old final; do
    for dt in f16 q8_0 q4_0; do
      echo "$i $arm smollm2 $dt $(KV_DTYPE=$dt RECKON_SIMD=avx2 ./attn_$arm 9 3 64 4096 512 5 2)"
      echo "$i $arm qwen2.5 $dt $(KV_DTYPE=$dt RECKON_SIMD=avx2 ./attn_$arm 14 2 64 4096 512 3 2)"
    done
    echo "$i $arm gemma3 f16 $(RECKON_SIMD=avx2 ./attn_$arm 4 1 256 4096 512 3 2)"
    echo "$i $arm smollm2-decode f16 $(DECODE=1 RECKON_SIMD=avx2 ./attn_$arm 9 3 64 4096 1 50 2)"
    echo "$i $arm qwen2.5-decode f16 $(DECODE=1 RECKON_SIMD=avx2 ./attn_$arm 14 2 64 4096 1 50 2)"
  done
done
