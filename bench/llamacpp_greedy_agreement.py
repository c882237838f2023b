#!/usr/bin/env python3
"""Greedy-continuation agreement on THIS host: llama.cpp (as built here) in its per-row mode and its default
mode, reckon --numerics ggml and packed, and the parity fixtures (llama.cpp per-row, recorded on the host
named in tests/fixtures/parity/README.md), over the fixtures' prompts (their token ids, so tokenization is
out of the picture).

llama.cpp modes (llama-cpp-python, 2 threads, f16 KV cache, n_ctx 4096):
  perrow      n_batch = n_ubatch = 1, weight repacking off (use_extra_bufts = false), flash attention off:
              the per-row vec_dot path the fixtures come from (llama-cli: -b 1 -ub 1 --no-repack -fa off)
  default     llama-cpp-python's defaults: n_batch = n_ubatch = 512, repacking on, flash attention off
  default_fa  the same with flash attention on (llama-cli's default on a CPU: -fa auto turns it on)
reckon runs `greedy_ids` (crates/engine/examples/greedy_ids.rs: batched prefill, then one token per step)
with RECKON_NUMERICS=ggml and with the default (packed) numerics. greedy_ids holds 1024 tokens, so prompts
longer than 1024 - N (long_1500) are left out.

Usage (the python of bench/setup-llamacpp):
  /opt/llamacpp-venv/bin/python bench/llamacpp_greedy_agreement.py --bin /tmp/baseline [--n 32]
      [--models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b] [--modes perrow,default,default_fa]
      [--out results.json]
Prints, per model, each prompt's first divergence between the pairs (`=` all N tokens equal, else the
0-based step where they part, with llama.cpp per-row's top-1/top-2 gap at that step) and a count of
identical continuations per pair; --out writes every continuation and gap as JSON.
"""
import argparse, json, os, subprocess, sys, time
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
RECKON_GREEDY_CAP = 1024  # greedy_ids: new_kv(16 tokens a block, 64 blocks)

# Weight repacking is a model parameter that Llama() reads from llama_model_default_params(); a toggle
# instead of bench/llamacpp_norepack.py's fixed patch, so one process can run both modes.
_REPACK = [True]
_default_model_params = llama_cpp.llama_model_default_params


def _model_params():
    p = _default_model_params()
    p.use_extra_bufts = _REPACK[0]
    return p


llama_cpp.llama_model_default_params = _model_params
llama_cpp.llama.llama_cpp.llama_model_default_params = _model_params

MODES = {
    "perrow": dict(n_batch=1, n_ubatch=1, repack=False, flash_attn=False),
    "default": dict(n_batch=512, n_ubatch=512, repack=True, flash_attn=False),
    "default_fa": dict(n_batch=512, n_ubatch=512, repack=True, flash_attn=True),
}


def top2_gap(logits):
    top = np.argpartition(-logits, 2)[:2]
    a, b = sorted(logits[top], reverse=True)
    return float(a - b)


def llamacpp_greedy(path, mode, prompts, n):
    m = MODES[mode]
    _REPACK[0] = m["repack"]
    llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_batch=m["n_batch"], n_ubatch=m["n_ubatch"],
                          n_threads=2, flash_attn=m["flash_attn"], logits_all=True, verbose=False)
    out = {}
    for p in prompts:
        llm.reset()
        llm.eval(p["tokens"])
        toks, gaps = [], []
        for _ in range(n):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            t = int(np.argmax(logits))
            toks.append(t)
            gaps.append(round(top2_gap(logits), 4))
            llm.eval([t])
        out[p["name"]] = {"tokens": toks, "gaps": gaps}
    del llm
    return out


def reckon_greedy(bin_dir, path, numerics, prompts, n):
    env = dict(os.environ)
    env.pop("RECKON_NUMERICS", None)
    if numerics == "ggml":
        env["RECKON_NUMERICS"] = "ggml"
    out = {}
    for p in prompts:
        if len(p["tokens"]) + n > RECKON_GREEDY_CAP:
            continue
        r = subprocess.run([os.path.join(bin_dir, "greedy_ids"), path, str(n)] + [str(t) for t in p["tokens"]],
                           env=env, capture_output=True, text=True, check=True)
        ids = json.loads(r.stdout.strip())
        out[p["name"]] = {"tokens": ids[len(p["tokens"]):]}
    return out


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="directory holding reckon's greedy_ids example binary")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--models", default=",".join(FILES))
    ap.add_argument("--modes", default="perrow,default,default_fa")
    ap.add_argument("--out")
    a = ap.parse_args()
    modes = a.modes.split(",")
    st = stamp()
    print(f"# {json.dumps(st)}")
    result = {"stamp": st, "llama_cpp_python": llama_cpp.__version__, "n": a.n, "modes": {k: MODES[k] for k in modes},
              "models": {}}
    for name in a.models.split(","):
        path = os.path.join(MODELS_DIR, FILES[name])
        fx = json.load(open(os.path.join(ROOT, "tests", "fixtures", "parity", f"{name}.json")))
        prompts = fx["prompts"]
        runs = {"fixture": {p["name"]: {"tokens": p["greedy"][:a.n], "gaps": p["greedy_top2_gap"][:a.n]} for p in prompts}}
        timing = {}
        for mode in modes:
            t = time.time()
            runs[f"llamacpp_{mode}"] = llamacpp_greedy(path, mode, prompts, a.n)
            timing[f"llamacpp_{mode}"] = round(time.time() - t, 1)
        for numerics in ("ggml", "packed"):
            t = time.time()
            runs[f"reckon_{numerics}"] = reckon_greedy(a.bin, path, numerics, prompts, a.n)
            timing[f"reckon_{numerics}"] = round(time.time() - t, 1)
        ref = "llamacpp_perrow" if "llamacpp_perrow" in runs else "fixture"
        pairs = [(x, y) for x, y in [
            ("reckon_ggml", "llamacpp_perrow"), ("reckon_ggml", "fixture"), ("llamacpp_perrow", "fixture"),
            ("llamacpp_default", "llamacpp_perrow"), ("llamacpp_default_fa", "llamacpp_perrow"),
            ("reckon_packed", "llamacpp_perrow"), ("reckon_packed", "fixture")] if x in runs and y in runs]
        print(f"== {name} ({FILES[name]}), first {a.n} greedy tokens; seconds: {timing}")
        print("cells: '=' the two continuations agree on all tokens, else the 0-based step where they part "
              "(gap: llama.cpp per-row's top-1/top-2 logit gap there); ggml/packed: reckon; ll_row: llama.cpp "
              "per-row here; ll_def: llama.cpp default; ll_def_fa: the same with flash attention on; fixture: the "
              "recorded per-row run")
        short = {"reckon_ggml": "ggml", "reckon_packed": "packed", "llamacpp_perrow": "ll_row",
                 "llamacpp_default": "ll_def", "llamacpp_default_fa": "ll_def_fa", "fixture": "fixture"}
        print("prompt".ljust(12) + "".join(f"{short[x]}~{short[y]}".rjust(20) for x, y in pairs))
        table = {f"{x}~{y}": {} for x, y in pairs}
        for p in prompts:
            cells = []
            for x, y in pairs:
                if p["name"] not in runs[x] or p["name"] not in runs[y]:
                    cells.append("-".rjust(20)); continue
                d = first_diff(runs[x][p["name"]]["tokens"], runs[y][p["name"]]["tokens"])
                g = None if d is None else runs[ref][p["name"]]["gaps"][d]
                table[f"{x}~{y}"][p["name"]] = {"first_diff": d, "ref_gap_at_diff": g}
                cells.append(("=" if d is None else f"{d} (gap {g:.3f})").rjust(20))
            print(p["name"][:12].ljust(12) + "".join(cells))
        summary = {}
        for key, rows in table.items():
            plain = [r for pn, r in rows.items() if not pn.startswith("chat") and pn != "long_1500"]
            summary[key] = {"identical_all": sum(r["first_diff"] is None for r in rows.values()), "of_all": len(rows),
                            "identical_plain": sum(r["first_diff"] is None for r in plain), "of_plain": len(plain)}
        print("identical (plain prompts / all compared): " +
              "; ".join(f"{k}: {v['identical_plain']}/{v['of_plain']} / {v['identical_all']}/{v['of_all']}" for k, v in summary.items()))
        print(flush=True)
        result["models"][name] = {"file": FILES[name], "runs": runs, "first_diff": table, "summary": summary,
                                  "seconds": timing}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
