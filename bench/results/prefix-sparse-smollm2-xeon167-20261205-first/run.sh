#!/bin/bash
cd /work/main
B=./target/release/reckon
for round in 1 2; do
  $B lab prefix -m smollm2-135m -r 1 --sparse-attention 1024 --out /tmp/sp1/sparse1024-r$round > /tmp/sp1/sparse1024-r$round.log 2>&1
  $B lab prefix -m smollm2-135m -r 1 --out /tmp/sp1/f16-r$round > /tmp/sp1/f16-r$round.log 2>&1
done
echo done > /tmp/sp1/DONE
