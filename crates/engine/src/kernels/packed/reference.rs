//! The packed numerics defined in plain Rust, on the GGUF (ggml) block layouts: one (row, token) dot.
//! Every packed kernel must return exactly these bits; nothing here is tuned for speed.

use crate::kernels::ggml::blocks::*;
use crate::kernels::ggml::GgmlType;
use super::acts::k_side;

/// The dot of one weight row of type `t` (`n` elements, ggml bytes) with one activation row quantized
/// to `t.dot_activation_type()` (ggml bytes), in the packed numerics (see the module docs of `packed`).
pub fn dot(t: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wb, ab) = (t.block_bytes(), t.dot_activation_type().block_bytes());
    let blocks = w.chunks_exact(wb).zip(a.chunks_exact(ab)).take(n / t.block_len());
    let mut acc = 0.0f32;
    for (x, y) in blocks {
        acc = match t {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::Q4_1 => legacy_block(t, x, y, acc),
            GgmlType::Q4_K => q4_k_block(x, y, acc),
            GgmlType::Q6_K => q6_k_block(x, y, acc),
            other => panic!("{other} has no packed numerics"),
        };
    }
    acc
}

/// The unsigned codes of a legacy weight block and the offset that makes them signed (`w = q − o`).
pub(super) fn legacy_codes(t: GgmlType, x: &[u8]) -> ([u8; 32], i32) {
    let mut q = [0u8; 32];
    let nibbles = |qs: &[u8], q: &mut [u8; 32]| {
        for j in 0..16 {
            q[j] = qs[j] & 0x0F;
            q[j + 16] = qs[j] >> 4;
        }
    };
    match t {
        GgmlType::Q4_0 => {
            nibbles(&x[2..18], &mut q);
            (q, 8)
        }
        GgmlType::Q4_1 => {
            nibbles(&x[4..20], &mut q);
            (q, 0)
        }
        GgmlType::Q5_0 => {
            nibbles(&x[6..22], &mut q);
            let qh = rd_u32(x, 2);
            for (j, v) in q.iter_mut().enumerate() {
                *v |= (((qh >> j) & 1) as u8) << 4;
            }
            (q, 16)
        }
        GgmlType::Q8_0 => {
            for (v, &b) in q.iter_mut().zip(&x[2..34]) {
                *v = b ^ 0x80;
            }
            (q, 128)
        }
        other => panic!("{other} is not a legacy weight type"),
    }
}

fn legacy_block(t: GgmlType, x: &[u8], y: &[u8], acc: f32) -> f32 {
    let (q, o) = legacy_codes(t, x);
    let qy = if t == GgmlType::Q4_1 { &y[4..36] } else { &y[2..34] };
    let ysum: i32 = qy.iter().map(|&v| v as i8 as i32).sum();
    let s: i32 = q.iter().zip(qy).map(|(&a, &b)| a as i32 * b as i8 as i32).sum::<i32>() - o * ysum;
    let acc = (rd_f16(x, 0) * rd_f16(y, 0)).mul_add(s as f32, acc);
    if t == GgmlType::Q4_1 {
        rd_f16(x, 2).mul_add(rd_f16(y, 2), acc)
    } else {
        acc
    }
}

/// Q4_K's 256 codes in element order (see `dequant::q4_k`) and its 8 scales and mins.
pub(super) fn q4_k_codes(x: &[u8]) -> ([u8; 256], [u8; 8], [u8; 8]) {
    let scales = &x[K4_SCALES..K4_SCALES + 12];
    let qs = &x[Q4_K_QS..Q4_K_QS + 128];
    let mut q = [0u8; 256];
    for c in 0..4 {
        for l in 0..32 {
            q[64 * c + l] = qs[32 * c + l] & 0x0F;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    }
    let sm: [(u8, u8); 8] = std::array::from_fn(|j| get_scale_min_k4(j, scales));
    (q, sm.map(|p| p.0), sm.map(|p| p.1))
}

fn q4_k_block(x: &[u8], y: &[u8], acc: f32) -> f32 {
    let (q, sc, m) = q4_k_codes(x);
    let qy = &y[Q8_K_QS..Q8_K_QS + 256];
    let side = k_side(y);
    let s: i32 = (0..8).map(|j| sc[j] as i32 * (0..32).map(|l| q[32 * j + l] as i32 * qy[32 * j + l] as i8 as i32).sum::<i32>()).sum();
    let mins: i32 = (0..8).map(|j| m[j] as i32 * side.sum32[j] as i32).sum();
    let dy = side.d;
    let acc = (rd_f16(x, 0) * dy).mul_add(s as f32, acc);
    (-(rd_f16(x, 2) * dy)).mul_add(mins as f32, acc)
}

/// Q6_K's 256 codes (0..63, `w = q − 32`) in element order (see `dequant::q6_k`) and its 16 scales.
pub(super) fn q6_k_codes(x: &[u8]) -> ([u8; 256], [i8; 16]) {
    let mut q = [0u8; 256];
    for h in 0..2 {
        let ql = &x[64 * h..64 * h + 64];
        let qh = &x[Q6_K_QH + 32 * h..Q6_K_QH + 32 * h + 32];
        for l in 0..32 {
            q[128 * h + l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
            q[128 * h + l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
            q[128 * h + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[128 * h + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    (q, std::array::from_fn(|j| x[Q6_K_SCALES + j] as i8))
}

fn q6_k_block(x: &[u8], y: &[u8], acc: f32) -> f32 {
    let (q, sc) = q6_k_codes(x);
    let qy = &y[Q8_K_QS..Q8_K_QS + 256];
    let side = k_side(y);
    let s: i32 = (0..16)
        .map(|j| sc[j] as i32 * ((0..16).map(|l| q[16 * j + l] as i32 * qy[16 * j + l] as i8 as i32).sum::<i32>() + side.neg32_sum16[j]))
        .sum();
    (rd_f16(x, Q6_K_D) * side.d).mul_add(s as f32, acc)
}
