#!/bin/bash
cd /work/main
B=./target/release/reckon
for round in 1 2; do
  $B lab prefix -m smollm2-135m -r 1 --simd avx2 --out /tmp/i23b/f16-r$round > /tmp/i23b/f16-r$round.log 2>&1
  $B lab prefix -m smollm2-135m -r 1 --simd avx2 --kv-dtype q8_0 --out /tmp/i23b/q8-r$round > /tmp/i23b/q8-r$round.log 2>&1
  $B lab prefix -m smollm2-135m -r 1 --simd avx2 --kv-window 2048 --out /tmp/i23b/win2048-r$round > /tmp/i23b/win2048-r$round.log 2>&1
done
echo done > /tmp/i23b/DONE
