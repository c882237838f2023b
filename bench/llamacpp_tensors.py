#!/usr/bin/env python3
"""Parity debugging: capture llama.cpp's intermediate graph tensors (f32, contiguous) while it evaluates the
last of a token sequence one token at a time (n_batch 1, weight repacking off), into an .npz keyed by
tensor name (repeats get #1, #2...). Compare with reckon's RECKON_DUMP_DIR files (raw f32, {name}-{layer}.f32).
Usage: /opt/llamacpp-venv/bin/python bench/llamacpp_tensors.py MODEL.gguf OUT.npz ID..."""

import os, sys, json, ctypes, numpy as np, llama_cpp
class T(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64*4), ("nb", ctypes.c_size_t*4),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32*16), ("flags", ctypes.c_int32), ("src", ctypes.c_void_p*10),
                ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char*64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char*8)]
captured = {}; active = [False]; order = []
@llama_cpp.ggml_backend_sched_eval_callback
def cb(t, ask, ud):
    if not active[0]: return ask and False
    tt = ctypes.cast(t, ctypes.POINTER(T)).contents
    if ask: return True
    name = tt.name.decode()
    ne = list(tt.ne); 
    if tt.type == 0:  # f32
        n = ne[0]*ne[1]*ne[2]*ne[3]
        contiguous = tt.nb[0]==4 and tt.nb[1]==4*ne[0]
        if contiguous:
            arr = np.ctypeslib.as_array(ctypes.cast(tt.data, ctypes.POINTER(ctypes.c_float)), shape=(n,)).copy()
            k = name; i = 1
            while k in captured: k = f"{name}#{i}"; i += 1
            captured[k] = arr.reshape(ne[3], ne[2], ne[1], ne[0]); order.append((k, ne, tt.op))
    return True
_dc = llama_cpp.llama_context_default_params
def ctxp():
    p = _dc(); p.cb_eval = cb; return p
llama_cpp.llama_context_default_params = ctxp
llama_cpp.llama.llama_cpp.llama_context_default_params = ctxp
import llamacpp_norepack  # noqa: F401  (per-row kernels, see that module)
model, out = sys.argv[1], sys.argv[2]; toks = [int(x) for x in sys.argv[3:]]
llm = llama_cpp.Llama(model_path=model, n_ctx=4096, n_batch=1, n_ubatch=1, n_threads=2, logits_all=True, verbose=False)
llm.reset()
for t in toks[:-1]: llm.eval([t])
active[0] = True; llm.eval([toks[-1]])
np.savez(out, **captured)
for k, ne, op in order: print(k, ne, op)
