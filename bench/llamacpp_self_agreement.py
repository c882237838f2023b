#!/usr/bin/env python3
"""How well llama.cpp agrees with itself: teacher-forced top-1 predictions of llama.cpp in its default
settings (n_batch 512: tinyBLAS and repacked GEMMs for prefill) against the parity fixture, which is
llama.cpp's one-token path (n_batch 1, repacking off). Two correct f32 summation orders part this much on
these quantized models, because every layer re-quantizes its activations to 8 bits and a last-bit change
can flip a rounding; it calibrates the parity test of reckon's packed numerics (parity_real.rs).

  /opt/llamacpp-venv/bin/python bench/llamacpp_self_agreement.py smollm2-135m ~/.cache/reckon/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json, os, sys
import numpy as np, llama_cpp
name, path = sys.argv[1], sys.argv[2]
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fx = json.load(open(os.path.join(root, "tests", "fixtures", "parity", f"{name}.json")))
tf = fx["teacher_forced"]; toks = tf["tokens"]
llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_batch=512, n_threads=2, logits_all=True, verbose=False)
llm.reset(); llm.eval(toks)
am = np.array(llm.scores[:len(toks)], dtype=np.float32).argmax(axis=1)
agree = sum(int(a) == b for a, b in zip(am, tf["argmax"]))
print(f"{name}: llama.cpp default vs n_batch=1 fixture: {agree}/{len(toks)} = {agree/len(toks):.4f}")
gaps = [tf["top2_gap"][i] for i, (a, b) in enumerate(zip(am, tf["argmax"])) if int(a) != b]
print(f"  disagreement gaps: max {max(gaps):.3f}, >0.3: {sum(g > 0.3 for g in gaps)}, >0.5: {sum(g > 0.5 for g in gaps)}")
