#!/usr/bin/env python3
"""Write fixtures.bin: random blocks of each ggml type with gguf-py's numpy dequantization, and random
f32 rows with gguf-py's quantization (Q8_0, F16), to check reckon's quant module against an
independent implementation. Deterministic (fixed seed); rerun only to regenerate.

Usage: python3 make_fixtures.py      (needs numpy and gguf: pip install gguf)

Format, little-endian: b"RQFX", u32 version = 1, u32 record count, then per record:
  u8 kind (0 = dequantize: bytes -> f32, 1 = quantize: f32 -> bytes), u32 ggml type id,
  u32 n_elements, u32 n_bytes, n_bytes of block data, n_elements f32 values.
"""
import os
import struct

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

rng = np.random.default_rng(20240601)
N = 1024  # elements per record: 32 legacy blocks or 4 super-blocks


def f16_bytes(values):
    return np.asarray(values, dtype=np.float16).view(np.uint8)


def random_scales(count):
    """Finite f16 scales of mixed sign and magnitude, including 0 and a subnormal."""
    s = rng.standard_normal(count).astype(np.float32) * np.float32(0.05)
    s[0] = 0.0
    if count > 1:
        s[1] = 3.0e-6  # f16 subnormal
    if count > 2:
        s[2] = -1.5
    return s


# byte offsets of the f16 scale fields inside each block
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def random_blocks(qtype):
    block_len, block_bytes = GGML_QUANT_SIZES[qtype]
    nb = N // block_len
    raw = rng.integers(0, 256, size=(nb, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off:off + 2] = f16_bytes(random_scales(nb)).reshape(nb, 2)
    return raw


records = []


def add(kind, qtype, data_bytes, values):
    values = np.asarray(values, dtype=np.float32).ravel()
    data_bytes = np.ascontiguousarray(data_bytes).view(np.uint8).ravel().tobytes()  # reinterpret, not cast
    records.append(struct.pack("<BIII", kind, int(qtype), values.size, len(data_bytes)) + data_bytes
                   + values.astype("<f4").tobytes())


for qtype in [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]:
    raw = random_blocks(qtype)
    add(0, qtype, raw, dequantize(raw, qtype))

# F16 dequantize: random finite halves incl. +-0, subnormals and +-inf
h = rng.integers(0, 0x10000, size=N, dtype=np.uint32).astype(np.uint16)
h[(h & 0x7C00) == 0x7C00] &= 0xFC00  # NaN -> inf (keep sign); inf stays inf
h[:4] = [0x0000, 0x8000, 0x0001, 0x83FF]
add(0, T.F16, h.view(np.uint8), dequantize(h.view(np.uint8), T.F16))

# quantize: gguf-py's Q8_0 is bit-exact with quantize_row_q8_0_ref; F16 is numpy's RNE conversion
x = (rng.standard_normal(N) * np.exp(rng.standard_normal(N))).astype(np.float32)
x[32:64] = 0.0  # an all-zero block
x[64:96] = np.arange(32, dtype=np.float32) - 15.5  # a ramp of half-integers
# d = 1 exactly, so these are exact .5 ties: roundf rounds them away from zero
x[96:128] = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5] + [0.25] * 25, dtype=np.float32)
add(1, T.Q8_0, quantize(x, T.Q8_0), x)
add(1, T.F16, quantize(x, T.F16), x)

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures.bin")
with open(out, "wb") as f:
    f.write(b"RQFX" + struct.pack("<II", 1, len(records)))
    for r in records:
        f.write(r)
print(f"wrote {out}: {len(records)} records, {os.path.getsize(out)} bytes")
