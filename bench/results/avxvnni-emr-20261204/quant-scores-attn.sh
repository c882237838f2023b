#!/bin/bash
# Quantized-KV attention, one layer, AVX2 against AVX-VNNI score kernels, alternating, 5 rounds.
cd /work/main
B=./target/release/attn_bench
for round in 1 2 3 4 5; do
  for kv in q8_0 q4_0; do
    for lvl in avx2 avxvnni; do
      echo "round $round kv $kv level $lvl prefill smollm2 $(RECKON_SIMD=$lvl KV_DTYPE=$kv $B 9 3 64 4096 256 10 2)"
      echo "round $round kv $kv level $lvl prefill qwen2.5 $(RECKON_SIMD=$lvl KV_DTYPE=$kv $B 14 2 64 4096 256 10 2)"
      echo "round $round kv $kv level $lvl decode smollm2 $(RECKON_SIMD=$lvl KV_DTYPE=$kv DECODE=1 $B 9 3 64 4096 1 50 2)"
    done
  done
done
