//! Block layouts of the ggml types, as byte offsets into a block (ggml-common.h). All multi-byte
//! fields are little-endian; `f16` fields are IEEE binary16.
//!
//! Legacy quants (32 elements per block). Element j of a 4/5-bit block lives in the LOW nibble of
//! `qs[j]` for j < 16 and in the HIGH nibble of `qs[j-16]` for j >= 16; the 5th bit of element j is bit
//! j of the little-endian u32 `qh`.
//!   Q4_0 { d: f16, qs: [u8; 16] }                      x = (q - 8) * d
//!   Q4_1 { d: f16, m: f16, qs: [u8; 16] }              x = q * d + m
//!   Q5_0 { d: f16, qh: [u8; 4], qs: [u8; 16] }         x = (q - 16) * d
//!   Q5_1 { d: f16, m: f16, qh: [u8; 4], qs: [u8; 16] } x = q * d + m
//!   Q8_0 { d: f16, qs: [i8; 32] }                      x = q * d
//!   Q8_1 { d: f16, s: f16, qs: [i8; 32] }              x = q * d, s = d * sum(q) (for the m term)
//!
//! K-quants (256 elements per super-block): see `dequant.rs` for the element order of each.
//!   Q4_K { d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128] }
//!   Q5_K { d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128] }
//!   Q6_K { ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16 }
//!   Q8_K { d: f32, qs: [i8; 256], bsums: [i16; 16] }   bsums[g] = sum of qs[16g..16g+16]

/// Elements per block of the legacy quants (QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = QK8_1).
pub const QK: usize = 32;
/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

pub const Q4_0_BYTES: usize = 2 + 16;
pub const Q4_1_BYTES: usize = 4 + 16;
pub const Q5_0_BYTES: usize = 2 + 4 + 16;
pub const Q5_1_BYTES: usize = 4 + 4 + 16;
pub const Q8_0_BYTES: usize = 2 + 32;
pub const Q8_1_BYTES: usize = 4 + 32;
pub const Q4_K_BYTES: usize = 4 + 12 + 128;
pub const Q5_K_BYTES: usize = 4 + 12 + 32 + 128;
pub const Q6_K_BYTES: usize = 128 + 64 + 16 + 2;
pub const Q8_K_BYTES: usize = 4 + 256 + 32;

// Field offsets of the K-quant blocks.
pub const K4_SCALES: usize = 4;
pub const Q4_K_QS: usize = 16;
pub const Q5_K_QH: usize = 16;
pub const Q5_K_QS: usize = 48;
pub const Q6_K_QH: usize = 128;
pub const Q6_K_SCALES: usize = 192;
pub const Q6_K_D: usize = 208;
pub const Q8_K_QS: usize = 4;
pub const Q8_K_BSUMS: usize = 260;

/// f16 (stored bits) to f32; exact.
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// f32 to f16 bits, round to nearest even (what ggml's GGML_FP32_TO_FP16 does with F16C or in C).
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

#[inline(always)]
pub fn rd_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

#[inline(always)]
pub fn rd_f16(b: &[u8], off: usize) -> f32 {
    f16_to_f32(rd_u16(b, off))
}

#[inline(always)]
pub fn rd_f32(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline(always)]
pub fn rd_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline(always)]
pub fn rd_i16(b: &[u8], off: usize) -> i16 {
    rd_u16(b, off) as i16
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block.
/// The 12 bytes pack eight 6-bit scales `S` and eight 6-bit mins `M`:
///   bytes 0..4:  S0..S3 in bits 0-5; bits 6-7 are the high 2 bits of S4..S7
///   bytes 4..8:  M0..M3 in bits 0-5; bits 6-7 are the high 2 bits of M4..M7
///   bytes 8..12: low 4 bits of S4..S7 in bits 0-3, low 4 bits of M4..M7 in bits 4-7
#[inline(always)]
pub fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        let sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (sc, m)
    }
}

/// All eight scales and mins of a Q4_K/Q5_K block at once, as ggml's SIMD code unpacks them (the
/// `utmp` trick): bytes of words 0-1 are scales 0..8, bytes of words 2-3 are mins 0..8.
#[inline(always)]
pub fn unpack_k4_scales(q: &[u8]) -> [u32; 4] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let (a, b, c) = (rd_u32(q, 0), rd_u32(q, 4), rd_u32(q, 8));
    [
        a & KMASK1,
        (c & KMASK2) | (((a >> 6) & KMASK3) << 4),
        b & KMASK1,
        ((c >> 4) & KMASK2) | (((b >> 6) & KMASK3) << 4),
    ]
}

/// Scales (first 8 bytes) and mins (last 8 bytes) of a Q4_K/Q5_K block as bytes.
#[inline(always)]
pub fn k4_scales_mins(q: &[u8]) -> [u8; 16] {
    let u = unpack_k4_scales(q);
    let mut out = [0u8; 16];
    for (i, w) in u.iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out
}
