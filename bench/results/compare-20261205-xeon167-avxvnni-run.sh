#!/bin/bash
# reckon's AVX-VNNI level against llama.cpp's AVX-VNNI build, pp512 @ d4096, one model after another.
cd /work/main
for m in smollm2-135m gemma3-270m qwen2.5-coder-0.5b; do
  /opt/llamacpp-avxvnni-venv/bin/python bench/compare-llamacpp -m $m -p 512 -n 0 -d 4096 -r 5 -t 2 --simd avxvnni --reckon /tmp/m3/bin-head --raw /tmp/m3/vnni-$m.jsonl > /tmp/m3/vnni-$m.txt 2>&1
done
echo done > /tmp/m3/DONE3
