#!/bin/bash
# reckon bench old (d6cebc6) vs new (a8de31a), alternating, 3 rounds.
echo "# reckon bench -m MODEL -p 512 -n 64 -r 3 --json [--simd avx2]; old = d6cebc6, new = a8de31a, alternating"
echo "# host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2) model $(grep -m1 -E '^model\s' /proc/cpuinfo | cut -d: -f2); $(date -u)"
for round in 1 2 3; do
  for m in smollm2-135m gemma3-270m qwen2.5-coder-0.5b; do
    for simd in avx2 avx512; do
      [ $simd = avx512 ] && [ $m = smollm2-135m ] && continue
      for b in old new; do
        /tmp/reckon_$b bench -m $m -p 512 -n 64 -r 3 --json --simd $simd 2>/dev/null | sed "s/^/round $round $b $simd /"
      done
    done
  done
done
