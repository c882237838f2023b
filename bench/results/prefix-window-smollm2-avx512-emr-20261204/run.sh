#!/bin/bash
cd /work/main
B=./target/release/reckon
for round in 1 2; do
  $B lab prefix -m smollm2-135m -r 1 --kv-window 2048 --out /tmp/i23d/win2048-r$round > /tmp/i23d/win2048-r$round.log 2>&1
  $B lab prefix -m smollm2-135m -r 1 --out /tmp/i23d/f16-r$round > /tmp/i23d/f16-r$round.log 2>&1
done
echo done > /tmp/i23d/DONE
