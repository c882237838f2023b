#!/bin/bash
cd /work/main
B=./target/release/reckon
for round in 1 2; do
  $B lab prefix -m smollm2-135m -r 1 --sparse-attention 1024 --out /tmp/m2/prefix/sparse1024-r$round > /tmp/m2/prefix/sparse1024-r$round.log 2>&1
  $B lab prefix -m smollm2-135m -r 1 --out /tmp/m2/prefix/f16-r$round > /tmp/m2/prefix/f16-r$round.log 2>&1
done
for round in 1 2; do
  $B lab prefix -m smollm2-135m -r 1 --simd avx2 --sparse-attention 1024 --out /tmp/m2/prefix-avx2/sparse1024-r$round > /tmp/m2/prefix-avx2/sparse1024-r$round.log 2>&1
  $B lab prefix -m smollm2-135m -r 1 --simd avx2 --out /tmp/m2/prefix-avx2/f16-r$round > /tmp/m2/prefix-avx2/f16-r$round.log 2>&1
done
python3 bench/flag-ab --flags="--sparse-attention 1024" -r 5 --out /tmp/m2/ab-smollm2-d4096.jsonl -- -m smollm2-135m -p 512 -n 64 -d 4096 > /tmp/m2/ab-smollm2-d4096.txt 2>&1
python3 bench/flag-ab --flags="--sparse-attention 1024" -r 3 --out /tmp/m2/ab-qwen-d4096.jsonl -- -m qwen2.5-coder-0.5b -p 512 -n 32 -d 4096 > /tmp/m2/ab-qwen-d4096.txt 2>&1
$B lab eviction -m qwen2.5-coder-0.5b --lengths 1024,2048,4096 --windows 512,1024 --sparse-attention 512 --sparse-local 512 --out /tmp/m2/eviction-qwen > /tmp/m2/eviction-qwen.log 2>&1
echo done > /tmp/m2/DONE
