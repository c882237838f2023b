#!/bin/bash
# A/B interleaved: the flood's slowest /health, before (accept on the workers) and after (front thread)
cd /work/main
for rep in 1 2 3 4; do for arm in old front; do
  out=/tmp/front/soak-$arm-$rep
  r=$(/tmp/reckon-$arm lab soak -m smollm2-135m --clients 64 --minutes 0.2 --max-prompt-words 2048 --flood 1000 --out $out 2>&1 | grep -E "within 100 ms throughout the flood|flood of" | tr '\n' ' ')
  echo "arm=$arm rep=$rep $r"
done; done
