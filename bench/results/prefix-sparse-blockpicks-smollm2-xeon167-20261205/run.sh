#!/bin/bash
# Measurements for sparse attention's block-shared picks (d9b8fca), one job at a time.
cd /work/main
B=/tmp/m3/bin-new
O=/tmp/m3/bin-old
for round in 1 2; do
  $B lab prefix -m smollm2-135m -r 1 --sparse-attention 1024 --out /tmp/m3/prefix/sparse1024-r$round > /tmp/m3/prefix/sparse1024-r$round.log 2>&1
  $B lab prefix -m smollm2-135m -r 1 --out /tmp/m3/prefix/f16-r$round > /tmp/m3/prefix/f16-r$round.log 2>&1
done
for round in 1 2; do
  $B lab prefix -m smollm2-135m -r 1 --simd avx2 --sparse-attention 1024 --out /tmp/m3/prefix-avx2/sparse1024-r$round > /tmp/m3/prefix-avx2/sparse1024-r$round.log 2>&1
  $B lab prefix -m smollm2-135m -r 1 --simd avx2 --out /tmp/m3/prefix-avx2/f16-r$round > /tmp/m3/prefix-avx2/f16-r$round.log 2>&1
done
python3 bench/flag-ab --flags="" --reckon $O --reckon-b $B -r 5 --out /tmp/m3/ab-oldnew-pp512-d6400.jsonl -- -m smollm2-135m -p 512 -n 0 -d 6400 --sparse-attention 1024 > /tmp/m3/ab-oldnew-pp512-d6400.txt 2>&1
python3 bench/flag-ab --flags="" --reckon $O --reckon-b $B -r 5 --out /tmp/m3/ab-oldnew-tg64-d4096.jsonl -- -m smollm2-135m -p 0 -n 64 -d 4096 --sparse-attention 1024 > /tmp/m3/ab-oldnew-tg64-d4096.txt 2>&1
python3 bench/flag-ab --flags="--sparse-attention 1024" --reckon $B -r 5 --out /tmp/m3/ab-sparse-pp512-d4096.jsonl -- -m smollm2-135m -p 512 -n 0 -d 4096 > /tmp/m3/ab-sparse-pp512-d4096.txt 2>&1
python3 bench/flag-ab --flags="--sparse-attention 1024" --reckon $B -r 5 --out /tmp/m3/ab-sparse-tg64-d4096.jsonl -- -m smollm2-135m -p 0 -n 64 -d 4096 > /tmp/m3/ab-sparse-tg64-d4096.txt 2>&1
$B lab eviction -m qwen2.5-coder-0.5b --lengths 1024,2048,4096 --windows 512,1024 --sparse-attention 512 --sparse-local 512 --out /tmp/m3/eviction-qwen > /tmp/m3/eviction-qwen.log 2>&1
echo done > /tmp/m3/DONE
