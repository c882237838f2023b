#!/bin/bash
# A/B: compute threads niced N (external renice) during lab soak's flood
cd /work/main
for rep in 1 2 3; do for n in 0 5 10; do
  port=$((8200+n+rep*20))
  ./target/release/reckon serve -m smollm2-135m --port $port > /tmp/nice/serve-$n-$rep.log 2>&1 &
  pid=$!
  until curl -s localhost:$port/health >/dev/null; do sleep 0.2; done
  for t in /proc/$pid/task/*; do name=$(cat $t/comm); case $name in reckon-engine|reckon-worker*) renice -n $n -p $(basename $t) >/dev/null;; esac; done
  ps -L -o tid,ni,comm -p $pid | tr '\n' ' ' > /tmp/nice/threads-$n-$rep.txt
  r=$(./target/release/reckon lab soak --url http://127.0.0.1:$port --clients 64 --minutes 0.2 --max-prompt-words 2048 --flood 1000 --out /tmp/nice/soak-$n-$rep 2>&1 | grep -E "within 100 ms|flood of" | tr '\n' ' ')
  echo "nice=$n rep=$rep $r"
  kill $pid; wait $pid 2>/dev/null
done; done
