#!/bin/bash
# old = 8b3f90e-era kernels (d6cebc6), new = a8de31a; one matmul alone, 2 threads, alternating.
echo "# matmul_bench TYPE ROWS COLS N REPS 2, RECKON_SIMD=avx2 unless marked avx512; old = d6cebc6, new = a8de31a"
echo "# host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2) model $(grep -m1 -E '^model\s' /proc/cpuinfo | cut -d: -f2); $(date -u)"
for round in 1 2 3 4 5; do
  for t in "q4_1 1536 576" "q5_0 4864 896" "q4_k 896 4864" "q6_k 896 4864"; do
    for n in 512 1; do
      reps=$([ $n = 1 ] && echo 300 || echo 10)
      for b in old new; do echo -n "round $round $b avx2 "; RECKON_SIMD=avx2 /tmp/mm_$b $t $n $reps 2; done
    done
  done
  for b in old new; do echo -n "round $round $b avx512 "; /tmp/mm_$b q5_0 4864 896 512 10 2; done
done
