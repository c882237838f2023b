#!/bin/sh
# `reckon lab prefix` with 3 turns, full attention and --kv-window 2048 alternating, 3 passes each
# (default kernels: AVX-512 on the Xeon 6/207); one folder per run under turns3/.
set -e
D=bench/results/window-pp-depth-smollm2-emr-20261204/turns3
for i in 1 2 3; do
  ./target/release/reckon lab prefix -m smollm2-135m -r 1 --turns 3 --out $D/full-r$i
  ./target/release/reckon lab prefix -m smollm2-135m -r 1 --turns 3 --kv-window 2048 --out $D/win2048-r$i
done
