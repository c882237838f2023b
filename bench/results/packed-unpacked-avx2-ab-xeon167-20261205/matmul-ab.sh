#!/bin/bash
# old = 78bb704 (tiles of 4 tokens, each unpacking its blocks), new = 6ae9948, which unpacks a group once
# per token chunk; tools' matmul_bench, one matmul alone, 2 threads, the two builds alternating.
echo "# matmul_bench TYPE ROWS COLS N REPS 2, RECKON_SIMD=avx2 unless marked avx512; old = /tmp/mm_old (78bb704), new = /tmp/mm_new (6ae9948)"
echo "# host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2) model $(grep -m1 -E '^model\s' /proc/cpuinfo | cut -d: -f2); $(date -u)"
for round in 1 2 3 4 5; do
  for t in "q4_1 1536 576" "q5_0 4864 896" "q4_k 896 4864" "q6_k 896 4864"; do
    for n in 512 16 8 1; do
      reps=$([ $n = 1 ] && echo 300 || ([ $n -le 16 ] && echo 100 || echo 10))
      for b in old new; do echo -n "round $round $b avx2 $t n=$n "; RECKON_SIMD=avx2 /tmp/mm_$b $t $n $reps 2; done
    done
  done
  for b in old new; do echo -n "round $round $b avx512 q5_0 4864 896 n=512 "; /tmp/mm_$b q5_0 4864 896 512 10 2; done
done
