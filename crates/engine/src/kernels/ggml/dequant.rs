//! Reference dequantization, the ground truth for every other kernel. Each function mirrors ggml's
//! `dequantize_row_*` including the f32 operation order (e.g. Q6_K computes `(d * sc) * q`), so results
//! are bit-identical to ggml's C (compiled without FMA contraction) and to gguf-py's numpy code.

use super::blocks::*;
use super::GgmlType;

/// Dequantize `dst.len()` elements of type `t` from `src`, which holds whole blocks for them.
pub fn dequantize_row(t: GgmlType, src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    let need = t
        .row_bytes(n)
        .unwrap_or_else(|| panic!("dequantize_row {t}: {n} is not a multiple of {}", t.block_len()));
    assert!(
        src.len() >= need,
        "dequantize_row {t}: src has {} bytes, need {need}",
        src.len()
    );
    let src = &src[..need];
    let bl = t.block_len();
    let blocks = src.chunks_exact(t.block_bytes()).zip(dst.chunks_exact_mut(bl));
    match t {
        GgmlType::F32 => {
            for (b, y) in blocks {
                y[0] = rd_f32(b, 0);
            }
        }
        GgmlType::F16 => {
            for (b, y) in blocks {
                y[0] = rd_f16(b, 0);
            }
        }
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8(rd_f16(b, 0), &b[2..], y)),
        GgmlType::Q8_1 => blocks.for_each(|(b, y)| q8(rd_f16(b, 0), &b[4..], y)),
        GgmlType::Q4_K => blocks.for_each(|(b, y)| q4_k(b, y)),
        GgmlType::Q5_K => blocks.for_each(|(b, y)| q5_k(b, y)),
        GgmlType::Q6_K => blocks.for_each(|(b, y)| q6_k(b, y)),
        GgmlType::Q8_K => blocks.for_each(|(b, y)| q8(rd_f32(b, 0), &b[Q8_K_QS..], y)),
    }
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The 5-bit values of a Q5 block: nibble plus bit j of qh as bit 4.
fn q5_values(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
        q[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    q
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, 0);
    let q = q5_values(rd_u32(b, 2), &b[6..22]);
    for j in 0..32 {
        y[j] = (q[j] as i32 - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
    let q = q5_values(rd_u32(b, 4), &b[8..24]);
    for j in 0..32 {
        y[j] = q[j] as f32 * d + m;
    }
}

fn q8(d: f32, qs: &[u8], y: &mut [f32]) {
    for (y, &q) in y.iter_mut().zip(qs) {
        *y = (q as i8) as f32 * d;
    }
}

/// Q4_K: 8 sub-blocks of 32, each `x = (d*sc) * q - dmin*m`. The 128 qs bytes are 4 chunks of 32
/// bytes; chunk c holds sub-block 2c in its low nibbles and sub-block 2c+1 in its high nibbles.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (rd_f16(b, 0), rd_f16(b, 2));
    let scales = &b[K4_SCALES..K4_SCALES + 12];
    let qs = &b[Q4_K_QS..Q4_K_QS + 128];
    for c in 0..4 {
        let (sc1, m1) = get_scale_min_k4(2 * c, scales);
        let (sc2, m2) = get_scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * c..32 * c + 32];
        let y = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// Q5_K: like Q4_K, plus a 5th bit: for sub-block s, bit s of `qh[l]` belongs to element l.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (rd_f16(b, 0), rd_f16(b, 2));
    let scales = &b[K4_SCALES..K4_SCALES + 12];
    let qh = &b[Q5_K_QH..Q5_K_QH + 32];
    let qs = &b[Q5_K_QS..Q5_K_QS + 128];
    for c in 0..4 {
        let (sc1, m1) = get_scale_min_k4(2 * c, scales);
        let (sc2, m2) = get_scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * c..32 * c + 32];
        let y = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            let h1 = ((qh[l] >> (2 * c)) & 1) << 4;
            let h2 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
            y[l] = d1 * ((q[l] & 0x0F) | h1) as f32 - m1;
            y[l + 32] = d2 * ((q[l] >> 4) | h2) as f32 - m2;
        }
    }
}

/// Q6_K: 16 groups of 16 with signed 8-bit scales, `x = (d*sc) * (q - 32)`. Each half (128 elements)
/// uses 64 ql bytes and 32 qh bytes: for l in 0..32,
///   x[l]    = ql[l]    low  | qh[l] bits 0-1     x[l+64] = ql[l]    high | qh[l] bits 4-5
///   x[l+32] = ql[l+32] low  | qh[l] bits 2-3     x[l+96] = ql[l+32] high | qh[l] bits 6-7
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = rd_f16(b, Q6_K_D);
    for h in 0..2 {
        let ql = &b[64 * h..64 * h + 64];
        let qh = &b[Q6_K_QH + 32 * h..Q6_K_QH + 32 * h + 32];
        let sc = &b[Q6_K_SCALES + 8 * h..Q6_K_SCALES + 8 * h + 8];
        let y = &mut y[128 * h..128 * h + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * (sc[is + k] as i8) as f32;
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
}
