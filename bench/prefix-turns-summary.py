#!/usr/bin/env python3
"""python3 bench/prefix-turns-summary.py FOLDER. Per run of `reckon lab prefix -r 1` (a subfolder with records.jsonl + table.md): turn 2 and turn 20 with
the cache on (TTFT, tokens prefilled, cached), their ratio, and the cold TTFT of turn 20; then per arm
(the folder name before -rN) the median over its runs. Reads table.md, which every run writes.
`runs(FOLDER)` returns the per-run figures (for bench/long-context-goals)."""
import os, re, sys, statistics


def runs(root):
    """{run folder: (turn 2, last turn)}, each a dict: prompt, cached, pre (prefilled), on and off (TTFT
    in ms with the cache on and off), growth (turn 2 only: the last 3 turns over turns 2-4, cache on)."""
    rows = {}
    for d in sorted(os.listdir(root)):
        t = os.path.join(root, d, 'table.md')
        if not os.path.isfile(t):
            continue
        turns = {}
        for line in open(t):
            c = [x.strip() for x in line.split('|')]
            if len(c) > 10 and c[1].isdigit():
                ms = lambda s: float(s.split()[0])  # noqa: E731
                turns[int(c[1])] = dict(prompt=int(c[3]), cached=int(c[5]), pre=int(c[6]), on=ms(c[7]), off=ms(c[9]))
        a, b = turns[2], turns[max(turns)]
        b['turn'] = max(turns)
        g = re.search(r'last 3 turns over turns 2-4: ([0-9.]+)x with the cache', open(t).read())
        a['growth'] = float(g.group(1)) if g else float('nan')
        rows[d] = (a, b)
    return rows


def main(root):
    rows = runs(root)
    for d, (a, b) in rows.items():
        print(f"{d:14s} turn2 {a['on']:7.0f} ms ({a['pre']:4d} prefilled, {a['cached']:4d} cached)  turn{b['turn']} {b['on']:7.0f} ms ({b['pre']:4d} prefilled, {b['cached']:4d} cached)  last/second {b['on']/a['on']:.2f}x  growth(last 3 / turns 2-4) {a['growth']:.2f}x  cold last {b['off']/1000:.1f} s")
    arms = {}
    for d, (a, b) in rows.items():
        arms.setdefault(re.sub(r'-r\d+$', '', d), []).append((a, b))
    print()
    for arm, rs in arms.items():
        med = lambda f: statistics.median(f(a, b) for a, b in rs)  # noqa: E731
        print(f"{arm:10s} runs {len(rs)}  turn2 {med(lambda a,b:a['on']):.0f} ms  last {med(lambda a,b:b['on']):.0f} ms  last/second {med(lambda a,b:b['on']/a['on']):.2f}x (runs: {', '.join('%.2f' % (b['on'] / a['on']) for a, b in rs)})  growth {med(lambda a,b:a['growth']):.2f}x  cold last {med(lambda a,b:b['off'])/1000:.1f} s")


if __name__ == '__main__':
    main(sys.argv[1])
