#!/usr/bin/env python3
"""Parity debugging: where do reckon and llama.cpp part, op by op? Compares reckon's activation dumps
(RECKON_DUMP_DIR: raw f32 `{name}-{layer}.f32` for the last token of each forward step, attention per head
as `kq-h{h}-{layer}.f32` / `kq_soft_max-h{h}-{layer}.f32` over the cells in the head's window) with
llama.cpp's graph tensors for the same token sequence (bench/llamacpp_tensors.py, an .npz), in llama.cpp's
graph order, and prints for each tensor whether it is bit-identical, how many elements differ and by how
much (absolute, and in units of the largest element).

  RECKON_NUMERICS=ggml RECKON_DUMP_DIR=/tmp/rd CHUNK=1 /tmp/baseline/dump_logits MODEL /tmp/rd/logits.bin ID...
  /opt/llamacpp-venv/bin/python bench/llamacpp_tensors.py MODEL /tmp/ll.npz ID...
  python3 bench/compare_tensor_dumps.py /tmp/ll.npz /tmp/rd [--layers 0-3] [--all]

Name mapping: a reckon `{name}-{layer}` is compared with llama.cpp's `{name}-{layer}` (the last repeat of
that name with as many elements: e.g. Qcur after RoPE). reckon's `kq` is after the attention scale, llama.cpp's
before (ggml_soft_max_ext applies it), so llama.cpp's row is multiplied by the scale (in f32) that makes them
closest, 1 or 1/sqrt(head_dim), and that scale is printed. Without --all, only the first 12 differing
tensors after the first difference are listed (everything before it is identical).
"""
import argparse, os, re, sys
import numpy as np
from stamp import stamp  # bench/stamp.py: command, commit, CPU, ISA, time


ALIASES = {"ffn_inp": "sa_out"}  # Gemma-3: the residual after attention


def parse_layers(s):
    if not s:
        return None
    a, _, b = s.partition("-")
    return set(range(int(a), int(b or a) + 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("npz")
    ap.add_argument("dump_dir")
    ap.add_argument("--layers", help="e.g. 0-3")
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args()
    print(f"# {stamp()}")
    layers = parse_layers(a.layers)
    ll = np.load(a.npz)
    order = list(ll.files)
    reck = {}
    for f in os.listdir(a.dump_dir):
        m = re.fullmatch(r"(.+)-(\d+)\.f32", f)
        if m:
            reck[(m.group(1), int(m.group(2)))] = np.fromfile(os.path.join(a.dump_dir, f), dtype="<f4")
    rows = []  # (order index, label, reckon array, llama array, note)
    for (name, layer), r in reck.items():
        if layers is not None and layer not in layers:
            continue
        hm = re.fullmatch(r"(kq|kq_soft_max)-h(\d+)", name)
        if hm:
            base, head = hm.group(1), int(hm.group(2))
            key = f"{base}-{layer}"
            if key not in ll.files:
                continue
            t = ll[key]  # [1, n_head, n_tokens=1, n_kv]
            row = t.reshape(-1, t.shape[-1])[head]
            # the head's window: reckon dumps cells lo..=pos; llama.cpp's row holds every cell of the cache
            # (a single sequence from position 0: cell = position), pos = the last nonzero probability
            sm = ll[f"kq_soft_max-{layer}"].reshape(-1, t.shape[-1])[head]
            pos = int(np.nonzero(sm)[0][-1])
            n = len(r)
            cand = row[pos + 1 - n: pos + 1]
            note = ""
            if base == "kq":
                best = None
                for sc in (np.float32(1.0), np.float32(1.0 / np.sqrt(infer_head_dim(ll, layer, t.shape)))):
                    c = (cand.astype(np.float32) * sc).astype(np.float32)
                    d = np.abs(c - r).max() if len(c) == len(r) else np.inf
                    if best is None or d < best[0]:
                        best = (d, c, sc)
                cand, note = best[1], f"llama.cpp x {best[2]:.6g}"
            idx = order.index(key) + head / 1000.0
            rows.append((idx, f"{name}-{layer}", r, cand, note))
            continue
        key = f"{name}-{layer}"
        cands = [k for k in order if (k == key or k.startswith(key + "#")) and ll[k].size == r.size]
        if not cands and name in ALIASES:  # the same tensor under another name in llama.cpp's graph
            key = f"{ALIASES[name]}-{layer}"
            cands = [k for k in order if (k == key or k.startswith(key + "#")) and ll[k].size == r.size]
        if not cands:
            continue
        k = cands[-1]
        rows.append((order.index(k), f"{name}-{layer}" + (f" (llama.cpp {k})" if k != f"{name}-{layer}" else ""), r, ll[k].reshape(-1), ""))
    rows.sort(key=lambda x: x[0])
    first = None
    shown_after = 0
    print(f"{'tensor':<34}{'n':>7}{'differ':>8}{'max |d|':>12}{'max |d|/max|x|':>16}{'max ulps':>10}  note")
    for idx, label, r, l, note in rows:
        if len(r) != len(l):
            print(f"{label:<34} size mismatch reckon {len(r)} llama.cpp {len(l)}")
            continue
        l = l.astype(np.float32)
        same = r.view(np.uint32) == l.view(np.uint32)
        nd = int((~same).sum())
        d = np.abs(r.astype(np.float64) - l.astype(np.float64))
        scale = max(float(np.abs(l).max()), 1e-30)
        ulps = np.abs(r.view(np.int32).astype(np.int64) - l.view(np.int32).astype(np.int64))
        if nd and first is None:
            first = label
        if first is not None and not a.all:
            shown_after += 1
            if shown_after > 12:
                continue
        print(f"{label:<34}{len(r):>7}{nd:>8}{d.max():>12.3g}{d.max() / scale:>16.3g}{int(ulps.max()):>10}  {note}")
    print(f"first differing tensor: {first}")


def infer_head_dim(ll, layer, kq_shape):
    """head_dim from Qcur's element count over the number of heads (kq's second-to-outer dim)."""
    n_head = kq_shape[1] if len(kq_shape) == 4 else kq_shape[0]
    for k in ll.files:
        if k == f"Qcur-{layer}" or k.startswith(f"Qcur-{layer}#"):
            return ll[k].size // n_head
    return 64


if __name__ == "__main__":
    main()
