#!/usr/bin/env python3
"""Teacher-forced top-1 agreement on THIS host over each parity fixture's teacher-forced text (~2,000
tokens): llama.cpp as built here, per-row (n_batch = n_ubatch = 1, repacking off, flash attention off) and
default (llama-cpp-python's defaults: n_batch 512, repacking on, flash attention off), reckon's ggml and
packed numerics (crates/engine/examples/dump_logits.rs, all logits, prefill in chunks of 256), and the
fixture itself (llama.cpp per-row on the host that recorded it). Prints the pairwise agreement matrix, and
for each pair against this host's llama.cpp per-row the top-1/top-2 gaps (per-row's) where they disagree.

Usage (the python of bench/setup-llamacpp):
  /opt/llamacpp-venv/bin/python bench/llamacpp_tf_agreement.py --bin /tmp/baseline
      [--models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b] [--out results.json]
--out writes every run's argmax (and per-row's gaps) as JSON. reckon's logits stream through a FIFO (Gemma-3's
2,000 x 262,144 f32 would be 2 GB on disk).
"""
import argparse, json, os, subprocess, sys, tempfile, threading, time
import numpy as np
from stamp import stamp  # bench/stamp.py: command, commit, CPU, ISA, time
import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = os.environ.get("RECKON_HOME") or os.path.expanduser("~/.cache/reckon/models")
FILES = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}

_REPACK = [True]
_default_model_params = llama_cpp.llama_model_default_params


def _model_params():
    p = _default_model_params()
    p.use_extra_bufts = _REPACK[0]
    return p


llama_cpp.llama_model_default_params = _model_params
llama_cpp.llama.llama_cpp.llama_model_default_params = _model_params


def gaps_of(scores):
    top2 = -np.partition(-scores, 1, axis=1)[:, :2]
    return top2[:, 0] - top2[:, 1]


def llamacpp_tf(path, toks, perrow):
    _REPACK[0] = not perrow
    nb = 1 if perrow else 512
    llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_batch=nb, n_ubatch=nb, n_threads=2, flash_attn=False,
                          logits_all=True, verbose=False)
    llm.reset(); llm.eval(toks)
    s = np.array(llm.scores[:len(toks)], dtype=np.float32)
    del llm
    return s.argmax(axis=1), gaps_of(s)


def reckon_tf(bin_dir, path, toks, numerics, vocab):
    env = dict(os.environ)
    env.pop("RECKON_NUMERICS", None)
    if numerics == "ggml":
        env["RECKON_NUMERICS"] = "ggml"
    with tempfile.TemporaryDirectory() as d:
        fifo = os.path.join(d, "logits")
        os.mkfifo(fifo)
        proc = subprocess.Popen([os.path.join(bin_dir, "dump_logits"), path, fifo] + [str(t) for t in toks], env=env)
        am = np.empty(len(toks), dtype=np.int64)
        gaps = np.empty(len(toks), dtype=np.float32)
        row = vocab * 4
        with open(fifo, "rb") as f:
            for i in range(len(toks)):
                buf = f.read(row)
                if len(buf) != row:
                    raise RuntimeError(f"dump_logits: short read at position {i}")
                l = np.frombuffer(buf, dtype="<f4")
                am[i] = int(l.argmax())
                top = np.partition(-l, 1)[:2]
                gaps[i] = top[1] - top[0]
        if proc.wait() != 0:
            raise RuntimeError("dump_logits failed")
    return am, gaps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="directory holding reckon's dump_logits example binary")
    ap.add_argument("--models", default=",".join(FILES))
    ap.add_argument("--out")
    a = ap.parse_args()
    st = stamp()
    print(f"# {json.dumps(st)}")
    result = {"stamp": st, "llama_cpp_python": llama_cpp.__version__, "models": {}}
    for name in a.models.split(","):
        path = os.path.join(MODELS_DIR, FILES[name])
        fx = json.load(open(os.path.join(ROOT, "tests", "fixtures", "parity", f"{name}.json")))
        tf = fx["teacher_forced"]; toks = tf["tokens"]; n = len(toks)
        runs, gaps, secs = {"fixture": np.array(tf["argmax"])}, {"fixture": np.array(tf["top2_gap"])}, {}
        for key, perrow in (("llamacpp_perrow", True), ("llamacpp_default", False)):
            t = time.time(); runs[key], gaps[key] = llamacpp_tf(path, toks, perrow); secs[key] = round(time.time() - t, 1)
        vocab = llama_cpp.Llama(model_path=path, n_ctx=16, vocab_only=True, verbose=False).n_vocab()
        for numerics in ("ggml", "packed"):
            key = f"reckon_{numerics}"
            t = time.time(); runs[key], gaps[key] = reckon_tf(a.bin, path, toks, numerics, vocab); secs[key] = round(time.time() - t, 1)
        keys = list(runs)
        print(f"== {name}: teacher-forced top-1 agreement over {n} positions (seconds: {secs})")
        print("".ljust(18) + "".join(k.rjust(18) for k in keys))
        matrix = {}
        for x in keys:
            row = []
            for y in keys:
                agree = int((runs[x] == runs[y]).sum())
                matrix.setdefault(x, {})[y] = agree
                row.append(f"{agree} {agree / n:.2%}".rjust(18))
            print(x.ljust(18) + "".join(row))
        ref = gaps["llamacpp_perrow"]
        details = {}
        for x in keys:
            if x == "llamacpp_perrow":
                continue
            dis = np.nonzero(runs[x] != runs["llamacpp_perrow"])[0]
            g = ref[dis]
            details[x] = {"disagree": int(len(dis)), "first_positions": [int(i) for i in dis[:20]],
                          "max_gap": float(g.max()) if len(g) else 0.0,
                          "gt_0.3": int((g > 0.3).sum()), "gt_0.5": int((g > 0.5).sum())}
            print(f"  {x} vs llamacpp_perrow: {len(dis)} disagreements, per-row gap there max "
                  f"{details[x]['max_gap']:.3f}, >0.3: {details[x]['gt_0.3']}, >0.5: {details[x]['gt_0.5']}, "
                  f"first at {details[x]['first_positions'][:8]}")
        print(flush=True)
        result["models"][name] = {"n": n, "agree": matrix, "vs_perrow": details, "seconds": secs,
                                  "argmax": {k: [int(v) for v in runs[k]] for k in keys},
                                  "perrow_gap": [round(float(v), 4) for v in ref]}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
