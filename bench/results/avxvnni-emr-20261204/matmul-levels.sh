#!/bin/bash
# The packed matmul at three kernel levels of one binary (tools' matmul_bench, RECKON_SIMD caps the level),
# alternating avx2, avxvnni, avx512 in every round; one matmul alone, 2 threads.
bin=${MM:-target/release/matmul_bench}
echo "# matmul_bench TYPE ROWS COLS N REPS 2 under RECKON_SIMD=avx2|avxvnni|avx512, commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo +changes)"
echo "# host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2) model $(grep -m1 -E '^model\s' /proc/cpuinfo | cut -d: -f2); $(date -u)"
for round in 1 2 3 4 5; do
  for t in "q4_1 1536 576" "q5_0 4864 896" "q8_0 896 4864" "q4_k 896 4864" "q6_k 896 4864"; do
    for n in 512 1; do
      reps=$([ $n = 1 ] && echo 300 || echo 10)
      for s in avx2 avxvnni avx512; do echo -n "round $round $s "; RECKON_SIMD=$s $bin $t $n $reps 2; done
    done
  done
done
