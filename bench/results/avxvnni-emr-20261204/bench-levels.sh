#!/bin/bash
# reckon bench at --simd avx2 and --simd avxvnni (one binary), alternating, 3 rounds, depth 0.
bin=${RECKON:-target/release/reckon}
echo "# reckon bench -m MODEL -p 512 -n 64 -r 3 --json --simd avx2|avxvnni, commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates src || echo +changes)"
echo "# host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2) model $(grep -m1 -E '^model\s' /proc/cpuinfo | cut -d: -f2); $(date -u)"
for round in 1 2 3; do
  for m in smollm2-135m gemma3-270m qwen2.5-coder-0.5b; do
    for s in avx2 avxvnni; do
      $bin bench -m $m -p 512 -n 64 -r 3 --json --simd $s 2>/dev/null | sed "s/^/round $round $s /"
    done
  done
done
