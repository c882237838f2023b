# Medians and per-round ratios of matmul-levels.txt and bench-levels.txt: python3 summarize.py
import json, re, collections, statistics as st, os
here = os.path.dirname(os.path.abspath(__file__))
mm = collections.defaultdict(lambda: collections.defaultdict(dict))
for l in open(os.path.join(here, "matmul-levels.txt")):
    m = re.match(r"round (\d) (\w+) (\S+) (\S+) n=(\d+) .*?([\d.]+) ns per row-token", l)
    if m:
        r, s, t, shape, n, ns = m.groups()
        mm[(t, shape, int(n))][r][s] = float(ns)
print("# matmul_bench, ns per (row, token), median of 5 rounds; speedup over avx2 per round, median (min-max)")
for k, v in mm.items():
    line = "%-5s %-9s n=%-4d" % k
    for s in ("avx2", "avxvnni", "avx512"):
        line += " %s %7.2f" % (s, st.median(x[s] for x in v.values()))
    for s in ("avxvnni", "avx512"):
        rs = sorted(x["avx2"] / x[s] for x in v.values())
        line += "  %s %.2fx (%.2f-%.2f)" % (s, st.median(rs), rs[0], rs[-1])
    print(line)
b = collections.defaultdict(lambda: collections.defaultdict(dict))
for l in open(os.path.join(here, "bench-levels.txt")):
    m = re.match(r"round (\d) (\w+) (\{.*)", l)
    if m:
        r, s, js = m.groups(); j = json.loads(js)
        test = f"pp{j['n_prompt']}" if j["n_prompt"] else f"tg{j['n_gen']}"
        b[(j["model"][:14], test)][r][s] = j["tokens_per_s_median"]
print("\n# reckon bench, tok/s, median of 3 rounds (each the median of -r 3); avxvnni/avx2 per round, median (min-max)")
for k, v in b.items():
    rs = sorted(x["avxvnni"] / x["avx2"] for x in v.values())
    print("%-16s %-6s avx2 %7.1f avxvnni %7.1f  %.2fx (%.2f-%.2f)" % (k + (st.median(x["avx2"] for x in v.values()), st.median(x["avxvnni"] for x in v.values()), st.median(rs), rs[0], rs[-1])))
