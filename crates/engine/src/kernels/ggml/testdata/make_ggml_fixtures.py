#!/usr/bin/env python3
"""Write ggml_x86.bin: vec_dot results and quantized activations computed by llama.cpp's own CPU
library (libggml-cpu.so from llama-cpp-python, built for x86 with AVX2 or better), so reckon's SIMD
kernels can be checked to be bit-identical to llama.cpp, not just close.

Usage: python3 make_ggml_fixtures.py [LIB_DIR]
  LIB_DIR holds libggml-base.so and libggml-cpu.so; default: the llama_cpp package's lib folder of
  the python running this script (e.g. /opt/llamacpp-venv/bin/python make_ggml_fixtures.py).
Deterministic inputs (fixed seed). Rerun only to regenerate, on an x86 machine with AVX2.

Format, little-endian: b"RQGX", u32 version = 2, u32 record count, then per record:
  u32 weight ggml type id, u32 n, u32 weight bytes, u32 activation bytes, u32 n_x (n or 0),
  weight bytes, n_x f32 activations (input; 0 for the long dot-only rows, to stay small),
  activation bytes (x quantized by ggml's quantize_row_q8_*), f32 ggml_vec_dot result.
"""
import ctypes
import os
import struct
import sys

import numpy as np

if len(sys.argv) > 1:
    lib_dir = sys.argv[1]
else:
    import llama_cpp
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
ggml = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"))
ggml.ggml_cpu_init()  # fills ggml's f16 -> f32 table

rng = np.random.default_rng(20240602)

# small rows too: there every rounding step shows in the result
LEGACY_LENGTHS = [32, 32, 64, 64, 96, 96, 160, 160, 576, 576]
K_LENGTHS = [256, 256, 512, 512, 1024, -4864]  # negative: dot-only record, and large dmin
# (long chains of the Q5_K `summs += dmin * isum`, which GCC contracts to an FMA)

# name, ggml id, block len, block bytes, f16 scale offsets, activation (name, block bytes), lengths
TYPES = [
    ("q4_0", 2, 32, 18, [0], ("q8_0", 34), LEGACY_LENGTHS),
    ("q4_1", 3, 32, 20, [0, 2], ("q8_1", 36), LEGACY_LENGTHS),
    ("q5_0", 6, 32, 22, [0], ("q8_0", 34), LEGACY_LENGTHS),
    ("q5_1", 7, 32, 24, [0, 2], ("q8_1", 36), LEGACY_LENGTHS),
    ("q8_0", 8, 32, 34, [0], ("q8_0", 34), LEGACY_LENGTHS),
    ("q4_K", 12, 256, 144, [0, 2], ("q8_K", 292), K_LENGTHS),
    ("q5_K", 13, 256, 176, [0, 2], ("q8_K", 292), K_LENGTHS),
    ("q6_K", 14, 256, 210, [208], ("q8_K", 292), K_LENGTHS),
]

records = []
for name, tid, bl, bb, f16_offs, (act, ab), lengths in TYPES:
    vec_dot = getattr(ggml, f"ggml_vec_dot_{name}_{act}")
    quantize = getattr(ggml, f"quantize_row_{act}")
    for n in lengths:
        dot_only, n = n < 0, abs(n)
        nb = n // bl
        w = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)
        scale = 0.01 if bl == 256 else 0.1
        for k, off in enumerate(f16_offs):
            s = (rng.uniform(-1, 1, nb) * scale * (5 if dot_only and k == 1 else 1)).astype(np.float16)
            w[:, off:off + 2] = s.view(np.uint8).reshape(nb, 2)
        w = np.ascontiguousarray(w).ravel()
        x = rng.uniform(-1, 1, n).astype(np.float32)
        x[rng.integers(0, n, n // 32)] *= 20  # outliers
        xq = np.zeros(n // (32 if act != "q8_K" else 256) * ab, dtype=np.uint8)
        quantize(x.ctypes.data_as(ctypes.c_void_p), xq.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n))
        out = ctypes.c_float(0)
        vec_dot(ctypes.c_int(n), ctypes.byref(out), ctypes.c_size_t(0), w.ctypes.data_as(ctypes.c_void_p),
                ctypes.c_size_t(0), xq.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(0), ctypes.c_int(1))
        xs = b"" if dot_only else x.astype("<f4").tobytes()
        records.append(struct.pack("<IIIII", tid, n, w.size, xq.size, len(xs) // 4) + w.tobytes() + xs
                       + xq.tobytes() + struct.pack("<f", out.value))

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ggml_x86.bin")
with open(path, "wb") as f:
    f.write(b"RQGX" + struct.pack("<II", 2, len(records)))
    for r in records:
        f.write(r)
print(f"wrote {path}: {len(records)} records, {os.path.getsize(path)} bytes (libs from {lib_dir})")
