import json,re,sys,collections,statistics as st
d=collections.defaultdict(lambda: collections.defaultdict(dict))
for l in open(sys.argv[1]):
    m=re.match(r'round (\d) (old|new) (\w+) (\{.*)',l)
    if not m: continue
    r,b,simd,js=m.groups(); j=json.loads(js)
    test=f"pp{j['n_prompt']}" if j['n_prompt'] else f"tg{j['n_gen']}"
    d[(j['model'][:14],simd,test)][r][b]=j['tokens_per_s_median']
for k,v in d.items():
    ratios=sorted(x['new']/x['old'] for x in v.values())
    print("%-16s %-6s %-6s old %7.1f new %7.1f tok/s  new/old %.2fx (%.2f-%.2f)"%(k+(st.median(x['old'] for x in v.values()),st.median(x['new'] for x in v.values()),st.median(ratios),ratios[0],ratios[-1])))
