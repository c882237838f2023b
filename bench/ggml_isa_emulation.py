#!/usr/bin/env python3
"""Why llama.cpp built for AVX2 and llama.cpp built for AVX-512 (which reckon --numerics ggml reproduces on
every CPU) give different bits: a numpy emulation of the ggml-cpu routines whose float arithmetic depends
on the build's vector width, run on llama.cpp's own inputs for one layer at the last token of a sequence,
and checked bit for bit against llama.cpp's outputs (and, given a RECKON_DUMP_DIR, reckon's):

  kq           ggml_vec_dot_f16 (vec.cpp) over head_dim: 4 accumulators of GGML_F16_EPR lanes, a step of
               GGML_F16_STEP elements (AVX2 8 lanes / 32, AVX-512 16 / 64), then GGML_F32x8_REDUCE
               (pairs, then hadd) or GGML_F32x16_REDUCE (pairs, then _mm512_reduce_add_ps)
  kq_soft_max  ggml_vec_soft_max_f32 (vec.cpp): ggml_v_expf (vec.h) on 8 or 16 lanes and one f32 horizontal
               sum per vector added into a double. The two ggml_v_expf differ: AVX2 ends in
               fma(j, k, k) = 2^n·(1 + p(b)) rounded once, AVX-512 computes 1 + p(b) in f32 first (its last
               fma adds the 1) and scales that by 2^n with _mm512_scalef_ps
  kqv          ggml_vec_dot_f16 over the KV cells (kq_soft_max rounded to f16) against the transposed V cache
  ffn_swiglu   ggml_vec_swiglu_f32: ggml_v_silu = x / (1 + ggml_v_expf(-x)) on 8 or 16 lanes, times up
               (architectures with SwiGLU; Gemma's GELU is a table and ISA-independent)

It then quantizes kqv_out (the wo matmul's input) and ffn_swiglu (ffn_down's input) as ggml does for the
layer's weight types (read from the GGUF: q8_1 for Q4_1/Q5_1, q8_0 for Q4_0/Q5_0/Q8_0, q8_K for k-quants)
under each build's arithmetic, and counts the int8 quants and the block scales that change. Only such a
change lets a last-bit difference out of a layer: the quantized matmuls themselves (quants.c) run the same
integer code in both builds, so identical quantized inputs give identical outputs. q8_0/q8_1 store the
scale amax/127 as f16, which a last-bit change of amax rarely moves; q8_K stores 1/iscale as f32, which
moves whenever the block's largest element changes in its last bit. For kqv_out it also swaps each
attention stage between the two builds' arithmetic, to say which stage's rounding made the change.

Usage (the python of bench/setup-llamacpp), with llama.cpp per-row (n_batch 1, repacking off):
  /opt/llamacpp-venv/bin/python bench/ggml_isa_emulation.py MODEL.gguf --layers 0-29 [--dump RECKON_DUMP_DIR]
      [--wo-type q8_0|q8_1|q8_K] [--down-type ...] ID...
The emulation rounds fused multiply-adds through float64 (exact products; a double rounding is possible
but rare, and the bit-for-bit checks printed show whether it happened).
"""
import argparse, ctypes, os, sys
import numpy as np
from stamp import stamp  # bench/stamp.py: command, commit, CPU, ISA, time
import llama_cpp

F32, F64 = np.float32, np.float64


# ---------------------------------------------------------------- f32 helpers (numpy arrays of float32)
def fma(a, b, c):
    return (F64(1) * np.asarray(a, F32).astype(F64) * np.asarray(b, F32).astype(F64) + np.asarray(c, F32).astype(F64)).astype(F32)


def fnma(a, b, c):  # c - a*b, one rounding (_mm*_fnmadd_ps(a, b, c))
    return (np.asarray(c, F32).astype(F64) - np.asarray(a, F32).astype(F64) * np.asarray(b, F32).astype(F64)).astype(F32)


def bits(x):
    return np.asarray(x, F32).view(np.uint32)


def from_bits(u):
    return np.asarray(u, np.uint32).view(F32)


C = dict(r=F32(float.fromhex("0x1.8p23")), l2e=F32(float.fromhex("0x1.715476p+0")), ln2hi=F32(float.fromhex("0x1.62e4p-1")), ln2lo=F32(float.fromhex("0x1.7f7d1cp-20")),
         c5=F32(float.fromhex("0x1.0e4020p-7")), c4=F32(float.fromhex("0x1.573e2ep-5")), c3=F32(float.fromhex("0x1.555e66p-3")), c2=F32(float.fromhex("0x1.fffdb6p-2")),
         c1=F32(float.fromhex("0x1.ffffecp-1")))


def v_expf(x, isa):
    """ggml_v_expf, lane by lane (it has no cross-lane arithmetic), for the AVX2 or the AVX-512 build."""
    x = np.asarray(x, F32)
    with np.errstate(all="ignore"):
        z = fma(x, C["l2e"], C["r"])
        n = (z - C["r"]).astype(F32)
        b = fnma(n, C["ln2lo"], fnma(n, C["ln2hi"], x))
        u = (b * b).astype(F32)
        inner = fma(fma(C["c5"], b, C["c4"]), u, fma(C["c3"], b, C["c2"]))
        if isa == "avx512":
            j = fma(inner, u, fma(C["c1"], b, F32(1.0)))
            # _mm512_scalef_ps(j, n): j * 2^floor(n), rounded once
            nn = np.where(np.isfinite(n), n, 0).astype(F64)
            res = np.ldexp(j.astype(F64), np.clip(nn, -300, 300).astype(np.int64)).astype(F32)
            d = np.abs(n) > 192
            alt = np.where(n <= 0, F32(0), F32(np.inf)).astype(F32)
            return np.where(d, alt, res).astype(F32)
        j = fma(inner, u, (C["c1"] * b).astype(F32))
        e = (bits(z) << np.uint32(23)).astype(np.uint32)
        k = from_bits((e + bits(F32(1.0))).astype(np.uint32))
        c = np.abs(n) > 126
        normal = fma(j, k, k)
        g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0)).astype(np.uint32)
        s1 = from_bits((g + np.uint32(0x7f000000)).astype(np.uint32))
        s2 = from_bits((e - g).astype(np.uint32))
        d = np.abs(n) > 192
        special = np.where(d, (s1 * s1).astype(F32), (fma(s2, j, s2) * s1).astype(F32))
        return np.where(c, special, normal).astype(F32)


def lanes(isa):
    return 8 if isa == "avx2" else 16


def hsum(v, isa):
    """One vector's horizontal f32 sum: AVX2 GGML_F32x8_REDUCE tail / softmax's 8-lane sum; AVX-512
    _mm512_reduce_add_ps (halves, quarters, then lanes {0,1}+{2,3}, then 0+1)."""
    v = np.asarray(v, F32)
    if isa == "avx2":
        t = (v[..., 0:4] + v[..., 4:8]).astype(F32)
        return ((t[..., 0] + t[..., 2]).astype(F32) + (t[..., 1] + t[..., 3]).astype(F32)).astype(F32)
    t = (v[..., 0:8] + v[..., 8:16]).astype(F32)
    t = (t[..., 0:4] + t[..., 4:8]).astype(F32)
    t = (t[..., 0:2] + t[..., 2:4]).astype(F32)
    return (t[..., 0] + t[..., 1]).astype(F32)


def hsum_hadd(v):
    """GGML_F32x8_REDUCE's tail: t0 = lo128 + hi128, then two _mm_hadd_ps: (t0+t1)+(t2+t3)."""
    t = (v[..., 0:4] + v[..., 4:8]).astype(F32)
    return ((t[..., 0] + t[..., 1]).astype(F32) + (t[..., 2] + t[..., 3]).astype(F32)).astype(F32)


def vec_dot_f16(x, y, isa):
    """ggml_vec_dot_f16 over the last axis of x and y (already f16 values held in f32): products are exact
    in f32, so FMA = add of the exact product."""
    x = np.asarray(x, F32); y = np.asarray(y, F32)
    n = x.shape[-1]
    epr = lanes(isa); step = 4 * epr
    np_ = n - n % step
    shape = np.broadcast_shapes(x.shape, y.shape)[:-1]
    acc = np.zeros(shape + (4, epr), F32)
    for i in range(0, np_, step):
        p = (x[..., i:i + step] * y[..., i:i + step]).astype(F32).reshape(shape + (4, epr))
        acc = (acc + p).astype(F32)
    a0 = (acc[..., 0, :] + acc[..., 2, :]).astype(F32)
    a1 = (acc[..., 1, :] + acc[..., 3, :]).astype(F32)
    a0 = (a0 + a1).astype(F32)
    s = (hsum_hadd(a0) if isa == "avx2" else hsum(a0, "avx512")).astype(F64)
    for i in range(np_, n):
        s = s + (x[..., i].astype(F64) * y[..., i].astype(F64))
    return s.astype(F32)


def soft_max(row, scale, valid, isa):
    """ggml_compute_forward_soft_max_f32 on one row: wp = row*scale (+0 or -inf mask), max, then
    ggml_vec_soft_max_f32 and a scale by (float)(1.0/sum)."""
    wp = (np.asarray(row, F32) * F32(scale)).astype(F32)
    wp = np.where(valid, wp, F32(-np.inf)).astype(F32)
    mx = wp.max()
    n = len(wp); w = lanes(isa); i = 0; s = 0.0
    out = np.empty(n, F32)
    while i + w <= n:
        v = v_expf((wp[i:i + w] - mx).astype(F32), isa)
        out[i:i + w] = v
        s += float(hsum(v, isa))
        i += w
    for k in range(i, n):  # leftovers: libm expf (the rows here are multiples of 256 cells: none)
        v = F32(np.exp(F64(wp[k] - mx)))
        out[k] = v; s += float(v)
    inv = F32(1.0 / s)
    return (out * inv).astype(F32)


def silu_swiglu(x, g, isa):
    x = np.asarray(x, F32)
    e = v_expf((F32(0) - x).astype(F32), isa)
    return ((x / (F32(1) + e).astype(F32)).astype(F32) * np.asarray(g, F32)).astype(F32)


def f16(x):
    return np.asarray(x, F32).astype(np.float16).astype(F32)


def quantize(x, kind):
    """ggml's activation quantization for a matmul, as (int8 quants, block scales): quantize_row_q8_0/q8_1
    (x86: amax/127 per 32, the scale stored as f16 (q8_1 also f16(d * sum of quants))); q8_K (ref: per 256,
    iscale = -127/max with the signed max, the scale 1/iscale stored as f32)."""
    x = np.asarray(x, F32)
    if kind in ("q8_0", "q8_1"):
        b = x.reshape(-1, 32)
        amax = np.abs(b).max(axis=1, keepdims=True)
        with np.errstate(divide="ignore"):
            idv = np.where(amax != 0, (F32(127) / amax).astype(F32), F32(0)).astype(F32)
        q = np.rint((b * idv).astype(F32)).astype(np.int32)
        d = (amax[:, 0] / F32(127)).astype(F32).astype(np.float16)
        sc = d.astype(F32)
        if kind == "q8_1":
            sc = np.stack([sc, (d.astype(F32) * q.sum(axis=1).astype(F32)).astype(np.float16).astype(F32)], axis=1)
        return q.reshape(-1), sc.reshape(-1)
    b = x.reshape(-1, 256)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(len(b)), idx][:, None]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, (F32(-127) / mx).astype(F32), F32(0)).astype(F32)
    q = np.rint((b * iscale).astype(F32)).astype(np.int32)  # nearest_int: round half to even via magic add
    with np.errstate(divide="ignore"):
        d = (F32(1) / iscale[:, 0]).astype(F32)
    return np.minimum(q, 127).reshape(-1), d


def changes(x, y, kind):
    """(int8 quants that differ, block scales that differ) between two activations' quantizations."""
    qx, sx = quantize(x, kind); qy, sy = quantize(y, kind)
    return int((qx != qy).sum()), int((sx.view(np.uint32) != sy.view(np.uint32)).sum())


# ---------------------------------------------------------------- GGUF tensor types
ACT_TYPE = {2: "q8_0", 3: "q8_1", 6: "q8_0", 7: "q8_1", 8: "q8_0", 10: "q8_K", 11: "q8_K", 12: "q8_K",
            13: "q8_K", 14: "q8_K"}  # ggml type id of the weight -> its vec_dot_type (activation quantization)


def gguf_tensor_types(path):
    """{tensor name: ggml type id} from a GGUF file's header."""
    import struct
    f = open(path, "rb")
    rd = lambda fmt: struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]
    rstr = lambda: f.read(rd("Q")).decode("utf-8", "replace")
    assert f.read(4) == b"GGUF"
    rd("I"); n_t = rd("Q"); n_kv = rd("Q")
    sizes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def skip(t):
        if t == 8:
            rstr()
        elif t == 9:
            et = rd("I"); n = rd("Q")
            for _ in range(n):
                skip(et)
        else:
            rd(sizes[t])
    for _ in range(n_kv):
        rstr(); skip(rd("I"))
    out = {}
    for _ in range(n_t):
        name = rstr(); nd = rd("I")
        for _ in range(nd):
            rd("Q")
        out[name] = rd("I"); rd("Q")
    return out


# ---------------------------------------------------------------- llama.cpp capture
class T(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10),
                ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def capture(model, toks, wanted_layers):
    """Per step: {name: last f32 contiguous tensor of that name} for the layers wanted."""
    steps = []
    cur = {}
    suffixes = tuple(f"-{l}" for l in wanted_layers)

    @llama_cpp.ggml_backend_sched_eval_callback
    def cb(t, ask, ud):
        tt = ctypes.cast(t, ctypes.POINTER(T)).contents
        name = tt.name.decode()
        if ask:
            return True
        if tt.type == 0 and name.endswith(suffixes) and tt.nb[0] == 4 and tt.nb[1] == 4 * tt.ne[0]:
            ne = list(tt.ne); n = ne[0] * ne[1] * ne[2] * ne[3]
            cur[name] = np.ctypeslib.as_array(ctypes.cast(tt.data, ctypes.POINTER(ctypes.c_float)), shape=(n,)).copy().reshape(ne[3], ne[2], ne[1], ne[0])
        return True

    _dc = llama_cpp.llama_context_default_params
    def ctxp():
        p = _dc(); p.cb_eval = cb; return p
    llama_cpp.llama_context_default_params = ctxp
    llama_cpp.llama.llama_cpp.llama_context_default_params = ctxp
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llamacpp_norepack  # noqa: F401
    llm = llama_cpp.Llama(model_path=model, n_ctx=4096, n_batch=1, n_ubatch=1, n_threads=2, flash_attn=False,
                          logits_all=True, verbose=False)
    llm.reset()
    for t in toks:
        cur.clear()
        llm.eval([t])
        steps.append(dict(cur))
    meta = llm.metadata
    del llm
    return steps, meta


def cmp(a, b):
    """(elements whose bits differ, max |a - b| relative to max |b|)"""
    a = np.asarray(a, F32).reshape(-1); b = np.asarray(b, F32).reshape(-1)
    if a.shape != b.shape:
        return -1, 0.0
    nd = int((a.view(np.uint32) != b.view(np.uint32)).sum())
    rel = float(np.abs(a.astype(F64) - b.astype(F64)).max() / max(float(np.abs(b).max()), 1e-30)) if len(a) else 0.0
    return nd, rel


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("ids", type=int, nargs="+")
    ap.add_argument("--layers", default="0")
    ap.add_argument("--dump", help="reckon RECKON_DUMP_DIR of the same ids (ggml numerics)")
    ap.add_argument("--wo-type", help="activation quantization of wo's input (default: from the GGUF)")
    ap.add_argument("--down-type", help="activation quantization of ffn_down's input (default: from the GGUF)")
    a = ap.parse_args()
    lo, _, hi = a.layers.partition("-")
    layers = list(range(int(lo), int(hi or lo) + 1))
    print(f"# {stamp()}")
    steps, meta = capture(a.model, a.ids, layers)
    arch = meta.get("general.architecture")
    last = steps[-1]
    P = len(a.ids) - 1
    print(f"{os.path.basename(a.model)} ({arch}), {len(a.ids)} tokens, last position {P}; "
          f"llama-cpp-python {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}")
    hdr = f"{'layer':>5} {'stage':<12} {'n':>6} {'AVX2 emu vs llama.cpp':>22} {'AVX-512 emu vs llama.cpp':>25} {'AVX-512 emu vs reckon':>22}"
    print("(n differ: elements whose bits differ; rel: max |difference| / max |value| of the tensor)")
    print(hdr)
    ttypes = gguf_tensor_types(a.model)
    for L in layers:
        wo_type = a.wo_type or ACT_TYPE.get(ttypes.get(f"blk.{L}.attn_output.weight"), "q8_0")
        down_type = a.down_type or ACT_TYPE.get(ttypes.get(f"blk.{L}.ffn_down.weight"), "q8_0")
        def g(name, step=None):
            d = last if step is None else steps[step]
            ks = [k for k in d if k == f"{name}-{L}"]
            return d[ks[-1]] if ks else None
        q = g("Qcur"); kq = g("kq"); sm = g("kq_soft_max"); kqv = g("kqv"); kqv_out = g("kqv_out")
        if q is None or kq is None:
            print(f"{L:>5} (no attention tensors captured)"); continue
        n_head = kq.shape[1]; n_kv = kq.shape[-1]
        q = q.reshape(n_head, -1); hd = q.shape[1]
        Ks = np.stack([steps[p][f"Kcur-{L}"].reshape(-1, hd) for p in range(P + 1)])  # [pos, kv_head, hd]
        Vs = np.stack([steps[p][f"Vcur-{L}"].reshape(-1, hd) for p in range(P + 1)])
        n_kv_head = Ks.shape[1]; grp = n_head // n_kv_head
        Kc = np.zeros((n_kv, n_kv_head, hd), F32); Kc[:P + 1] = f16(Ks)
        Vc = np.zeros((n_kv, n_kv_head, hd), F32); Vc[:P + 1] = f16(Vs)
        kq_ll = kq.reshape(n_head, n_kv); sm_ll = sm.reshape(n_head, n_kv)
        # the cells each head attends: llama.cpp's nonzero probabilities, and every cell 0..P without a
        # sliding window (a probability can underflow to 0 on a valid cell)
        win = meta.get(f"{arch}.attention.sliding_window")
        valid_h = sm_ll != 0
        if win is None:
            valid_h[:, :P + 1] = True
        # scale: from llama.cpp's own soft_max input/output is not exposed; 1/sqrt(hd) unless Q was prescaled
        scale = F32(1.0) if arch == "gemma3" else F32(1.0 / np.sqrt(hd))
        res = {}
        if arch == "gemma3":  # Gemma-3 scales Q by 1/sqrt(head_dim) after RoPE (an unnamed ggml_scale)
            q = (q * F32(1.0 / np.sqrt(hd))).astype(F32)
        for isa in ("avx2", "avx512"):
            q16 = f16(q)
            kqe = np.stack([vec_dot_f16(Kc[:, h // grp, :], q16[h][None, :], isa) for h in range(n_head)])
            res[isa] = {"kq": kqe}
        # softmax emulated on llama.cpp's own kq (so its check is of softmax alone); then kqv on its own probs
        for isa in ("avx2", "avx512"):
            res[isa]["sm_on_ll"] = np.stack([soft_max(kq_ll[h], scale, valid_h[h], isa) for h in range(n_head)])
            res[isa]["sm"] = np.stack([soft_max(res[isa]["kq"][h], scale, valid_h[h], isa) for h in range(n_head)])
        def kqv_of(probs, isa):
            p16 = f16(probs)
            out = np.stack([vec_dot_f16(Vc[:, h // grp, :].T, p16[h][None, :], isa) for h in range(n_head)])
            return out  # [head, hd]
        for isa in ("avx2", "avx512"):
            res[isa]["kqv_on_ll"] = kqv_of(sm_ll, isa)
            res[isa]["kqv"] = kqv_of(res[isa]["sm"], isa)
        rk = {}
        if a.dump:
            def rd(name):
                p = os.path.join(a.dump, f"{name}-{L}.f32")
                return np.fromfile(p, dtype="<f4") if os.path.exists(p) else None
            rk["kq"] = [rd(f"kq-h{h}") for h in range(n_head)]
            rk["sm"] = [rd(f"kq_soft_max-h{h}") for h in range(n_head)]
            rk["kqv_out"] = rd("kqv_out"); rk["swiglu"] = rd("ffn_swiglu")
        def row(stage, n, e2, e5, r5):
            print(f"{L:>5} {stage:<12} {n:>6} {e2:>22} {e5:>25} {r5:>22}")
        fmt = lambda c: "identical" if c[0] == 0 else "size mismatch" if c[0] < 0 else f"{c[0]} differ, {c[1]:.1e} rel"
        # kq: llama.cpp's kq is before the scale; reckon's after (exact here: a power of two or 1)
        cells = slice(0, P + 1)
        e2 = cmp(res["avx2"]["kq"][:, cells], kq_ll[:, cells]); e5 = cmp(res["avx512"]["kq"][:, cells], kq_ll[:, cells])
        r5 = "-"
        if rk.get("kq") and all(x is not None for x in rk["kq"]):
            nrk = min(len(rk["kq"][0]), P + 1)
            r5 = fmt(cmp(np.stack([(res["avx512"]["kq"][h][P + 1 - nrk:P + 1] * scale).astype(F32) for h in range(n_head)]), np.stack(rk["kq"])))
        row("kq", n_head * (P + 1), fmt(e2), fmt(e5), r5)
        e2 = cmp(res["avx2"]["sm_on_ll"][:, cells], sm_ll[:, cells]); e5 = cmp(res["avx512"]["sm_on_ll"][:, cells], sm_ll[:, cells])
        r5 = "-"
        if rk.get("sm") and all(x is not None for x in rk["sm"]):
            nrk = min(len(rk["sm"][0]), P + 1)
            r5 = fmt(cmp(np.stack([res["avx512"]["sm"][h][P + 1 - nrk:P + 1] for h in range(n_head)]), np.stack(rk["sm"])))
        row("kq_soft_max", n_head * (P + 1), fmt(e2), fmt(e5), r5)
        kqv_ll = kqv.reshape(n_head, hd)
        e2 = cmp(res["avx2"]["kqv_on_ll"], kqv_ll); e5 = cmp(res["avx512"]["kqv_on_ll"], kqv_ll)
        r5 = fmt(cmp(res["avx512"]["kqv"].reshape(-1), rk["kqv_out"])) if rk.get("kqv_out") is not None else "-"
        row("kqv", n_head * hd, fmt(e2), fmt(e5), r5)
        # which stage changes wo's input quantization: every mix of the three stages' arithmetic
        base = res["avx2"]["kqv"].reshape(-1)
        mixes = []
        for s_kq in ("avx2", "avx512"):
            for s_sm in ("avx2", "avx512"):
                for s_v in ("avx2", "avx512"):
                    kqm = res[s_kq]["kq"]
                    smm = np.stack([soft_max(kqm[h], scale, valid_h[h], s_sm) for h in range(n_head)])
                    out = kqv_of(smm, s_v).reshape(-1)
                    nq, ns = changes(out, base, wo_type)
                    tag = "/".join("2" if z == "avx2" else "5" for z in (s_kq, s_sm, s_v))
                    mixes.append(f"{tag}:{nq}q{ns}s")
        nq, ns = changes(kqv.reshape(-1), base, wo_type)
        print(f"{L:>5}   wo input ({wo_type}): quants (q) and block scales (s) changed against all-AVX2 arithmetic, with "
              "kq/softmax/kqv each in AVX2 (2) or AVX-512 (5) arithmetic: " + " ".join(mixes)
              + f"  [llama.cpp's own kqv vs AVX2 emu: {nq}q{ns}s]")
        gate, up, sw = g("ffn_gate"), g("ffn_up"), g("ffn_swiglu")
        if gate is not None and up is not None and sw is not None:
            e = {isa: silu_swiglu(gate.reshape(-1), up.reshape(-1), isa) for isa in ("avx2", "avx512")}
            r5 = fmt(cmp(e["avx512"], rk["swiglu"])) if rk.get("swiglu") is not None else "-"
            row("ffn_swiglu", gate.size, fmt(cmp(e["avx2"], sw)), fmt(cmp(e["avx512"], sw)), r5)
            nq, ns = changes(e["avx2"], e["avx512"], down_type)
            print(f"{L:>5}   ffn_down input ({down_type}), AVX2 vs AVX-512 swiglu: {nq} quants, {ns} block scales changed")


if __name__ == "__main__":
    main()
