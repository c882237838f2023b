//! AVX-512 (F/BW/VL/VNNI) `vec_dot` kernels for the types that dominate the models: Q4_0, Q4_1,
//! Q5_0, Q8_0 (two 32-element blocks per 512-bit register) and Q4_K, Q5_K, Q6_K (64 elements per
//! register). Other types use their AVX2 kernel at this level.
//!
//! `vpdpbusd` (u8 x i8, 4 products summed into i32, no saturation) does the legacy blocks. Offset
//! formats (Q4_0: q-8, Q5_0: q-16) multiply the unsigned q and subtract offset*sum(y), also via
//! `vpdpbusd`. The K-quants keep `vpmaddubsw` (pairs fit i16, see dot_avx2) and fold the sub-block
//! scales in with `vpdpwssd`.
//!
//! Results are bit-identical to the AVX2 kernels (and so to llama.cpp on x86): only the integer
//! work is widened. Each i32 lane holds the same 4 products as ggml's lane (legacy: lanes 8..16
//! are the second block's; K-quants: lanes k and k+8 together are ggml's lane k), and the f32 part
//! runs on the same single 8-lane accumulator, block after block. That serial FMA chain (4 cycles
//! a block) is the price of exactness.

use std::arch::x86_64::*;

use super::blocks::*;
use super::x86_util::*;
use super::{check_dot_args, GgmlType, SimdLevel, VecDotFn};

/// The kernel for `t` at this level, if there is one. Panics if the CPU lacks the level: the
/// returned safe fns rely on it.
pub(super) fn kernel(t: GgmlType) -> Option<VecDotFn> {
    assert!(SimdLevel::Avx512.is_available());
    Some(match t {
        GgmlType::Q4_0 => q4_0_q8_0,
        GgmlType::Q4_1 => q4_1_q8_1,
        GgmlType::Q5_0 => q5_0_q8_0,
        GgmlType::Q8_0 => q8_0_q8_0,
        GgmlType::Q4_K => q4_k_q8_k,
        GgmlType::Q5_K => q5_k_q8_k,
        GgmlType::Q6_K => q6_k_q8_k,
        _ => return None,
    })
}

macro_rules! safe_kernels {
    ($($name:ident => $t:ident, $imp:ident;)*) => {$(
        fn $name(n: usize, w: &[u8], a: &[u8]) -> f32 {
            check_dot_args(GgmlType::$t, n, w, a);
            // SAFETY: `vec_dot_kernel_at` hands this out only when AVX-512 F/BW/VL/VNNI (and AVX2,
            // FMA, F16C) are present; `check_dot_args` proved all `n` elements of both rows in bounds.
            unsafe { $imp(n, w.as_ptr(), a.as_ptr()) }
        }
    )*};
}

safe_kernels! {
    q4_0_q8_0 => Q4_0, q4_0_impl;
    q4_1_q8_1 => Q4_1, q4_1_impl;
    q5_0_q8_0 => Q5_0, q5_0_impl;
    q8_0_q8_0 => Q8_0, q8_0_impl;
    q4_k_q8_k => Q4_K, q4_k_impl;
    q5_k_q8_k => Q5_K, q5_k_impl;
    q6_k_q8_k => Q6_K, q6_k_impl;
}

/// Bytes ahead of the current weight block to prefetch: decode streams weight rows one after another, and
/// the hardware prefetcher alone left the kernels waiting on memory (docs/speed.md).
pub(super) const PREFETCH_AHEAD: usize = 2048;

/// [a | b]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn join(a: __m256i, b: __m256i) -> __m512i {
    _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)
}

/// The 32 quant bytes at `p0` and the 32 at `p1` (two blocks) as one register.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn load_pair(p0: *const u8, p1: *const u8) -> __m512i {
    join(load256(p0), load256(p1))
}

/// Nibbles of two legacy blocks (16 qs bytes at `p0` and `p1`) in element order:
/// 128-bit lanes [p0 low, p0 high, p1 low, p1 high]. Built from broadcast loads ([p0 p0 p1 p1]) and
/// a masked shift rather than cross-lane permutes, which compete for the one shuffle port.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn nibbles_pair(p0: *const u8, p1: *const u8) -> __m512i {
    let v = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(load128(p0)), 0xFF00, load128(p1));
    let v = _mm512_mask_srli_epi16(v, 0xFF00_FF00, v, 4); // the odd 128-bit lanes
    _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
}

/// dx*dy of two legacy blocks (f16 scales at x0, y0 and x1, y1), each broadcast to 8 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn d_pair(x0: *const u8, y0: *const u8, x1: *const u8, y1: *const u8) -> (__m256, __m256) {
    let bits = rd16(x0) as u64 | (rd16(y0) as u64) << 16 | (rd16(x1) as u64) << 32 | (rd16(y1) as u64) << 48;
    let v = cvt_f16x4(bits); // [dx0, dy0, dx1, dy1]
    let d = _mm_mul_ps(v, _mm_movehdup_ps(v));
    (_mm256_broadcastss_ps(d), _mm256_broadcastss_ps(_mm_movehl_ps(d, d)))
}

/// Loop over `nb` legacy blocks two at a time. `$body` gets the two block indices and yields
/// (d0, d1, 16 f32 lanes: the 8 lane sums of each block). The f32 accumulation is ggml's: one
/// 8-lane accumulator, block after block. An odd last block runs as the pair (i, i), of which only
/// the first half is used (the body sees `i0 == i1`, a constant in that expansion).
macro_rules! sum_pairs {
    ($nb:expr, |$b0:ident, $b1:ident| $body:expr) => {{
        let nb: usize = $nb;
        let mut acc = _mm256_setzero_ps();
        let mut i = 0usize;
        while i + 1 < nb {
            let ($b0, $b1) = (i, i + 1);
            let (d0, d1, p) = $body;
            acc = _mm256_fmadd_ps(d0, _mm512_castps512_ps256(p), acc);
            acc = _mm256_fmadd_ps(d1, high_ps(p), acc);
            i += 2;
        }
        if i < nb {
            let ($b0, $b1) = (i, i);
            let (d0, _, p) = $body;
            acc = _mm256_fmadd_ps(d0, _mm512_castps512_ps256(p), acc);
        }
        hsum_ps(acc)
    }};
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn high_ps(p: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1))
}

/// ggml's 8 i32 lanes from 16 where lane k and lane k+8 cover elements of ggml's lane k.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn fold_lanes(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let zero = _mm512_setzero_si512();
    sum_pairs!(n / QK, |i0, i1| {
        let (x0, x1) = (x.add(i0 * Q8_0_BYTES), x.add(i1 * Q8_0_BYTES));
        let (y0, y1) = (y.add(i0 * Q8_0_BYTES), y.add(i1 * Q8_0_BYTES));
        let qx = load_pair(x0.add(2), x1.add(2));
        let qy = load_pair(y0.add(2), y1.add(2));
        // |x| as u8 (|-128| = 0x80 is right) times y with x's sign
        let sy = _mm512_mask_sub_epi8(qy, _mm512_movepi8_mask(qx), zero, qy);
        let p = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(qx), sy);
        let (d0, d1) = d_pair(x0, y0, x1, y1);
        (d0, d1, _mm512_cvtepi32_ps(p))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let zero = _mm512_setzero_si512();
    let eight = _mm512_set1_epi8(8);
    sum_pairs!(n / QK, |i0, i1| {
        let (x0, x1) = (x.add(i0 * Q4_0_BYTES), x.add(i1 * Q4_0_BYTES));
        let (y0, y1) = (y.add(i0 * Q8_0_BYTES), y.add(i1 * Q8_0_BYTES));
        let qy = load_pair(y0.add(2), y1.add(2));
        // sum (q-8)*y = sum q*y - sum 8*y
        let p = _mm512_dpbusd_epi32(zero, nibbles_pair(x0.add(2), x1.add(2)), qy);
        let p = _mm512_sub_epi32(p, _mm512_dpbusd_epi32(zero, eight, qy));
        let (d0, d1) = d_pair(x0, y0, x1, y1);
        (d0, d1, _mm512_cvtepi32_ps(p))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let zero = _mm512_setzero_si512();
    let sixteen = _mm512_set1_epi8(16);
    sum_pairs!(n / QK, |i0, i1| {
        let (x0, x1) = (x.add(i0 * Q5_0_BYTES), x.add(i1 * Q5_0_BYTES));
        let (y0, y1) = (y.add(i0 * Q8_0_BYTES), y.add(i1 * Q8_0_BYTES));
        let qy = load_pair(y0.add(2), y1.add(2));
        // bit e of qh is the 5th bit of element e, so the two qh words form the byte mask directly
        let qh0 = (x0.add(2) as *const u32).read_unaligned() as u64;
        let qh1 = (x1.add(2) as *const u32).read_unaligned() as u64;
        let nib = nibbles_pair(x0.add(6), x1.add(6));
        let q = _mm512_mask_add_epi8(nib, qh0 | (qh1 << 32), nib, sixteen);
        let p = _mm512_dpbusd_epi32(zero, q, qy);
        let p = _mm512_sub_epi32(p, _mm512_dpbusd_epi32(zero, sixteen, qy));
        let (d0, d1) = d_pair(x0, y0, x1, y1);
        (d0, d1, _mm512_cvtepi32_ps(p))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let zero = _mm512_setzero_si512();
    let mut summs = _mm_setzero_ps();
    let s = sum_pairs!(n / QK, |i0, i1| {
        let (x0, x1) = (x.add(i0 * Q4_1_BYTES), x.add(i1 * Q4_1_BYTES));
        let (y0, y1) = (y.add(i0 * Q8_1_BYTES), y.add(i1 * Q8_1_BYTES));
        // the m * s terms in block order, as in dot_avx2
        let d0 = dm_prod(x0, y0, &mut summs);
        let d1 = if i0 != i1 { dm_prod(x1, y1, &mut summs) } else { d0 };
        let qy = load_pair(y0.add(4), y1.add(4));
        let p = _mm512_dpbusd_epi32(zero, nibbles_pair(x0.add(4), x1.add(4)), qy);
        (d0, d1, _mm512_cvtepi32_ps(p))
    });
    s + _mm_cvtss_f32(_mm_movehdup_ps(summs))
}

// ---- K-quants ----

/// i16 lane indices for `vpermw`: lanes 0..16 pick sub-block scale `a`, lanes 16..32 scale `b`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn halves_idx(a: i16, b: i16) -> __m512i {
    _mm512_mask_blend_epi16(0xFFFF_0000, _mm512_set1_epi16(a), _mm512_set1_epi16(b))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k4_k5_impl(n: usize, x: *const u8, y: *const u8, q5: bool) -> f32 {
    let (xbytes, qs_off) = if q5 {
        (Q5_K_BYTES, Q5_K_QS)
    } else {
        (Q4_K_BYTES, Q4_K_QS)
    };
    let m4 = _mm512_set1_epi8(0x0F);
    let b4 = _mm512_set1_epi8(0x10);
    let idx = [halves_idx(0, 1), halves_idx(2, 3), halves_idx(4, 5), halves_idx(6, 7)];
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for i in 0..n / QK_K {
        let (bx, by) = (x.add(i * xbytes), y.add(i * Q8_K_BYTES));
        _mm_prefetch::<_MM_HINT_T0>(bx.add(PREFETCH_AHEAD) as *const i8);
        // lanes [y.d * d, y.d * dmin]
        let dd = _mm_mul_ps(_mm_set1_ps(f32_at(by)), cvt_f16x2(rd32(bx)));
        let (sc, min_term) = k4_scales_and_min_term(bx, by);
        acc_m = min_update(acc_m, dd, min_term, q5);
        let sc = _mm512_castsi128_si512(sc);
        // Q5_K: [qh | qh >> 1], so after shifting by 2j bit 0 of each byte is the 5th bit of
        // sub-block 2j (low half) and 2j+1 (high half)
        let mut hb = if q5 {
            let qh = load256(bx.add(Q5_K_QH));
            join(qh, _mm256_srli_epi16(qh, 1))
        } else {
            _mm512_setzero_si512()
        };
        let mut sumi = _mm512_setzero_si512();
        for (j, idx) in idx.iter().enumerate() {
            // 64 consecutive elements: 32 low nibbles (sub-block 2j), then 32 high (2j+1)
            let qbits = load256(bx.add(qs_off + 32 * j));
            let mut q = _mm512_and_si512(join(qbits, _mm256_srli_epi16(qbits, 4)), m4);
            if q5 {
                q = _mm512_or_si512(q, _mm512_and_si512(_mm512_slli_epi16(hb, 4), b4));
                hb = _mm512_srli_epi16(hb, 2);
            }
            let p16 = _mm512_maddubs_epi16(q, _mm512_loadu_si512(by.add(Q8_K_QS + 64 * j) as *const _));
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_permutexvar_epi16(*idx, sc), p16);
        }
        acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(fold_lanes(sumi)), acc);
    }
    hsum_ps(acc) + min_finish(acc_m, q5)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_k_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    k4_k5_impl(n, x, y, false)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_k_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    k4_k5_impl(n, x, y, true)
}

/// Q6_K, 64 elements per register; the -32 offset goes through the bsums as in dot_avx2.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6_k_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let m4 = _mm512_set1_epi8(0x0F);
    let m2 = _mm512_set1_epi8(0x03);
    // register r (0..4) covers groups 4r..4r+4 of 16 elements; i16 lane l belongs to group 4r + l/8
    let idx: [__m512i; 4] = std::array::from_fn(|r| {
        let lanes: [i16; 32] = std::array::from_fn(|l| (4 * r + l / 8) as i16);
        _mm512_loadu_si512(lanes.as_ptr() as *const _)
    });
    let mut acc = _mm256_setzero_ps();
    for i in 0..n / QK_K {
        let (bx, by) = (x.add(i * Q6_K_BYTES), y.add(i * Q8_K_BYTES));
        _mm_prefetch::<_MM_HINT_T0>(bx.add(PREFETCH_AHEAD) as *const i8);
        let d = f32_at(by) * f16_at(bx.add(Q6_K_D));
        let sc16 = _mm256_cvtepi8_epi16(load128(bx.add(Q6_K_SCALES)));
        let offset = _mm256_madd_epi16(sc16, load256(by.add(Q8_K_BSUMS)));
        let mut sumi = _mm512_setzero_si512();
        let sc = _mm512_castsi256_si512(sc16);
        for h in 0..2 {
            let ql = _mm512_loadu_si512(bx.add(64 * h) as *const _);
            let qh = load256(bx.add(Q6_K_QH + 32 * h));
            let qh = join(qh, _mm256_srli_epi16(qh, 2)); // bits 0-1 / 4-5: elements l, l+32 / l+64, l+96
            let lo = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(qh, m2), 4));
            let hi_h = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4), m2), 4);
            let hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), hi_h);
            for (k, q) in [lo, hi].into_iter().enumerate() {
                let yv = _mm512_loadu_si512(by.add(Q8_K_QS + 128 * h + 64 * k) as *const _);
                let p16 = _mm512_maddubs_epi16(q, yv);
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_permutexvar_epi16(idx[2 * h + k], sc), p16);
            }
        }
        let sumi = _mm256_sub_epi32(fold_lanes(sumi), _mm256_slli_epi32(offset, 5));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
}
