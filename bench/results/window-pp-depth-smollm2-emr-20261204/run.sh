#!/bin/sh
# pp at depth with and without --kv-window 2048 (4 sinks), SmolLM2, passes interleaved (bench/flag-ab).
set -e
D=bench/results/window-pp-depth-smollm2-emr-20261204
bench/flag-ab --flags="--kv-window 2048" -r 5 --out $D/pp275-d1824-avx2.jsonl -- -m smollm2-135m -p 275 -n 0 -d 1824 --simd avx2 > $D/pp275-d1824-avx2.txt
bench/flag-ab --flags="--kv-window 2048" -r 5 --out $D/pp512-d4096-avx2.jsonl -- -m smollm2-135m -p 512 -n 0 -d 4096 --simd avx2 > $D/pp512-d4096-avx2.txt
bench/flag-ab --flags="--kv-window 2048" -r 5 --out $D/pp512-d4096-avx512.jsonl -- -m smollm2-135m -p 512 -n 0 -d 4096 > $D/pp512-d4096-avx512.txt
