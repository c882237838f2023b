//! Scalar reference `vec_dot` kernels. Each mirrors ggml's generic `ggml_vec_dot_*_ref` C code,
//! including the f32 operation order per block, so on a non-SIMD build they reproduce ggml exactly.
//! They are the yardstick the SIMD kernels are tested against.

use super::blocks::*;
use super::{check_dot_args, GgmlType, VecDotFn};

pub(super) fn kernel(t: GgmlType) -> VecDotFn {
    match t {
        GgmlType::F32 => f32_f32,
        GgmlType::F16 => f16_f16,
        GgmlType::Q4_0 => q4_0_q8_0,
        GgmlType::Q4_1 => q4_1_q8_1,
        GgmlType::Q5_0 => q5_0_q8_0,
        GgmlType::Q5_1 => q5_1_q8_1,
        GgmlType::Q8_0 => q8_0_q8_0,
        GgmlType::Q4_K => q4_k_q8_k,
        GgmlType::Q5_K => q5_k_q8_k,
        GgmlType::Q6_K => q6_k_q8_k,
        GgmlType::Q8_1 | GgmlType::Q8_K => unreachable!("{t} has no vec_dot"),
    }
}

/// Blocks of weight type `t` zipped with their activation blocks, after the length checks.
fn block_pairs<'a>(t: GgmlType, n: usize, w: &'a [u8], a: &'a [u8]) -> impl Iterator<Item = (&'a [u8], &'a [u8])> {
    check_dot_args(t, n, w, a);
    let nb = n / t.block_len();
    let ab = t.dot_activation_type().block_bytes();
    w.chunks_exact(t.block_bytes()).zip(a.chunks_exact(ab)).take(nb)
}

/// ggml_vec_dot_f32 as llama.cpp's x86 build for AVX-512 computes it, at every SIMD level (as the ggml
/// math routines are): 4 accumulators of 16 lanes, FMA, 64 elements a step; the accumulators added
/// 0+2, 1+3, then 0+1, reduced in `_mm512_reduce_add_ps`'s order; the tail past a multiple of 64
/// added one product at a time into the f32 sum with FMA (GCC contracts `sumf += x*y`). The reference
/// for `dot_avx2`'s F32 kernel, which gives these bits at vector speed (an MoE's F32 routers).
fn f32_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    check_dot_args(GgmlType::F32, n, w, a);
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::allows(crate::kernels::cpu::SimdLevel::Avx2) {
        // SAFETY: the CPU has FMA (the Avx2 level needs it), checked just above.
        return unsafe { f32_f32_fma(n, w, a) };
    }
    f32_f32_any(n, w, a)
}

/// `f32_f32` compiled with FMA, so `mul_add` is one instruction rather than a libm call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn f32_f32_fma(n: usize, w: &[u8], a: &[u8]) -> f32 {
    f32_f32_any(n, w, a)
}

#[inline(always)]
fn f32_f32_any(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (x, y) = (|i: usize| rd_f32(w, 4 * i), |i: usize| rd_f32(a, 4 * i));
    let whole = n / 64 * 64;
    let mut acc = [[0.0f32; 16]; 4];
    for i in (0..whole).step_by(64) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, lane) in lanes.iter_mut().enumerate() {
                let k = i + 16 * j + l;
                *lane = x(k).mul_add(y(k), *lane);
            }
        }
    }
    let [mut a0, mut a1, a2, a3] = acc;
    for l in 0..16 {
        a0[l] += a2[l];
        a1[l] += a3[l];
    }
    for l in 0..16 {
        a0[l] += a1[l];
    }
    let mut sum = crate::kernels::ggml::math::reduce_add_16(&a0);
    for i in whole..n {
        sum = x(i).mul_add(y(i), sum);
    }
    sum
}

fn f16_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let sum: f64 = block_pairs(GgmlType::F16, n, w, a)
        .map(|(x, y)| (rd_f16(x, 0) * rd_f16(y, 0)) as f64)
        .sum();
    sum as f32
}

/// Sum over a 32-element legacy block of (signed weight) * (q8 activation).
#[inline(always)]
fn dot32(q: &[i32; 32], y: &[u8]) -> i32 {
    // ggml keeps two partial sums (first and second half); integer addition makes the order moot.
    q.iter().zip(y).map(|(&q, &y)| q * (y as i8) as i32).sum()
}

#[inline(always)]
fn nibbles(qs: &[u8], offset: i32) -> [i32; 32] {
    let mut q = [0i32; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0F) as i32 - offset;
        q[j + 16] = (qs[j] >> 4) as i32 - offset;
    }
    q
}

#[inline(always)]
fn nibbles5(qh: u32, qs: &[u8], offset: i32) -> [i32; 32] {
    let mut q = [0i32; 32];
    for j in 0..16 {
        q[j] = ((qs[j] & 0x0F) as i32 | (((qh >> j) & 1) << 4) as i32) - offset;
        q[j + 16] = ((qs[j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32) - offset;
    }
    q
}

fn q4_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs(GgmlType::Q4_0, n, w, a) {
        let sumi = dot32(&nibbles(&x[2..18], 8), &y[2..34]);
        sumf += sumi as f32 * rd_f16(x, 0) * rd_f16(y, 0);
    }
    sumf
}

fn q4_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs(GgmlType::Q4_1, n, w, a) {
        let sumi = dot32(&nibbles(&x[4..20], 0), &y[4..36]);
        sumf += (rd_f16(x, 0) * rd_f16(y, 0)) * sumi as f32 + rd_f16(x, 2) * rd_f16(y, 2);
    }
    sumf
}

fn q5_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs(GgmlType::Q5_0, n, w, a) {
        let sumi = dot32(&nibbles5(rd_u32(x, 2), &x[6..22], 16), &y[2..34]);
        sumf += (rd_f16(x, 0) * rd_f16(y, 0)) * sumi as f32;
    }
    sumf
}

fn q5_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs(GgmlType::Q5_1, n, w, a) {
        let sumi = dot32(&nibbles5(rd_u32(x, 4), &x[8..24], 0), &y[4..36]);
        sumf += (rd_f16(x, 0) * rd_f16(y, 0)) * sumi as f32 + rd_f16(x, 2) * rd_f16(y, 2);
    }
    sumf
}

fn q8_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs(GgmlType::Q8_0, n, w, a) {
        let sumi: i32 = x[2..34]
            .iter()
            .zip(&y[2..34])
            .map(|(&p, &q)| (p as i8) as i32 * (q as i8) as i32)
            .sum();
        sumf += sumi as f32 * (rd_f16(x, 0) * rd_f16(y, 0));
    }
    sumf
}

/// The K-quant tail shared by ggml's generic Q4_K/Q5_K/Q6_K code: the 256 signed weights `q` are
/// multiplied with the activations in runs of 8, scaled per sub-block of `sub` elements and summed
/// into 8 integer lanes, which are scaled by `d` into 8 float lanes (`sums`).
#[inline(always)]
fn k_lanes(q: &[i8; QK_K], y: &[u8], scale: impl Fn(usize) -> i32, sub: usize, d: f32, sums: &mut [f32; 8]) {
    let mut aux32 = [0i32; 8];
    for (j, (qq, yy)) in q
        .chunks_exact(8)
        .zip(y[Q8_K_QS..Q8_K_QS + QK_K].chunks_exact(8))
        .enumerate()
    {
        let s = scale(j * 8 / sub);
        for l in 0..8 {
            aux32[l] += s * (qq[l] as i32 * (yy[l] as i8) as i32);
        }
    }
    for l in 0..8 {
        sums[l] += d * aux32[l] as f32;
    }
}

/// ggml's final `for (l = 0; l < 8; ++l) sumf += sums[l];`.
#[inline(always)]
fn finish(mut sumf: f32, sums: &[f32; 8]) -> f32 {
    for s in sums {
        sumf += s;
    }
    sumf
}

/// `sum_j mins[j] * (bsums[2j] + bsums[2j+1])`, the activation sum of each 32-sub-block times its min.
#[inline(always)]
fn k4_min_term(mins: &[u8], y: &[u8]) -> i32 {
    (0..16)
        .map(|g| rd_i16(y, Q8_K_BSUMS + 2 * g) as i32 * mins[g / 2] as i32)
        .sum()
}

fn q4_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sums = [0f32; 8];
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs(GgmlType::Q4_K, n, w, a) {
        let mut q = [0i8; QK_K];
        let qs = &x[Q4_K_QS..Q4_K_QS + 128];
        for c in 0..4 {
            for l in 0..32 {
                q[64 * c + l] = (qs[32 * c + l] & 0x0F) as i8;
                q[64 * c + 32 + l] = (qs[32 * c + l] >> 4) as i8;
            }
        }
        let sm = k4_scales_mins(&x[K4_SCALES..K4_SCALES + 12]);
        let sumi = k4_min_term(&sm[8..16], y);
        let yd = rd_f32(y, 0);
        k_lanes(&q, y, |s| sm[s] as i32, 32, rd_f16(x, 0) * yd, &mut sums);
        sumf -= rd_f16(x, 2) * yd * sumi as f32;
    }
    finish(sumf, &sums)
}

fn q5_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sums = [0f32; 8];
    let mut sumf = 0.0f32;
    for (x, y) in block_pairs(GgmlType::Q5_K, n, w, a) {
        let mut q = [0i8; QK_K];
        let qs = &x[Q5_K_QS..Q5_K_QS + 128];
        let qh = &x[Q5_K_QH..Q5_K_QH + 32];
        for c in 0..4 {
            for l in 0..32 {
                let h1 = ((qh[l] >> (2 * c)) & 1) << 4;
                let h2 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
                q[64 * c + l] = ((qs[32 * c + l] & 0x0F) | h1) as i8;
                q[64 * c + 32 + l] = ((qs[32 * c + l] >> 4) | h2) as i8;
            }
        }
        let sm = k4_scales_mins(&x[K4_SCALES..K4_SCALES + 12]);
        let sumi = k4_min_term(&sm[8..16], y);
        let yd = rd_f32(y, 0);
        k_lanes(&q, y, |s| sm[s] as i32, 32, rd_f16(x, 0) * yd, &mut sums);
        sumf -= rd_f16(x, 2) * yd * sumi as f32;
    }
    finish(sumf, &sums)
}

fn q6_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sums = [0f32; 8];
    for (x, y) in block_pairs(GgmlType::Q6_K, n, w, a) {
        let mut q = [0i8; QK_K];
        for h in 0..2 {
            let ql = &x[64 * h..64 * h + 64];
            let qh = &x[Q6_K_QH + 32 * h..Q6_K_QH + 32 * h + 32];
            let q = &mut q[128 * h..128 * h + 128];
            for l in 0..32 {
                q[l] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
                q[l + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                q[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                q[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            }
        }
        let sc = &x[Q6_K_SCALES..Q6_K_SCALES + 16];
        k_lanes(
            &q,
            y,
            |g| sc[g] as i8 as i32,
            16,
            rd_f16(x, Q6_K_D) * rd_f32(y, 0),
            &mut sums,
        );
    }
    finish(0.0, &sums)
}
