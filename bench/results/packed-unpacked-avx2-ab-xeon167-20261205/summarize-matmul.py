#!/usr/bin/env python3
"""Medians over the rounds of matmul-ab.txt (ns per (row, token)); speedup = old/new per round, median (min-max)."""
import re, statistics, sys, collections
runs = collections.defaultdict(lambda: collections.defaultdict(dict))
for line in open(sys.argv[1]):
    m = re.match(r"round (\d+) (old|new) (\w+) (\w+) (\d+) (\d+) n=(\d+) .* ([\d.]+) ns per row-token", line)
    if m:
        rnd, b, isa, t, r, c, n, ns = m.groups()
        runs[(isa, t, f"{r}x{c}", int(n))][int(rnd)][b] = float(ns)
print("# medians over the rounds of matmul-ab.txt, ns per (row, token), 2 threads; speedup = old/new per round, median (min-max)")
for k, rounds in runs.items():
    old = [v["old"] for v in rounds.values()]
    new = [v["new"] for v in rounds.values()]
    sp = [v["old"] / v["new"] for v in rounds.values()]
    print(f"{k[0]:6} {k[1].upper():5} {k[2]:9} n={k[3]:<4} old {statistics.median(old):7.2f} new {statistics.median(new):7.2f}  speedup {statistics.median(sp):.2f}x ({min(sp):.2f}-{max(sp):.2f})")
