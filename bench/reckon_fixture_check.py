#!/usr/bin/env python3
"""Does reckon reproduce the parity fixtures on THIS host? For each model, reckon's logits
(crates/engine/examples/dump_logits.rs) over (a) every fixture prompt followed by its recorded 64-token
greedy continuation and (b) the teacher-forced text; at every position the fixture recorded, reckon's top-1
must equal the fixture's token and its top-1/top-2 gap the fixture's gap (which the fixture rounds to 4
decimals; a last-bit difference in the logits shows as a gap off by ~1e-6 at most, so equal gaps at
thousands of positions is strong evidence of identical logits, not proof).

Usage (any python with numpy, e.g. the one of bench/setup-llamacpp):
  RECKON_NUMERICS=ggml python bench/reckon_fixture_check.py --bin /tmp/baseline [--models ...]
RECKON_NUMERICS is passed through (ggml: the fixtures' numerics; unset: packed, which is not expected to
match). reckon's logits stream through a FIFO; nothing large is written.
"""
import argparse, json, os, subprocess, tempfile
import numpy as np
from stamp import stamp  # bench/stamp.py: command, commit, CPU, ISA, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = os.environ.get("RECKON_HOME") or os.path.expanduser("~/.cache/reckon/models")
FILES = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}
VOCAB = {"smollm2-135m": 49152, "gemma3-270m": 262144, "qwen2.5-coder-0.5b": 151936}


def top_and_gap(bin_dir, path, toks, vocab, first):
    """(argmax, top-1 minus top-2) of reckon's logits at positions first.. of toks."""
    with tempfile.TemporaryDirectory() as d:
        fifo = os.path.join(d, "logits"); os.mkfifo(fifo)
        proc = subprocess.Popen([os.path.join(bin_dir, "dump_logits"), path, fifo] + [str(t) for t in toks])
        am, gaps = [], []
        with open(fifo, "rb") as f:
            for i in range(len(toks)):
                buf = f.read(vocab * 4)
                if len(buf) != vocab * 4:
                    raise RuntimeError(f"short read at {i}")
                if i < first:
                    continue
                l = np.frombuffer(buf, dtype="<f4")
                top = np.partition(-l, 1)[:2]
                am.append(int(l.argmax())); gaps.append(float(top[1] - top[0]))
        if proc.wait() != 0:
            raise RuntimeError("dump_logits failed")
    return am, gaps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--models", default=",".join(FILES))
    a = ap.parse_args()
    print(f"# {json.dumps(stamp())}")
    print(f"RECKON_NUMERICS={os.environ.get('RECKON_NUMERICS', '(unset)')}")
    for name in a.models.split(","):
        path = os.path.join(MODELS_DIR, FILES[name])
        fx = json.load(open(os.path.join(ROOT, "tests", "fixtures", "parity", f"{name}.json")))
        tot_pos = tot_top = tot_gap = 0; worst = 0.0
        lines = []
        for p in fx["prompts"]:
            toks = p["tokens"] + p["greedy"][:-1]
            am, gaps = top_and_gap(a.bin, path, toks, VOCAB[name], len(p["tokens"]) - 1)
            top = sum(x == y for x, y in zip(am, p["greedy"]))
            geq = sum(round(g, 4) == fg for g, fg in zip(gaps, p["greedy_top2_gap"]))
            worst = max(worst, max(abs(g - fg) for g, fg in zip(gaps, p["greedy_top2_gap"])))
            tot_pos += len(am); tot_top += top; tot_gap += geq
            lines.append(f"  {p['name']:<12} {len(am):>3} greedy steps: top-1 = fixture at {top}, gap = fixture's at {geq}")
        tf = fx["teacher_forced"]
        am, gaps = top_and_gap(a.bin, path, tf["tokens"], VOCAB[name], 0)
        top = sum(x == y for x, y in zip(am, tf["argmax"]))
        geq = sum(round(g, 4) == fg for g, fg in zip(gaps, tf["top2_gap"]))
        tworst = max(abs(g - fg) for g, fg in zip(gaps, tf["top2_gap"]))
        print(f"{name}: greedy steps {tot_top}/{tot_pos} top-1 and {tot_gap}/{tot_pos} gaps equal to the fixture's "
              f"(max |gap - fixture gap| {worst:.2g}); teacher-forced {top}/{len(am)} top-1 and {geq}/{len(am)} gaps "
              f"(max |gap - fixture gap| {tworst:.2g})")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
