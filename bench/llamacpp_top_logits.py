#!/usr/bin/env python3
"""llama.cpp side of crates/engine/examples/top_logits.rs: top-5 logits per position, batched and one token
at a time. Usage: /opt/llamacpp-venv/bin/python bench/llamacpp_top_logits.py MODEL.gguf ID..."""
import os, sys, numpy as np, llama_cpp
if os.environ.get("NOREPACK"):
    import llamacpp_norepack  # noqa: F401  (per-row kernels, see that module)
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_batch=512, n_threads=2, logits_all=True, verbose=False)
toks = [int(x) for x in sys.argv[2:]]
llm.reset(); llm.eval(toks)
B = np.array(llm.scores[:len(toks)])
llm.reset()
for i, t in enumerate(toks):
    llm.eval([t]); S = np.array(llm.scores[llm.n_tokens-1])
    for name, l in (("batched", B[i]), ("single ", S)):
        top = np.argsort(-l)[:5]
        print(f"pos {i}: {name} {[(int(j), round(float(l[j]),4)) for j in top]}")
