#!/usr/bin/env python3
"""Position by position, are reckon's logits bit-identical to llama.cpp's per-row path (n_batch = n_ubatch =
1, weight repacking off, flash attention off) as built on THIS host? Over the first N tokens of a parity
fixture's teacher-forced text (or given ids): for each position, the number of logits that differ, the
largest |difference|, and whether the top-1 token agrees. Prints the first differing position (where to
point bench/llamacpp_tensors.py and RECKON_DUMP_DIR) and a summary.

Usage (the python of bench/setup-llamacpp):
  /opt/llamacpp-venv/bin/python bench/llamacpp_logits_diff.py --bin /tmp/baseline --model smollm2-135m [--n 300]
      [--numerics ggml|packed] [--ids ID ...] [--show 20]
"""
import argparse, json, os, subprocess, tempfile
import numpy as np
from stamp import stamp  # bench/stamp.py: command, commit, CPU, ISA, time
import llama_cpp
import llamacpp_norepack  # noqa: F401  (per-row kernels, see that module)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = os.environ.get("RECKON_HOME") or os.path.expanduser("~/.cache/reckon/models")
FILES = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True, choices=list(FILES))
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--numerics", default="ggml")
    ap.add_argument("--ids", type=int, nargs="*")
    ap.add_argument("--show", type=int, default=20)
    ap.add_argument("--out", help="JSON with per-position results")
    a = ap.parse_args()
    st = stamp()
    print(f"# {json.dumps(st)}")
    path = os.path.join(MODELS_DIR, FILES[a.model])
    if a.ids:
        toks = a.ids
    else:
        fx = json.load(open(os.path.join(ROOT, "tests", "fixtures", "parity", f"{a.model}.json")))
        toks = fx["teacher_forced"]["tokens"][:a.n]
    llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_batch=1, n_ubatch=1, n_threads=2, flash_attn=False,
                          logits_all=True, verbose=False)
    llm.reset(); llm.eval(toks)
    L = np.array(llm.scores[:len(toks)], dtype=np.float32)
    vocab = L.shape[1]
    env = dict(os.environ); env.pop("RECKON_NUMERICS", None)
    if a.numerics == "ggml":
        env["RECKON_NUMERICS"] = "ggml"
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "logits.bin")
        subprocess.run([os.path.join(a.bin, "dump_logits"), path, out] + [str(t) for t in toks], env=env, check=True)
        R = np.fromfile(out, dtype="<f4").reshape(len(toks), vocab)
    ndiff = (L.view(np.uint32) != R.view(np.uint32)).sum(axis=1)
    maxd = np.abs(L - R).max(axis=1)
    top_agree = L.argmax(axis=1) == R.argmax(axis=1)
    differ = np.nonzero(ndiff)[0]
    print(f"{a.model} ({a.numerics}) vs llama.cpp {llama_cpp.__version__} per-row, {len(toks)} positions: "
          f"{len(toks) - len(differ)} bit-identical, {len(differ)} differ; top-1 agrees at {int(top_agree.sum())}; "
          f"max |d| over all {float(maxd.max()):.4g}")
    if len(differ):
        print(f"first differing position: {int(differ[0])} (token ids 0..{int(differ[0])}: "
              f"{' '.join(str(t) for t in toks[:int(differ[0]) + 1])})")
        print("pos  n_differ  max|d|  top1")
        for i in differ[:a.show]:
            print(f"{int(i):>4} {int(ndiff[i]):>8} {float(maxd[i]):>8.4g}  {'=' if top_agree[i] else 'DIFF'}")
    if a.out:
        json.dump({"stamp": st, "model": a.model, "numerics": a.numerics, "tokens": toks, "n_differ": ndiff.tolist(),
                   "max_abs": [float(x) for x in maxd], "top1_agree": top_agree.tolist()}, open(a.out, "w"))


if __name__ == "__main__":
    main()
