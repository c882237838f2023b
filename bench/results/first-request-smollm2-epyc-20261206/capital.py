import json, sys, urllib.request
def ask(extra, q="What is the capital of France?"):
    body = {"model": "smollm2-135m", "max_tokens": 40, "messages": [{"role": "user", "content": q}], **extra}
    r = urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8080/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}))
    return json.load(r)["choices"][0]["message"]["content"]
for name, extra in [("server defaults", {}), ("openai T=1 no cuts", {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}), ("card 0.2/0.9", {"temperature": 0.2, "top_p": 0.9}), ("greedy", {"temperature": 0})]:
    outs = [ask({**extra, "seed": s}) for s in range(20)]
    print(f"{name}: {sum('Paris' in o for o in outs)}/20 mention Paris; e.g. {outs[0][:80]!r}")
